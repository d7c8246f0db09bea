"""mxfp8's decode rows through Triton's ``tl.dot_scaled`` (e4m3 operands with e8m0 scales per 32
columns; on Hopper Triton emulates it by upcasting to bf16): device time under graph replay against
bf16 ``nn.Linear`` and against what the layer runs (the quantizer, the rows in bf16, cuBLAS's bf16
GEMM over the weight's copy), one GPU::

    python3 -m scripts.probe_mx_dot_scaled 8b-down-tp1,8b-o-tp1,70b-down-tp1 8,64 mx.json

Two ways per config (``BLOCK_N`` / ``BLOCK_K`` / warps / stages): ``way0`` both operands e4m3 with
their scales, the activation quantizer's launch included; ``way1`` the rows already bf16 (the
dequantizing quantizer's output) against the e4m3 weight, the kernel alone. Each config is first
checked against the fp32 product of the dequantized operands (relative L2 <= 1e-2). Result of
2026-12-04 (one H200, Triton 3.6): 2.8-9.1x (the best config per cell) of ``nn.Linear``'s device time at every cell, against
1.04-1.43x for the layer's path (docs/decode.md, "mxfp8's kept cuBLAS call ...").
"""
import itertools
import json

import torch
import triton
import triton.language as tl

from cco import quant as Q
from scripts._cli import shape_probe_args
from scripts.tune_decode import SHAPES, graph_us, shape_weight


@triton.jit
def mx_rows_kernel(q_ptr, sa_ptr, w_ptr, ws_ptr, out_ptr, M, N, K_PAD, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROWS: tl.constexpr, WAY: tl.constexpr):
    block = tl.program_id(0)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
    kk = tl.arange(0, BLOCK_K)
    G: tl.constexpr = BLOCK_K // 32
    gg = tl.arange(0, G)
    KG = K_PAD // 32
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in range(0, K_PAD, BLOCK_K):
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K_PAD + k0 + kk[None, :], mask=n_ok[:, None], other=0.0)
        ws = tl.load(ws_ptr + cols.to(tl.int64)[:, None] * KG + k0 // 32 + gg[None, :], mask=n_ok[:, None], other=0)
        if WAY == 0:  # both fp8 with their e8m0 scales
            q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * K_PAD + k0 + kk[None, :], mask=r_ok[:, None], other=0.0)
            sa = tl.load(sa_ptr + rows.to(tl.int64)[:, None] * KG + k0 // 32 + gg[None, :], mask=r_ok[:, None],
                         other=0)
            acc = tl.dot_scaled(w, ws, "e4m3", tl.trans(q), sa, "e4m3", acc)
        else:  # the rows already bf16 (the dequantizing quantizer's)
            a = tl.load(q_ptr + rows.to(tl.int64)[:, None] * K_PAD + k0 + kk[None, :], mask=r_ok[:, None], other=0.0)
            acc = tl.dot_scaled(w, ws, "e4m3", tl.trans(a), None, "bf16", acc)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], acc.to(tl.bfloat16),
             mask=n_ok[:, None] & r_ok[None, :])


def parse_args(argv=None):
    return shape_probe_args(__doc__, SHAPES, argv)


def main(argv=None):
    args = parse_args(argv)
    from cco.bench.timing import require_cuda

    require_cuda("probe_mx_dot_scaled")  # after parsing: --help and argument errors need no GPU
    from kernels_fused.hopper.quantize import quantize_activation, launch_for
    from kernels_fused.hopper.vendor import mx_to_bf16
    dev = torch.device("cuda")
    out_rows = []
    for name in args.shapes:
        n, k, w, w_bf16 = shape_weight(name, dev)
        wq, ws = Q.quantize_b(w, "mxfp8")
        wsb = ws.view(torch.uint8)
        dense = mx_to_bf16(wq, ws)
        for m in args.m:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            q, sa = quantize_activation(x, "mxfp8", k_padded=k)
            sab = sa.view(torch.uint8)
            a_bf = mx_to_bf16(q, sa)
            ref = (a_bf.float() @ dense.float().t())
            arms = {"nn.Linear bf16": lambda x=x: torch.nn.functional.linear(x, w_bf16),
                    "now: quantizer + bf16 GEMM": lambda x=x: torch.matmul(
                        mx_to_bf16(*quantize_activation(x, "mxfp8", k_padded=k)), dense.t())}
            rows = max(16, 1 << (m - 1).bit_length())
            for way, bn, bk, warps, stages in itertools.product((0, 1), (64, 128), (128, 256), (4,), (3, 4)):
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                src, srcs = (q, sab) if way == 0 else (a_bf, sab)
                grid = (triton.cdiv(n, bn),)
                try:
                    mx_rows_kernel[grid](src, srcs, wq, wsb, out, m, n, k, BLOCK_N=bn, BLOCK_K=bk, ROWS=rows, WAY=way,
                                         num_warps=warps, num_stages=stages)
                    torch.cuda.synchronize()
                except Exception as err:
                    print(f"{name} M={m} way{way} {bn}/{bk}/{warps}/{stages}: ERROR {type(err).__name__}: {str(err)[:200]}", flush=True)
                    continue
                rel = float((out.float() - ref).norm() / ref.norm())
                if rel > 1e-2:
                    print(f"{name} M={m} way{way} {bn}/{bk}/{warps}/{stages}: WRONG rel {rel:.3e}", flush=True)
                    continue
                def arm(x=x, src=src, srcs=srcs, out=out, bn=bn, bk=bk, warps=warps, stages=stages, way=way, grid=grid):
                    if way == 0:
                        qq, ss = quantize_activation(x, "mxfp8", k_padded=k)
                        mx_rows_kernel[grid](qq, ss.view(torch.uint8), wq, wsb, out, m, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                             ROWS=rows, WAY=way, num_warps=warps, num_stages=stages)
                    else:
                        mx_rows_kernel[grid](src, srcs, wq, wsb, out, m, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                             ROWS=rows, WAY=way, num_warps=warps, num_stages=stages)
                arms[f"way{way} {bn}/{bk}/{warps}/{stages}"] = arm
            t = graph_us(arms, 10, 3)
            base = t["nn.Linear bf16"]
            best = sorted((v, a) for a, v in t.items() if a.startswith("way"))
            b0 = [b for b in best if b[1].startswith("way0")][:3]
            b1 = [b for b in best if b[1].startswith("way1")][:3]
            print(f"{name} M={m}: bf16 {base:.1f} now {t['now: quantizer + bf16 GEMM']:.1f} ({t['now: quantizer + bf16 GEMM']/base:.2f}x) "
                  f"| way0 (quantizer incl.) " + ", ".join(f"{a} {v:.1f} ({v/base:.2f}x)" for v, a in b0) +
                  f" | way1 (kernel alone) " + ", ".join(f"{a} {v:.1f} ({v/base:.2f}x)" for v, a in b1), flush=True)
            out_rows.append({"shape": name, "m": m, "us": t})
    with open(args.json, "w") as f:
        json.dump(out_rows, f, indent=1)


if __name__ == "__main__":
    main()
