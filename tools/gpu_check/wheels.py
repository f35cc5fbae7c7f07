"""Wheels for a GPU node without a package index: `make gpu-wheels`, or

    python -m tools.gpu_check.wheels [out=gpu-wheels] [python=3.12] [platform=manylinux_2_28_x86_64]

Many GPU nodes have a Python with torch (and often Lightning) but no Hydra, OmegaConf or litdata, and cannot
reach a package index. On a machine that can, in this project's environment, this writes into `out` a wheel of
every package the check's runs import beyond torch, at the versions installed here (the ones the tests ran with),
built for the node's Python version and platform: the closure of the project's runtime requirements, without
torch and torchvision and what only they need. Pure-Python packages published as source only are built into
wheels here. scripts/gpu_check_offline.sh then installs the missing ones on the node and runs the check.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError, exit_on_config_error

DEFAULTS = {"out": "gpu-wheels", "python": "3.12", "platform": "manylinux_2_28_x86_64"}
# What the check's runs import (project.train with logger=csv, project.prepare): the project's runtime
# requirements (pyproject.toml) less wandb, which a run with the csv logger never imports; and torchao, float8's.
ROOTS = (
    "hydra-core", "lightning", "litdata", "tokenizers", "sentencepiece", "safetensors", "tqdm", "PyYAML",
    "torchao",  # strategy.float8 (gpu_check float8=...)
)  # fmt: skip
# The node brings these: torch itself, and torchvision, which litdata declares and no token loader needs.
NODE_PROVIDES = frozenset({"torch", "torchvision"})
# Older manylinux tags that wheels built for `platform` may carry instead (pip matches each tag exactly),
# for the platform's processor.
OLDER_TAGS = ("manylinux_2_17_{arch}", "manylinux2014_{arch}", "manylinux_2_5_{arch}", "manylinux1_{arch}")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots=ROOTS, skip=NODE_PROVIDES) -> dict[str, str]:
    """{distribution: installed version} of `roots` and everything they require here (extras left out),
    except `skip` and what is reached only through it."""
    skip = {canonical(name) for name in skip}
    found: dict[str, str] = {}
    pending = [canonical(name) for name in roots]
    while pending:
        name = pending.pop()
        if name in found or name in skip:
            continue
        found[name] = metadata.version(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonical(requirement.name))
    return dict(sorted(found.items()))


def download(packages: dict[str, str], out: Path, python: str, platform: str) -> list[str]:
    """Each package's wheel for the node into `out`; those published as source only are built here. Returns
    the names that had to be built."""
    out.mkdir(parents=True, exist_ok=True)
    arch = next((a for a in ("x86_64", "aarch64", "ppc64le", "s390x") if platform.endswith(a)), "x86_64")
    tags = [platform, *(t.format(arch=arch) for t in OLDER_TAGS if t.format(arch=arch) != platform)]
    built = []
    for name, version in packages.items():
        pins = [f"{name}=={version}"]
        fetch = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out)]
        fetch += ["--python-version", python, "--implementation", "cp", *(f"--platform={t}" for t in tags)]
        if subprocess.run([*fetch, *pins], capture_output=True, text=True).returncode == 0:
            continue
        build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), *pins]
        finished = subprocess.run(build, capture_output=True, text=True)
        if finished.returncode != 0:
            raise ConfigError(
                f"{name}=={version}: no wheel for Python {python} on {platform}, and building one failed:\n"
                f"{finished.stderr[-1500:]}\nGive the node's Python as python=X.Y and its platform as platform=TAG."
            )
        built.append(name)
    return built


@exit_on_config_error()
def main() -> None:
    args = parse_key_values(sys.argv[1:], DEFAULTS, doc=__doc__)
    if not re.fullmatch(r"3\.\d+", args["python"]):
        raise ConfigError(f"python={args['python']}: give the GPU node's Python version as 3.X (python3 --version).")
    packages = closure()
    out = Path(args["out"])
    print(f"fetching {len(packages)} wheels for Python {args['python']} on {args['platform']} into {out}", flush=True)
    built = download(packages, out, args["python"], args["platform"])
    print(
        f"wrote {len(packages)} wheels into {out}" + (f" (built here from source: {', '.join(built)})" if built else "")
    )
    print(f"copy {out} and this repository to the node, then, in the repository: scripts/gpu_check_offline.sh {out}")


if __name__ == "__main__":
    main()
