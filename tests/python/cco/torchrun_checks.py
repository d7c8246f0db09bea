"""How a GPU test starts its rank-side checks: torchrun on the test module itself, whose
``__main__`` runs the checks in every rank and prints a marker when all of them passed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def nvidia_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() and not torch.version.hip else 0


def run_rank_checks(module: str, passed: str, *, nproc: int = 2, timeout_s: float = 900) -> str:
    """``torchrun --nproc-per-node nproc -m module`` from the repository root; asserts it exited 0
    and printed ``passed``; returns its stdout."""
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--nproc-per-node", str(nproc), "-m", module]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert passed in proc.stdout, proc.stdout[-4000:]
    return proc.stdout
