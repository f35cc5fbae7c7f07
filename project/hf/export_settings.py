"""project.export's settings, read and checked without torch, so that a mistake is answered before the imports."""

from __future__ import annotations

import os
from pathlib import Path

from project.checkpoint.urls import is_remote
from project.model.config import DTYPE_NAMES
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError
from project.runtime.folders import unwritable

DEFAULTS = {
    "ckpt_path": None,
    "output_dir": None,
    "tokenizer": None,
    "dtype": "float32",
    "overwrite": "false",
    "max_shard_size": "5GB",
}
USAGE = (
    "usage: python -m project.export ckpt_path=PATH [output_dir=DIR] [tokenizer=PATH] "
    "[dtype=float32|bfloat16|float16] [max_shard_size=5GB] [overwrite=true]"
)


def parse_args(argv: list[str], doc: str | None = None) -> dict[str, str | None]:
    """`doc`: what --help prints (project.hf.export's docstring)."""
    args = parse_key_values(argv, DEFAULTS, doc=doc, usage=USAGE)
    if not args["ckpt_path"]:
        raise ConfigError(f"ckpt_path= is required.\n{USAGE}")
    args["output_dir"] = args["output_dir"] or str(default_output_dir(args["ckpt_path"]))
    if args["dtype"] not in DTYPE_NAMES:
        raise ConfigError(f"dtype={args['dtype']} is not one of {list(DTYPE_NAMES)}.")
    if args["overwrite"].lower() not in ("true", "false"):
        raise ConfigError(f"overwrite={args['overwrite']} must be true or false.")
    return args


def default_output_dir(ckpt_path: str) -> Path:
    """`outputs/hf/<run>-<checkpoint>` for a checkpoint in a run's checkpoints/ folder, else
    `outputs/hf/<checkpoint>`, under $PROJECT_ROOT: the last and the best checkpoint of a run get folders apart."""
    path = Path(ckpt_path.split("://", 1)[-1]) if is_remote(ckpt_path) else Path(ckpt_path).absolute()
    name = path.stem if path.suffix == ".ckpt" else path.name
    if path.parent.name == "checkpoints":
        name = f"{path.parent.parent.name}-{name}"
    return Path(os.environ.get("PROJECT_ROOT", ".")) / "outputs" / "hf" / name


def check_output_dir(out: Path, overwrite: bool) -> None:
    """The export is built beside output_dir, then moved into it: a folder it cannot write, or one holding files
    and no overwrite=true, is refused before anything is read."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file, not a directory.")
    if problem := unwritable(out.parent) or (out.is_dir() and unwritable(out)):
        raise ConfigError(f"output_dir={out}: cannot write there ({problem}); choose an output_dir you can write to.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"output_dir {out} exists and is not empty; choose another or pass overwrite=true "
            "(which replaces the files an export writes and leaves any others alone)."
        )
