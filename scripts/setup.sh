#!/usr/bin/env bash
# Installs everything the project, its tests and its CPU main job need on a fresh Debian machine
# with no GPU: Debian's lld-19 (FlyDSL 0.5 emits code object v6, which ld.lld 14 rejects with
# "unknown abi version"; kernels_fused.gfx950.toolchain picks an ld.lld >= 18), the CPU build of torch,
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
# `pip install torch` takes PyPI's Linux wheel, which is the CUDA build (several GB) on x86-64.
# PyTorch's CPU wheel index is asked first (short timeout); where it cannot be reached, the default
# index is used, which gives the CPU build only where a CPU wheel of that version is on disk
# (pip's find-links) or the platform's PyPI wheel is CPU-only (aarch64, macOS).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    CCO_TORCH_SPEC=${CCO_TORCH_SPEC:-torch==2.13.0}
    CCO_TORCH_INDEX=${CCO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    echo "[setup] installing ${CCO_TORCH_SPEC}, CPU build, from ${CCO_TORCH_INDEX}"
    if ! "$PY" -m pip install -q --timeout 15 --retries 1 --index-url "$CCO_TORCH_INDEX" "$CCO_TORCH_SPEC"; then
        echo "[setup] ${CCO_TORCH_INDEX} unreachable: installing ${CCO_TORCH_SPEC} from the default index" \
             "(a CUDA build of several GB on x86-64 Linux unless a CPU wheel is on disk)"
        "$PY" -m pip install -q "$CCO_TORCH_SPEC"
    fi
fi
"$PY" -c "import torch; print(f'[setup] torch {torch.__version__} (CUDA build: {torch.version.cuda is not None})')"

echo "[setup] installing cco with test extras"
"$PY" -m pip install -q -e ".[test]"
"$PY" -c "import cco, kernels_fused, torch; print(f'[setup] ok: torch {torch.__version__}')"
