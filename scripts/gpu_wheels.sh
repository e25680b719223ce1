#!/usr/bin/env bash
# Fetch the wheels that scripts/gpu_check.sh installs from .whl/ on a GPU machine without
# network (Python 3.12, x86-64 Linux, CUDA 13, with CuPy, PyTorch and cuda-python already
# there), into .whl/ at the repository's root (kept out of git through .git/info/exclude):
#
#   bash scripts/gpu_wheels.sh            # PIP="python3 -m pip" to choose the pip
#
#   nvmath-python 1.0.1          cuBLASLt's stateful Matmul, which captures into CUDA graphs.
#                                Its other needs (cuda-bindings, cuda-core >= 0.5,
#                                cuda-pathfinder >= 1.5.1, numpy) and cuBLAS itself
#                                (nvidia-cublas) are on such a machine: check with
#                                `python3 -m pip show cuda-core cuda-pathfinder` there.
#   nvidia-cudnn-frontend 1.32.0 cuDNN's graph API (the cuDNN library, nvidia-cudnn-cu13, is
#                                there). Its declared needs nvidia-cutlass-dsl and
#                                apache-tvm-ffi serve only its CuTe DSL kernels, which
#                                `import cudnn` loads lazily: left out.
# Only these two, no dependencies: the device machine's own packages stay in use.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP=${PIP:-python3 -m pip}
WHEELS=(nvmath-python==1.0.1 nvidia-cudnn-frontend==1.32.0)

mkdir -p .whl
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
