#!/usr/bin/env bash
# Installs everything the project, its tests and its CPU main job need on a fresh Debian machine
# with no GPU: Debian's lld-19 (FlyDSL 0.5 emits code object v6, which ld.lld 14 rejects with
# "unknown abi version"; kernels_fused.gfx950.toolchain picks an ld.lld >= 18), the CPU build of torch,
# and the package with its test extras (flydsl, triton for the interpreter, mpi4py + mpich), and the
# GPU machines' Triton in .toolchain/ for the host's PTX checks.
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

# pip's output goes to a log; what happened is said in one line. Where an index cannot be reached,
# pip prints a retry warning per package (and a warning per package for every configured local index
# that lacks it): some 35 lines for torch alone, none of them an error. The log is shown when an
# install fails, so a real error stays visible.
PIP_LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/cco-setup-pip.XXXXXX")
UNREACHABLE='Retrying \(Retry\(|connection broken by|Could not fetch URL|Max retries exceeded|NewConnectionError|ConnectTimeoutError|ReadTimeoutError|ProxyError|SSLError'

# pip_logged NAME ARGS...: `pip install ARGS` with its output in $PIP_LOG_DIR/NAME.log; its status.
pip_logged() {
    local log="$PIP_LOG_DIR/$1.log"
    shift
    "$PY" -m pip install "$@" >"$log" 2>&1
}

# unreachable NAME: whether pip's log NAME says an index could not be reached.
unreachable() { grep -qE "$UNREACHABLE" "$PIP_LOG_DIR/$1.log"; }

# installed_from NAME PACKAGE OTHERWISE: the file or URL pip's log NAME says PACKAGE came from, or
# OTHERWISE where it does not say.
installed_from() {
    local from
    from=$(sed -nE "/^ *(Processing|Downloading|Using cached) +[^ ]*$2-/{s/^ *(Processing|Downloading|Using cached) +([^ ]*).*/\2/p;q}" \
           "$PIP_LOG_DIR/$1.log")
    echo "${from:-$3}"
}

# show_failure NAME: pip's log NAME, for a failed install.
show_failure() {
    echo "[setup] pip failed; its output ($PIP_LOG_DIR/$1.log):" >&2
    cat "$PIP_LOG_DIR/$1.log" >&2
}

# Install torch before the package so its unpinned `torch` requirement is already met: a bare
# `pip install torch` takes PyPI's Linux wheel, which is the CUDA build (several GB) on x86-64.
# PyTorch's CPU wheel index is asked first (short timeout); where it cannot be reached, the default
# index is used, which gives the CPU build only where a CPU wheel of that version is on disk
# (pip's find-links) or the platform's PyPI wheel is CPU-only (aarch64, macOS).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    CCO_TORCH_SPEC=${CCO_TORCH_SPEC:-torch==2.13.0}
    CCO_TORCH_INDEX=${CCO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    echo "[setup] installing ${CCO_TORCH_SPEC}, CPU build, from ${CCO_TORCH_INDEX}"
    if pip_logged torch-cpu-index --timeout 15 --retries 1 --index-url "$CCO_TORCH_INDEX" "$CCO_TORCH_SPEC"; then
        if unreachable torch-cpu-index; then
            # pip found the wheel elsewhere: a find-links folder or an extra index of pip's configuration
            echo "[setup] ${CCO_TORCH_INDEX} unreachable; installed ${CCO_TORCH_SPEC} from" \
                 "$(installed_from torch-cpu-index torch "another source of pip's configuration")" \
                 "(pip's log: $PIP_LOG_DIR/torch-cpu-index.log)"
        fi
    else
        if unreachable torch-cpu-index; then
            echo "[setup] ${CCO_TORCH_INDEX} unreachable and no ${CCO_TORCH_SPEC} elsewhere in pip's sources:"
        else
            echo "[setup] ${CCO_TORCH_INDEX} did not give ${CCO_TORCH_SPEC}:" \
                 "$(grep -m 1 '^ERROR' "$PIP_LOG_DIR/torch-cpu-index.log" || echo "pip failed")"
        fi
        echo "[setup] installing ${CCO_TORCH_SPEC} from the default index" \
             "(a CUDA build of several GB on x86-64 Linux unless a CPU wheel is on disk)"
        if ! pip_logged torch-default-index "$CCO_TORCH_SPEC"; then
            show_failure torch-default-index
            exit 1
        fi
        echo "[setup] installed ${CCO_TORCH_SPEC} from $(installed_from torch-default-index torch "the default index")"
    fi
fi
"$PY" -c "import torch; print(f'[setup] torch {torch.__version__} (CUDA build: {torch.version.cuda is not None})')"

echo "[setup] installing cco with test extras"
if ! pip_logged cco -e ".[test]"; then
    show_failure cco
    exit 1
fi
if unreachable cco; then
    echo "[setup] an index was unreachable; pip found every package elsewhere (pip's log: $PIP_LOG_DIR/cco.log)"
fi
# The GPU machines' Triton (3.6), beside the installed one and not imported by it: the host tests
# compile the reduce-scatter along rows' persistent producer with it for sm_90 and read the order of
# its releases in the PTX (tests/python/cco/test_hopper_ptx.py), which differs between Triton versions.
TRITON_GPU=triton==3.6.0
TRITON_GPU_DIR=.toolchain/triton-3.6
if [ ! -f "$TRITON_GPU_DIR/triton/__init__.py" ]; then
    echo "[setup] installing ${TRITON_GPU} into ${TRITON_GPU_DIR} (the GPU machines' Triton, for PTX checks)"
    if ! pip_logged triton-gpu --no-deps --target "$TRITON_GPU_DIR" "$TRITON_GPU"; then
        show_failure triton-gpu
        exit 1
    fi
fi
"$PY" -c "import cco, kernels_fused, torch; print(f'[setup] ok: torch {torch.__version__}')"
