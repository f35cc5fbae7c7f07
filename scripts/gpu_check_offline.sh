#!/usr/bin/env bash
# `make gpu-check` on a GPU node that cannot reach a package index, from this repository and the wheels that
# `make gpu-wheels` (tools.gpu_check.wheels) fetched on a machine that can:
#
#     scripts/gpu_check_offline.sh WHEELS_DIR [tools.gpu_check options: minutes=10 devices=N out=DIR]
#
# Run it in the repository's root. It uses the node's python3 (PYTHON=... for another), which must have torch;
# each wheel whose package that Python lacks (or has at another version than the tests', for Lightning, Hydra and
# litdata) is installed into a folder of its own (SITE, default /tmp/llama-platform-site), put before the node's
# packages on PYTHONPATH; the node's other packages are used as they are.
set -euo pipefail

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
    echo "error: usage: scripts/gpu_check_offline.sh WHEELS_DIR [minutes=10 devices=N out=DIR]: WHEELS_DIR is the" \
        "folder \`make gpu-wheels\` wrote (on a machine with a package index)." >&2
    exit 2
fi
wheels=$1
shift
python=${PYTHON:-python3}
site=${SITE:-/tmp/llama-platform-site}

if ! "$python" -c "import torch" 2>/dev/null; then
    echo "error: $python has no torch: give the node's Python with torch as PYTHON=/path/to/python3." >&2
    exit 2
fi

# Installs, into $site, the wheels whose modules this Python cannot import and those of the packages the project
# is tested at one version of (Lightning, Hydra, litdata) where the node has another; its numpy and the rest stay
# the node's. Then it imports what the check imports, and installs the wheel of any module still missing: a node
# can hold a package's metadata without a module that imports (an H200 node's boto3 did), and the metadata alone
# would have said it was there.
"$python" - "$wheels" "$site" <<'EOF'
import importlib.metadata as metadata, importlib.util, os, pathlib, re, subprocess, sys, zipfile
wheels, site = pathlib.Path(sys.argv[1]), sys.argv[2]
pinned = {"lightning", "pytorch-lightning", "lightning-utilities", "torchmetrics", "hydra-core", "omegaconf",
          "antlr4-python3-runtime", "litdata"}
needed = "import hydra, omegaconf, litdata, lightning, project.data.prepare, project.train"

def modules(wheel):
    """The top-level modules a wheel installs (its files' first path parts, metadata left out)."""
    tops = {entry.split("/")[0] for entry in zipfile.ZipFile(wheel).namelist()}
    return {top.removesuffix(".py") for top in tops if not top.endswith((".dist-info", ".data"))}

def importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False

def install(chosen):
    print("installing into", site + ":", " ".join(sorted(w.name.split("-")[0] for w in chosen)), flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--upgrade", "--target", site, *map(str, chosen)])
    if done.returncode != 0:
        sys.exit(f"error: pip could not install the wheels above into {site}: were they fetched for this Python "
                 f"({sys.version_info.major}.{sys.version_info.minor})? `make gpu-wheels GPU_PYTHON=...` fetches them.")

first = []
for wheel in sorted(wheels.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    canonical = re.sub(r"[-_.]+", "-", name).lower()
    try:
        installed = metadata.version(canonical)
    except metadata.PackageNotFoundError:
        installed = None
    names = {m for m in modules(wheel) if m.isidentifier()}
    if installed is None or not all(map(importable, names)) or (canonical in pinned and installed != version):
        first.append(wheel)
if first:
    install(first)
env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
for _ in range(len(list(wheels.glob("*.whl")))):
    probe = subprocess.run([sys.executable, "-c", needed + "\nprint('ok')"], env=env, capture_output=True, text=True)
    if probe.returncode == 0:
        break
    found = re.search(r"No module named '([^'.]+)", probe.stderr)
    provider = [w for w in wheels.glob("*.whl") if found and found.group(1) in modules(w)]
    if not provider:
        sys.exit(f"error: this Python cannot import what the check needs, and no wheel in {wheels} provides "
                 f"it:\n{probe.stderr[-2000:]}")
    install(provider)
EOF
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m tools.gpu_check "$@"
