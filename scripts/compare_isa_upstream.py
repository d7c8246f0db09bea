"""The gfx950 kernel's ISA, region by region, against the FlyDSL 8-wave fp8 GEMM of a checkout you provide.

    python -m scripts.compare_isa_upstream --flydsl /path/to/FlyDSL
    python -m scripts.compare_isa_upstream --flydsl /path/to/FlyDSL --before /path/to/older/cco -k 512 2048 \\
        --json docs/results/isa_vs_upstream.json

Everything is compiled for gfx950 on this machine (``kernels_fused.gfx950.toolchain``; nothing is
launched) and counted by the same code, ``kernels_fused.gfx950.budget.profile``: the prologue
(before the first ``ds_read``), one main-loop K step, the epilogue (after the last MFMA), and the
resources. Columns:

* ``after``: this tree's kernel (ptpc, ``fuse=False``, the shipped schedule);
* ``before`` (with ``--before``): the same variant compiled from another checkout of this project,
  e.g. an exported older commit (``git archive <commit> | tar -x -C /tmp/cco-before``);
* ``upstream``: ``compile_fp8_gemm_8w(K=..., BLOCK_M=..., BLOCK_N=..., b_preshuffled=True)`` of
  ``kernels/gemm/fp8_gemm_8wave.py`` in the ``--flydsl`` checkout (row-scaled fp8, the kernel this
  pipeline comes from; it has BLOCK_N >= 256 and no fused or block-scaled form). No upstream code is
  part of this project: the checkout is imported in a separate process.

Each checkout is compiled in its own process (``PYTHONPATH`` set to it), so the two FlyDSL kernel
trees and the two versions of this package never meet in one interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels_fused.gfx950.budget import profile

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_MODULE = "kernels/gemm/fp8_gemm_8wave.py"

# Run in a child process whose PYTHONPATH holds this tree first and the FlyDSL checkout second:
# compiles the upstream kernel with this tree's compile-only toolchain and writes its ISA.
_UPSTREAM_DRIVER = """
import contextlib, io, sys, torch
import flydsl.compiler as flyc
from kernels.gemm.fp8_gemm_8wave import compile_fp8_gemm_8w
from kernels_fused.gfx950.toolchain import compile_env, find_isa
K, bm, bn, out, dump = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
m, n = 2 * bm, 2 * bn
args = (torch.empty(m, K, dtype=torch.uint8), torch.empty(n, K, dtype=torch.uint8),
        torch.empty(m * n, dtype=torch.bfloat16), torch.empty(m), torch.empty(n), m, n, None)
with compile_env(dump) as d, contextlib.redirect_stdout(io.StringIO()):
    flyc.compile(compile_fp8_gemm_8w(K=K, BLOCK_M=bm, BLOCK_N=bn, b_preshuffled=True), *args)
open(out, "w").write(find_isa(d).read_text())
"""

# Run in a child process inside another checkout of this project: compiles its kernel.
_OURS_DRIVER = """
import sys
from kernels_fused.gfx950.isa import compile_variant
quant, tile, K, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]  # argv[5]: a scratch folder
cfg, isa = compile_variant(quant=quant, tile=tile, K=K, fuse=False)
open(out, "w").write(isa)
"""


def _compile_in(pythonpath: list[Path], driver: str, *args, cwd: Path) -> str:
    """Run ``driver`` with ``args``, then an output path and a scratch folder, in a child process."""
    with tempfile.TemporaryDirectory(prefix="cco-isa-cmp-") as d:
        out = os.path.join(d, "kernel.s")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
        run = subprocess.run([sys.executable, "-c", driver, *map(str, args), out, os.path.join(d, "dump")],
                             cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"compiling in {pythonpath[-1]} failed:\n{run.stderr[-4000:]}")
        return Path(out).read_text()


def compile_upstream(flydsl: Path, *, tile: str, K: int) -> str:
    bm, bn = (int(x) for x in tile.split("x"))
    return _compile_in([REPO, flydsl], _UPSTREAM_DRIVER, K, bm, bn, cwd=REPO)


def compile_ours(checkout: Path, *, tile: str, K: int) -> str:
    return _compile_in([checkout], _OURS_DRIVER, "ptpc", tile, K, cwd=checkout)


ROWS = ("instructions", "prologue", "prologue VALU", "iteration", "iteration MFMA", "iteration DMA",
        "iteration ds_read", "iteration barriers", "iteration VALU", "loop scratch ops", "epilogue",
        "epilogue stores", "store bytes/lane", "epilogue scale loads", "full drains", "store waits",
        "epilogue ds_write", "epilogue ds_read", "VGPRs", "spilled VGPRs", "scratch B", "LDS B")


def _check_path(arg: str, path: Path, marker: str, fix: str) -> Path:
    if not (path / marker).is_file():
        raise SystemExit(f"compare_isa_upstream: {arg}={path} has no {marker}; {fix}")
    return path.resolve()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.compare_isa_upstream", description=__doc__.split("\n\n")[0])
    ap.add_argument("--flydsl", type=Path, required=True, help="a FlyDSL source checkout (github.com/ROCm/FlyDSL)")
    ap.add_argument("--before", type=Path, help="another checkout of this project to compile as the 'before' column")
    ap.add_argument("--tile", nargs="+", default=["256x256"], choices=("256x256", "128x256"),
                    help="tiles both kernels build (upstream needs BLOCK_N >= 256)")
    ap.add_argument("-k", "--K", nargs="+", type=int, default=[2048], dest="K")
    ap.add_argument("--json", type=Path, help="also write every count here")
    args = ap.parse_args(argv)
    flydsl = _check_path("--flydsl", args.flydsl, UPSTREAM_MODULE, "pass the root of a FlyDSL source checkout")
    before = args.before and _check_path("--before", args.before, "kernels_fused/gfx950/kernel.py",
                                         "pass the root of another checkout of this project")

    from kernels_fused.gfx950.isa import compile_variant
    from kernels_fused.gfx950.toolchain import cli_unavailable

    if (status := cli_unavailable("compare_isa_upstream")) is not None:
        return status
    results = []
    for tile in args.tile:
        for K in args.K:
            cols = {}
            if before:
                cols["before"] = profile(compile_ours(before, tile=tile, K=K), k_tiles=K // 128).row()
            cols["after"] = profile(compile_variant(quant="ptpc", tile=tile, K=K, fuse=False)[1], k_tiles=K // 128).row()
            cols["upstream"] = profile(compile_upstream(flydsl, tile=tile, K=K), k_tiles=K // 128).row()
            results.append({"quant": "ptpc", "tile": tile, "K": K, "mode": "gemm-only", "columns": cols})
            names = list(cols)
            print(f"\n### ptpc {tile} K={K}, gemm-only\n")
            print("| count | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
            for row in ROWS:
                print(f"| {row} | " + " | ".join(str(cols[c][row]) for c in names) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"flydsl": str(flydsl), "before": str(before) if before else None,
                                         "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
