"""Where the decode GEMM's rows kernel spends its time at 2..16 rows (one NVIDIA GPU, ptpc).

    python3 -m scripts.probe_decode_rows --json probe.json

Why: the rows kernel (``kernels_fused.hopper.decode_kernels.decode_rows_kernel``) reads the fp8
weight once for every row, yet its time grows with the rows (docs/decode.md, "Two to sixteen
rows"). Each of its programs quantizes every row itself (ptpc: the rows' amax over all of K, then
an IEEE division per element) and repeats the rows to the MMA's 16 columns. This probe times the
same MMA over rows quantized beforehand, so the gap between the two is what the per-program
quantization costs, and what a kernel that quantizes each row once would save.

Arms per (shape, M), CUDA-graph replays of ``--graph-calls`` calls, device us per call (median of
``--passes``; lower is better):
``nn.Linear bf16``; ``rows kernel`` (its launch made with ``QUANTIZED_ROWS`` empty: the rows
quantized in every program); ``decode_gemm`` (the library's path: for ptpc since 2026-12-03 13:40,
the quantizer's launch then ``decode_mma_rows_kernel``); ``quantizer`` (the activation quantizer
alone, ``quantize_activation``); ``MMA, rows repeated`` and ``MMA, rows masked``: the MMA and
epilogue alone on the quantizer's e4m3 rows and scales, the rows repeated to 16 as the rows kernel
does (the probe's own kernel below), or read as 16 rows with the rows past M masked to zero
(``decode_mma_rows_kernel``). Every arm's output is checked against the fp32 product of the
quantizer's operands first (``gemm_mismatches``); a wrong arm posts no time. (The run of 13:35 UTC,
docs/results/2026-12-03_decode_rows_probe_h200.json, predates the library's MMA kernel and its
``decode_gemm`` arm: there ``rows kernel`` was ``decode_gemm``, and the masked MMA the probe's own.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl

from kernels_fused.hopper.decode_kernels import _rows16, _rows16_1d, _to_bf16, decode_mma_rows_kernel
from scripts._cli import ints
from scripts.tune_decode import SHAPES, shape_weight

PROBED = ("8b-down-tp1", "8b-o-tp1", "70b-down-tp1")  # tune_decode's shapes this probe takes by default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(PROBED))
    p.add_argument("-m", type=ints, default="2,4,8,16")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--block-k", type=int, default=256)
    p.add_argument("--graph-calls", type=int, default=10)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    a.shapes = a.shapes.split(",")
    bad = [s for s in a.shapes if s not in SHAPES]
    if bad or any(not 2 <= m <= 16 for m in a.m):
        p.error(f"--shapes from {', '.join(SHAPES)}; -m in 2..16 (got {bad or a.m})")
    from cco.bench.timing import check_output_dirs

    check_output_dirs(p, a, ("json",))  # now, not after every shape has been timed
    return a


@triton.jit
def mma_rows_repeated(q_ptr, sa_ptr, w_ptr, ws_ptr, out_ptr, M, N, K_PAD, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """The rows kernel's MMA over pre-quantized rows (ptpc), without its quantization: the ``ROWS``
    rows (M rounded up to a power of two) repeated to the MMA's 16 as the rows kernel repeats them
    (``decode_mma_rows_kernel`` is the same loop with 16 rows read at M <= 16, those past M masked)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K_PAD, BLOCK_K):
        w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
        q = tl.load(q_rows + k0, mask=(rows < M)[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(_rows16(q, ROWS)), acc)
    sa = _rows16_1d(tl.load(sa_ptr + rows, mask=rows < M, other=0.0), ROWS)
    acc = acc * sa[None, :] * tl.load(ws_ptr + cols, mask=n_ok, other=0.0)[:, None]
    j = tl.arange(0, 16)
    tl.store(out_ptr + j[None, :].to(tl.int64) * N + cols[:, None], _to_bf16(acc, False),
             mask=n_ok[:, None] & (j < M)[None, :])


def main(argv=None) -> int:
    args = parse_args(argv)
    from cco import quant as Q
    from cco.bench.timing import gemm_mismatches, require_cuda, time_arms

    require_cuda("probe_decode_rows")  # after parsing: --help and argument errors need no GPU
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper.quantize import _pow2, quantize_activation

    dev = torch.device("cuda")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "command": "python3 -m scripts.probe_decode_rows " + " ".join(
               sys.argv[1:] if argv is None else argv), "rows": []}
    failures = 0
    for name in args.shapes:
        n, k, w, w_bf16 = shape_weight(name, dev)
        wq, ws = Q.quantize_b(w, "ptpc")
        for m in args.m:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            a, s = quantize_activation(x, "ptpc", k_padded=k)
            sa = s.reshape(-1).contiguous()
            ad, wd = Q.dequantize_a(a, s, "ptpc"), Q.dequantize_b(wq, ws, "ptpc")
            ref, dot_abs = ad @ wd.t(), ad.abs() @ wd.abs().t()

            def mma(repeat, a=a, sa=sa, m=m):
                o = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                grid, opts = (-(-n // args.block_n),), dict(BLOCK_N=args.block_n, BLOCK_K=args.block_k,
                                                             num_warps=4, num_stages=4)
                if repeat:
                    mma_rows_repeated[grid](a, sa, wq, ws, o, m, n, k, ROWS=_pow2(m), **opts)
                else:  # the library's kernel: no bias (its pointer unused), ptpc
                    decode_mma_rows_kernel[grid](a, sa, wq, ws, o, o, m, n, k, HAS_BIAS=False,
                                                 ROWS=max(16, _pow2(m)), ROUND_IN_FP32=False, **opts)
                return o

            saved, D.QUANTIZED_ROWS = D.QUANTIZED_ROWS, set()
            try:  # the rows kernel's launch (decode_gemm's own would take the library's current path)
                rows_kernel = D._Launch(m, k, k, n, "ptpc", False)
            finally:
                D.QUANTIZED_ROWS = saved

            def rows_kernel_call(x=x, launch=rows_kernel, m=m):
                o = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                launch(x, x.stride(0), wq, ws, None, o)
                return o

            arms = {"nn.Linear bf16": lambda x=x: torch.nn.functional.linear(x, w_bf16),
                    "rows kernel": rows_kernel_call,
                    "decode_gemm": lambda x=x: D.decode_gemm(x, wq, ws, "ptpc", n=n),
                    "quantizer": lambda x=x: quantize_activation(x, "ptpc", k_padded=k),
                    "MMA, rows repeated": lambda: mma(True),
                    "MMA, rows masked": lambda: mma(False)}
            bad = {a_: gemm_mismatches(arms[a_](), ref, dot_abs) for a_ in
                   ("rows kernel", "decode_gemm", "MMA, rows repeated", "MMA, rows masked")}
            torch.cuda.synchronize()
            if any(bad.values()):
                failures += 1
                print(f"{name} M={m}: outside the fp8 budget {bad}; not timed", flush=True)
                out["rows"].append({"shape": name, "m": m, "bad": bad})
                continue
            us = graph_us(arms, args, time_arms)
            out["rows"].append({"shape": name, "n": n, "k": k, "m": m, "us": us})
            print(f"{name:13s} M={m:3d} " + " | ".join(f"{a_} {v:7.1f}" for a_, v in us.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failures else 0


def graph_us(arms, args, time_arms) -> dict:
    """Device us per call of each arm: a CUDA graph of ``--graph-calls`` calls, replayed."""
    from scripts.bench_decode import graph_device_us

    return graph_device_us(arms, args, time_arms)


if __name__ == "__main__":
    sys.exit(main())
