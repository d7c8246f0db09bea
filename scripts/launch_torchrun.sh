#!/usr/bin/env bash
# Launch ranks of GemmAllReduceOp with torchrun (CPU ranks; pass --device auto for one GPU per rank).
#
#   scripts/launch_torchrun.sh [NPROC] [cco.demo arguments...]
#   scripts/launch_torchrun.sh 2 --shape 1024x7168x2048 --mode fused --gather-dtype fp8
#
# Each rank builds its communicator from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
# MASTER_PORT, LOCAL_RANK); in your own program that is:
#
#   from cco.comm import Communicator
#   from cco.op import GemmAllReduceOp
#   with Communicator.from_env() as comm, GemmAllReduceOp(comm, n=N, k=K, m_max=M) as op:
#       op.self_test()
#       out = op(a, b_pre, a_scale, b_scale)
#
# Multi-node: replace --standalone with --nnodes, --node-rank and --rdzv-endpoint (see torchrun --help).
set -euo pipefail
# NPROC only where the first argument is a positive integer; anything else goes to cco.demo
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: scripts/launch_torchrun.sh [NPROC] [cco.demo arguments...]"
    echo "  NPROC: a positive integer, default 2; the demo's arguments: python -m cco.demo --help"
    exit 0
fi
if [[ ${1:-} =~ ^[1-9][0-9]*$ ]]; then nproc=$1; shift; else nproc=2; fi
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m cco.demo "$@"
