"""The command line of project.train, prepare and plan, checked before Hydra composes it: a typo in a group,
a setting or a flag is answered with the names it meant, in one paragraph."""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from project.config.trainer import COMPUTED_TRAINER_KEYS
from project.runtime.errors import ConfigError
from project.runtime.folders import unwritable

CONF = Path(__file__).resolve().parents[2] / "conf"


def close_match(word: str, choices: list[str]) -> str:
    """` Did you mean llama3_8b or llama2_7b?`: the names `word` most likely meant, or "" when none is close."""
    names = closest_names(word, choices)
    return f" Did you mean {' or '.join(names)}?" if names else ""


# The size at the end of a part of a preset's name: `7b`, `80gb`, `small10m`, `8x7b` (eight experts of 7b: 56b).
_SIZE = re.compile(r"(\d+(?:\.\d+)?)(?:x(\d+(?:\.\d+)?))?([a-z]+)$")


def closest_names(word: str, choices: list[str]) -> list[str]:
    """The one or two of `choices` that `word` most likely meant.

    Spelling alone (difflib) takes `llama3_7b` for `llama3_70b`, ten times larger, and `h100` for `h200`: the
    names also score for sharing the typed name's family (its first part, or the whole typed name as their
    start: `h100` -> `h100_80gb`) and lose for a size far from the typed one (7b is near 7b and 8b, far from
    70b). Two names are given when both are within half as large again of a typed size (`llama3_8b or
    llama2_7b`).
    """
    pool = set(difflib.get_close_matches(word, choices, n=len(choices), cutoff=0.6))
    pool.update(c for c in choices if len(word) >= 2 and _family(word, c))
    if not pool:
        return []
    size = _size_of(word)

    def distance(choice: str) -> float | None:
        """How many times larger or smaller the choice's size is, on a log scale; None without sizes of one unit."""
        other = _size_of(choice)
        if size is None or other is None or other[1] != size[1]:
            return None
        return abs(math.log(other[0] / size[0]))

    def score(choice: str) -> float:
        spelling = difflib.SequenceMatcher(None, word, choice).ratio()
        family = _family(word, choice)
        apart = distance(choice)
        return spelling + 0.5 * family - 0.5 * (apart if apart is not None else 1.0 if size else 0.0)

    ranked = sorted(pool, key=lambda c: (-score(c), c))
    near = [c for c in ranked[:2] if (d := distance(c)) is not None and d <= math.log(1.5)]
    return near if len(near) == 2 else ranked[:1]


def _family(word: str, choice: str) -> bool:
    """`choice` starts with the typed name, or shares its first part (`h100` and `h100_80gb`, `llama3_7b` and
    `llama3_8b`)."""
    return choice.startswith(word) or choice.split("_")[0] == word.split("_")[0]


def _size_of(name: str) -> tuple[float, str] | None:
    """The last size token of a name and its unit (`llama3_70b` -> (70, "b")), or None."""
    for token in reversed(name.lower().split("_")):
        if match := _SIZE.search(token):
            count, each, unit = match.groups()
            value = float(count) * (float(each) if each else 1.0)
            return (value, unit) if value > 0 else None
    return None


def check_command_line(argv: list[str], config_name: str = "train") -> None:
    """Compose the config from `argv` as Hydra will, and answer what it refuses (a config group option
    that does not exist, a key that is not in the config, an override that does not parse) as one
    paragraph with a suggestion, instead of Hydra's message and traceback hint. Command lines with
    Hydra's own flags (-m, --cfg, ...) are left to Hydra."""
    _check_flags(argv, config_name)
    if any(arg.startswith("-") for arg in argv):
        return
    _check_mappings_kept(argv, config_name)
    # Hydra's own settings are Hydra's to check, but for its search path: it adds config files (a planned sweep's
    # layouts).
    overrides = [
        arg for arg in argv if not arg.lstrip("+~").startswith("hydra.") or arg.startswith("hydra.searchpath=")
    ]
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name, overrides=overrides)
    except HydraException as error:
        raise ConfigError(_explain(error, overrides, config_name)) from None
    _check_run_dir(argv, cfg)


# Hydra's own command-line flags (`--hydra-help` lists them); any other `--name` is an argparse habit.
HYDRA_FLAGS = {
    "--help",
    "--hydra-help",
    "--version",
    "--cfg",
    "--resolve",
    "--package",
    "--run",
    "--multirun",
    "--shell-completion",
    "--config-path",
    "--config-name",
    "--config-dir",
    "--info",
    "--experimental-rerun",
}


def _check_flags(argv: list[str], config_name: str) -> None:
    """`--max_steps 10` or `--max_steps=10` gets the override it meant (`trainer.max_steps=10`), not Hydra's usage
    text."""
    for i, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if not flag.startswith("--") or flag in HYDRA_FLAGS or flag == "--":
            continue
        if not equals and i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
            value = argv[i + 1]
        name = flag[2:].replace("-", "_")
        key = _setting_named(name, config_name) or name
        override = f"{key}={value or 'VALUE'}"
        raise ConfigError(
            f"{arg}: settings are Hydra overrides, key=value without dashes: write {override} "
            f"(e.g. `python -m project.{config_name} {override}`)."
        )


