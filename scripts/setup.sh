#!/usr/bin/env bash
# Installs everything the project, its tests and its CPU main job need on a fresh Debian machine
# with no GPU: Debian's lld (FlyDSL links gfx950 code objects with ld.lld), the CPU build of torch,
# and the package with its test extras (flydsl, triton for the interpreter, mpi4py + mpich).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

if ! command -v ld.lld >/dev/null 2>&1; then
    echo "[setup] installing lld (Debian)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq lld >/dev/null
fi

# Install torch before the package so its unpinned `torch` requirement is already met: a bare
# `pip install torch` would pull a multi-GB CUDA build onto a machine with no GPU.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing ${CCO_TORCH_SPEC:=torch==2.13.0} (CPU build on this platform)"
    "$PY" -m pip install -q "$CCO_TORCH_SPEC"
fi

echo "[setup] installing cco with test extras"
"$PY" -m pip install -q -e ".[test]"
"$PY" -c "import cco, kernels_fused, torch; print(f'[setup] ok: torch {torch.__version__}')"
