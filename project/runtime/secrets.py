"""Secrets stay out of what a run writes: config.yaml, Hydra's record, train.log, wandb.

A setting is secret when its name says so (api_key, token, secret, password, credential, access key, ...):
a user who passes `+logger.wandb.api_key=...`, a data source's token or boto3's credentials in
`data.storage_options` on the command line must not find it in a run folder they share, or in a wandb
project. Environment variables (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY) are never written by the platform
in the first place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

# access_key: boto3's aws_access_key_id, which with its secret makes a usable credential and names an account.
# Not a tokenizer (data.tokenizer is a path) nor a count of tokens.
SECRET_NAME = re.compile(
    r"api[_-]?key|token(?!izer|s)|secret|password|passwd|credential|private[_-]?key|access[_-]?key", re.IGNORECASE
)
REDACTED = "<redacted>"


def secret_values(cfg: DictConfig) -> set[str]:
    """The values of every secret-looking setting, as they would appear in text."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if SECRET_NAME.search(str(key)) and value not in (None, ""):
                    found.add(str(value))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(OmegaConf.to_container(cfg, resolve=False))
    return found


def redact_text(text: str, secrets: set[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):  # a secret that contains another goes first
        text = text.replace(secret, REDACTED)
    return text


def redacted_container(cfg: DictConfig) -> dict:
    """The resolved config as plain data, secret-looking values replaced."""

    def scrub(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: REDACTED if SECRET_NAME.search(str(k)) and v not in (None, "") else scrub(v) for k, v in node.items()
            }
        if isinstance(node, list):
            return [scrub(item) for item in node]
        return node

    return scrub(OmegaConf.to_container(cfg, resolve=True))


def without_secrets(node: Any) -> Any:
    """Plain data with every secret-looking key left out, for records a later process reads back as settings
    (a checkpoint's data options, which project.hf.export hands to boto3): a placeholder there would be sent as a
    credential, where a missing key lets boto3 take the environment's."""
    if isinstance(node, Mapping):
        return {k: without_secrets(v) for k, v in node.items() if not SECRET_NAME.search(str(k))}
    if isinstance(node, (list, tuple)):
        return [without_secrets(item) for item in node]
    return node