def _check_mappings_kept(argv: list[str], config_name: str) -> None:
    """`optim=muon` reads as choosing an option of a group, but `optim` is a mapping of settings in the primary
    config: Hydra would put the word in its place and the run fail later, far from the cause. Say which keys it
    takes. (A mapping given as a whole, `{...}`, or null is left to Hydra.)"""
    primary = OmegaConf.load(CONF / f"{config_name}.yaml")
    for arg in argv:
        key, equals, value = arg.partition("=")
        if not equals or key.startswith(("+", "~", "hydra.")) or (CONF / key.replace(".", "/")).is_dir():
            continue
        node = OmegaConf.select(primary, key, default=None)
        if not isinstance(node, DictConfig) or value.strip().startswith("{") or value.strip() == "null":
            continue
        keys = [str(k) for k in node.keys()]
        example = next((k for k in keys if not k.startswith("_")), keys[0] if keys else "KEY")
        no_group = "" if "." in key else f" (there is no conf/{key}/ group yet)"
        raise ConfigError(
            f"{arg}: {key} is a mapping of settings in conf/{config_name}.yaml, not a config group with options to "
            f"choose by name{no_group}: set its keys instead, e.g. {key}.{example}=..., of: {', '.join(keys)}."
        )


def _setting_named(name: str, config_name: str) -> str | None:
    """The full key of the setting whose last part is `name` (max_steps -> trainer.max_steps), or the closest one."""
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = OmegaConf.to_container(compose(config_name), resolve=False)
    except HydraException:
        return None
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            keys.append(f"{prefix}{key}")
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")

    walk(cfg, "")
    if name in keys:
        return name
    exact = [key for key in keys if key.rpartition(".")[2] == name]
    if exact:
        return min(exact, key=len)
    close = difflib.get_close_matches(name, keys, n=1) or difflib.get_close_matches(
        name, [k.rpartition(".")[2] for k in keys], n=1
    )
    return next((key for key in keys if close and (key == close[0] or key.endswith("." + close[0]))), None)


def _check_run_dir(argv: list[str], cfg: DictConfig) -> None:
    """Hydra makes the run directory before any of our code runs, and answers a folder it cannot write
    with a traceback: say it first. The directory is hydra.run.dir, or by default a folder in paths.log_dir."""
    given = [arg.partition("=")[2] for arg in argv if arg.startswith("hydra.run.dir=")]
    setting, folder = (
        ("hydra.run.dir", given[-1]) if given else ("paths.log_dir", OmegaConf.select(cfg, "paths.log_dir"))
    )
    problem = unwritable(folder) if folder else None
    if problem:
        raise ConfigError(
            f"{setting}={folder}: cannot make the run directory there ({problem}). Choose a folder you can write to "
            "with hydra.run.dir=DIR (or paths.log_dir=DIR, where run directories go by default)."
        )


def strategies_with(setting: str) -> list[str]:
    """The strategy groups that have `setting`."""
    return [p.stem for p in sorted((CONF / "strategy").glob("*.yaml")) if setting in OmegaConf.load(p)]


def _explain(error: HydraException, overrides: list[str], config_name: str) -> str:
    message = str(error)
    if missing := re.search(r"Could not find '([\w/]+)/([^']+)'", message):
        group, name = missing.groups()
        options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        return (
            f"{group}={name}: there is no conf/{group}/{name}.yaml.{close_match(name, options)} Choose one of: "
            f"{', '.join(options)}."
        )
    if several := re.search(r"Multiple values for (\w+)\.", message):
        group = several.group(1)
        several_ok = (
            " or callbacks=[a,b] for several (each keeps the default callbacks)" if group == "callbacks" else ""
        )
        return (
            f"+{group}=...: the group {group} is in the config already (conf/train.yaml's defaults): write "
            f"{group}=NAME to choose another{several_ok}."
        )
    if unknown := re.search(r"Could not override '([^']+)'", message):
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        if parent == "trainer" and leaf in COMPUTED_TRAINER_KEYS:  # adding it with + would only be refused next
            return f"trainer.{leaf} is computed by project.train: {COMPUTED_TRAINER_KEYS[leaf]}."
        if parent == "strategy" and (others := strategies_with(leaf)):  # a setting of other strategies
            chosen = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("strategy=")), None)
            which = f"strategy={chosen}" if chosen else "this run's strategy"
            return (
                f"strategy.{leaf} is not a setting of {which}: it is one of strategy={', '.join(others)}. Choose one "
                "of those, or remove the setting."
            )
        groups_only = [o for o in overrides if (CONF / o.split("=")[0]).is_dir()]  # the structure, without the typo
        try:
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                base = compose(config_name, overrides=groups_only)
            node = OmegaConf.select(base, parent) if parent else base
            siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        except HydraException:
            siblings = []
        where = f"in {parent}" if parent else "at the top level"
        listed = f" Settings there: {', '.join(siblings)}." if siblings and len(siblings) <= 20 else ""
        return (
            f"{key}: no such setting {where}.{close_match(leaf, siblings)}{listed} To add a new key on purpose, write "
            f"+{key}=VALUE."
        )
    first_line = message.strip().splitlines()[0]
    return f"{first_line} (Hydra's override syntax: https://hydra.cc/docs/advanced/override_grammar/basic/)."
