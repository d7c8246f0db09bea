#!/usr/bin/env bash
# Installs everything the project, its tests and its CPU main job need on a fresh Debian machine
# with no GPU: Debian's lld-19 (FlyDSL 0.5 emits code object v6, which ld.lld 14 rejects with
# "unknown abi version"; kernels_fused.flydsl_toolchain picks an ld.lld >= 18), the CPU build of torch,
# and the package with its test extras (flydsl, triton for the interpreter, mpi4py + mpich).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

if ! command -v ld.lld-19 >/dev/null 2>&1; then
    echo "[setup] installing lld-19 (Debian)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq lld-19 >/dev/null
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
