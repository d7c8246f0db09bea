"""How a CPU test runs a script or module on two local ranks under torchrun, as a job would be
launched: single-threaded math per rank (two ranks share the CI machine's cores), gloo on the
loopback interface, the repository first on the path."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def torchrun_two_ranks(*args, timeout_s: float, env: dict | None = None, cwd=None,
                       what: str = "") -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 *args`` (a script's path, or
    ``-m`` and a module, then its arguments), ``env`` over the environment above; asserts it exited 0
    (``what``, then the tails of its stdout and stderr, as the failure's message) and returns it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, args)]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, what + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
