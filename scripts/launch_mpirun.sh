#!/usr/bin/env bash
# Launch ranks of GemmAllReduceOp with mpirun/mpiexec (Open MPI, MPICH; `pip install mpi4py mpich`
# provides both mpi4py and an mpiexec).
#
#   scripts/launch_mpirun.sh [NP] [cco.demo arguments...]
#   scripts/launch_mpirun.sh 4 --mode split-lsa --quant blockscale
#
# Communicator.from_env() sees the MPI launcher's variables (OMPI_COMM_WORLD_RANK, PMI_RANK, ...),
# takes rank and size from mpi4py, and rank 0 broadcasts a TCP rendezvous address over MPI for the
# gloo group; after that the op runs exactly as under torchrun. Multi-host: add a host file
# (-f hosts for MPICH, --hostfile hosts for Open MPI).
set -euo pipefail
# NP only where the first argument is a positive integer; anything else goes to cco.demo
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: scripts/launch_mpirun.sh [NP] [cco.demo arguments...]"
    echo "  NP: a positive integer, default 2; the demo's arguments: python -m cco.demo --help"
    exit 0
fi
if [[ ${1:-} =~ ^[1-9][0-9]*$ ]]; then np=$1; shift; else np=2; fi
cd "$(dirname "$0")/.."
# python3 -m mpi4py: MPI starts with the process, and a rank's uncaught exception aborts the whole job
# (a rank that died before MPI_Init would leave its peers waiting in theirs for good)
exec "${MPIEXEC:-mpiexec}" -n "$np" "${PYTHON:-python3}" -m mpi4py -m cco.demo "$@"
