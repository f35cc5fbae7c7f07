"""The command line of the tools that are not Hydra mains (export, generate, sweep, report, the benchmarks):
`key=value` options over their defaults, with Hydra's spelling, so that one habit serves every command."""

from __future__ import annotations

import re
from typing import Callable

from project.runtime.errors import ConfigError

HELP = ("-h", "--help", "help")


def parse_options(
    argv: list[str],
    defaults: dict[str, str | None],
    *,
    doc: str | None = None,
    usage: str = "",
    rest: Callable[[str], bool] | None = None,
) -> tuple[dict[str, str | None], list[str]]:
    """(the options `defaults` names, with the values given; the other arguments `rest` accepts, in order).

    `--key=value`, as wandb's agent passes it, counts as `key=value`. An argument that is neither an option nor
    accepted by `rest` is a ConfigError naming the options. `doc`: printed, and the process ends, on -h/--help.
    """
    if doc is not None and any(arg in HELP for arg in argv):
        print(doc)
        raise SystemExit(0)
    options, others = dict(defaults), []
    for arg in argv:
        key, sep, value = arg.removeprefix("--").partition("=")
        if sep and key in defaults:
            options[key] = value
        elif rest is not None and rest(arg):
            others.append(arg)
        else:
            listed = ", ".join(f"{k}=" for k in defaults)
            raise ConfigError(f"unknown argument {arg!r}: the options are {listed}." + (f"\n{usage}" if usage else ""))
    return options, others


def parse_key_values(argv: list[str], defaults: dict[str, str], **kwargs) -> dict[str, str]:
    """The options alone, for a command that takes nothing else (see parse_options)."""
    return parse_options(argv, defaults, **kwargs)[0]  # type: ignore[return-value]


def true_or_false(key: str, value: str | None) -> bool:
    """`true`/`false` (any case) as a bool; anything else is a ConfigError naming `key`."""
    if str(value).lower() not in ("true", "false"):
        raise ConfigError(f"{key}={value}: choose true or false.")
    return str(value).lower() == "true"


# Decimal units as transformers and litdata read them (5GB, 50G), binary ones spelt out (2GiB).
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(text: str | int, setting: str) -> int:
    """Bytes of `5GB`, `50G`, `500MB`, `2GiB` or a plain number; anything else is a ConfigError naming `setting`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT]I?)B?|B)?\s*", str(text).upper())
    if not match or float(match[1]) <= 0:
        raise ConfigError(f"{setting}={text} is not a size: write it as 5GB, 500MB, 2GiB or a number of bytes.")
    return int(float(match[1]) * _UNITS[match[2] or ""])
