#!/usr/bin/env bash
# `make gpu-check` on a GPU node that cannot reach a package index, from this repository and the wheels that
# `make gpu-wheels` (project.tooling.gpu_check.wheels) fetched on a machine that can:
#
#     scripts/gpu_check_offline.sh WHEELS_DIR [project.gpu_check options: minutes=10 devices=N out=DIR]
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

# The wheels whose distribution this Python lacks, and those of the packages the project is tested at one
# version of (Lightning, Hydra, litdata) where the node has another; its numpy and the rest stay the node's.
missing=$("$python" - "$wheels" <<'EOF'
import importlib.metadata as metadata, pathlib, re, sys
pinned = {"lightning", "pytorch-lightning", "lightning-utilities", "torchmetrics", "hydra-core", "omegaconf",
          "antlr4-python3-runtime", "litdata"}
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    canonical = re.sub(r"[-_.]+", "-", name).lower()
    try:
        if canonical in pinned and metadata.version(canonical) != version:
            print(wheel)
    except metadata.PackageNotFoundError:
        print(wheel)
EOF
)
if [ -n "$missing" ]; then
    echo "installing into $site: $(echo "$missing" | xargs -n1 basename | cut -d- -f1 | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one wheel per word
    "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" $missing
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m project.gpu_check "$@"
