#!/usr/bin/env bash
# Installs Horovod (PyTorch + gloo, MPI where the machine has it) into the environment of PYTHON, from a
# wheel built against that environment's torch once per machine, Python and torch version, and kept in
# CACHE_DIR: PyPI has Horovod's source only, and a build takes about 3 minutes on 2 cores.
#   usage: scripts/install_horovod.sh PYTHON VERSION CACHE_DIR
set -euo pipefail
python=$1 version=$2 cache=$3
bin=$(cd "$(dirname "$python")" && pwd)
export PATH="$bin:$PATH"  # a cmake installed below, into the environment, is found by Horovod's build
cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")')
tag=$("$python" -c 'import sys, platform, torch; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}-{platform.machine()}")')
# The script's own hash in the name: a changed recipe builds anew instead of reusing an older wheel.
dir="$cache/horovod-$version-$tag-$(sha1sum "$0" | cut -c1-8)"
if ! ls "$dir"/horovod-*.whl >/dev/null 2>&1; then
  command -v c++ >/dev/null || { echo "make install-horovod: Horovod compiles C++: install a compiler (g++) first" >&2; exit 1; }
  echo "building Horovod $version against $tag (about 3 minutes, once per machine; the wheel is kept in $dir)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$python" -m pip download -q --no-deps --no-binary horovod "horovod==$version" -d "$work"
  tar xzf "$work/horovod-$version.tar.gz" -C "$work"
  src="$work/horovod-$version"
  # Horovod 0.28.1 compiles as C++14; torch's headers since 2.x need C++17 ("C++17 or later compatible compiler is required").
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || { echo "Horovod $version's CMakeLists.txt changed: the C++17 patch does not apply" >&2; exit 1; }
  command -v cmake >/dev/null || "$python" -m pip install -q cmake
  "$python" -m pip install -q "setuptools>=68" wheel
  command -v mpicxx >/dev/null || export HOROVOD_WITHOUT_MPI=1  # gloo only, where there is no MPI
  if [ -n "$cuda" ]; then
    # A CUDA torch: reduce on the GPU with NCCL, from the NCCL that torch's wheels bring where no other is named.
    # Not tried here (no GPU on this project's machine); needs nvcc (CUDA_HOME).
    export HOROVOD_GPU_OPERATIONS=NCCL
    nccl=$("$python" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)
    [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -z "$nccl" ] || export HOROVOD_NCCL_HOME="$nccl"
  fi
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" "$src"
  mkdir -p "$cache"
  # Whole or not at all: a killed build leaves no wheel; a build that finished beside this one keeps its own.
  mv "$work/wheel" "$dir.partial.$$"
  mv -T "$dir.partial.$$" "$dir" 2>/dev/null || rm -rf "$dir.partial.$$"
fi
"$python" -m pip install -q --force-reinstall --no-deps "$dir"/horovod-*.whl
"$python" -m pip install -q cloudpickle psutil pyyaml packaging "cffi>=1.4"  # Horovod's own needs
"$python" -c "import horovod.torch as hvd; import horovod; print('installed horovod', horovod.__version__, 'with gloo' if hvd.gloo_built() else 'without gloo', 'and MPI' if hvd.mpi_built() else '')"
