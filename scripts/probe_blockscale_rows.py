"""blockscale's decode rows (2..64) through an MMA over the quantized rows that steps several
128-column scale groups at a time, against what the layer runs (the quantizer's launch, then
cuBLAS's blockwise GEMM over rows padded to its multiple of 4) and bf16 ``nn.Linear``, device time
under graph replay, one GPU::

    python3 -m scripts.probe_blockscale_rows 8b-down-tp1,8b-o-tp1,70b-down-tp1 8,16,32,64 bs.json

Why: the layer's blockscale calls of 16..64 rows at Llama-3-8B shapes run at 1.23-1.94x of
``nn.Linear``'s device time (docs/decode.md), and an MMA over the rows that took one scale group
(128 columns) a step ran 1.1-1.9x slower than cuBLAS. A step of one group loads 8 KiB of weight
per program; here a step loads ``G`` groups (``tl.static_range``), each its own MMA scaled by the
rows' and the weight block's scales, so ``G`` times the bytes are in flight. Per config
(``BLOCK_N`` weight rows a program, ``G``, warps, stages) every output is first checked against
the fp32 product of the dequantized operands (``cco.bench.timing.gemm_mismatches``: none outside
the fp8 GEMM's error budget); the arm includes the quantizer's launch, as the layer's call would.
"""
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from cco import quant as Q
from scripts._cli import shape_probe_args
from scripts.tune_decode import SHAPES, graph_us, shape_weight


@triton.jit
def blockscale_rows_kernel(q_ptr, sa_ptr, w_ptr, ws_ptr, out_ptr, M, N, K_PAD, stride_sa_g, stride_ws,
                           BLOCK_N: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr):
    """out[M, N] = sum over 128-column groups g of (w[cols, g] @ q[rows, g].T) * sa[rows, g] *
    ws[cols // 128, g]: program ``n block`` takes ``BLOCK_N`` (<= 128, dividing it) weight rows,
    ``G`` groups a step, the weight as the MMA's M side."""
    block = tl.program_id(0)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
    kk = tl.arange(0, 128)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K_PAD + kk[None, :]
    ws_row = ws_ptr + (block * BLOCK_N // 128) * stride_ws
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in range(0, K_PAD, 128 * G):
        for j in tl.static_range(G):
            kb = k0 + j * 128
            w = tl.load(w_rows + kb, mask=n_ok[:, None], other=0.0)
            q = tl.load(q_rows + kb, mask=r_ok[:, None], other=0.0)
            sa = tl.load(sa_ptr + (kb // 128) * stride_sa_g + rows, mask=r_ok, other=0.0)
            sb = tl.load(ws_row + kb // 128)
            acc += tl.dot(w, tl.trans(q)) * (sa * sb)[None, :]
    tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], acc.to(tl.bfloat16),
             mask=n_ok[:, None] & r_ok[None, :])


def parse_args(argv=None):
    return shape_probe_args(__doc__, SHAPES, argv)


def main(argv=None):
    args = parse_args(argv)
    from cco.bench.timing import require_cuda

    require_cuda("probe_blockscale_rows")  # after parsing: --help and argument errors need no GPU
    from cco.bench.timing import gemm_mismatches
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.quantize import quantize_activation

    dev = torch.device("cuda")
    out_rows = []
    for name in args.shapes:
        n, k, w, w_bf16 = shape_weight(name, dev)
        wq, ws = Q.quantize_b(w, "blockscale")
        vw = vendor.prepare_weight(wq, ws, "blockscale")
        groups = k // 128
        for m in args.m:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            q, sa = quantize_activation(x, "blockscale", k_padded=k)
            ad, wd = Q.dequantize_a(q, sa, "blockscale"), Q.dequantize_b(wq, ws, "blockscale")
            ref, dot_abs = ad @ wd.t(), ad.abs() @ wd.abs().t()
            rows_v = vendor.padded_rows("blockscale", m)
            arms = {"nn.Linear bf16": lambda x=x: torch.nn.functional.linear(x, w_bf16),
                    "now: quantizer + cuBLAS": lambda x=x: vendor.vendor_gemm(
                        *quantize_activation(x, "blockscale", k_padded=k, m_padded=rows_v), vw)}
            cublas_bad = gemm_mismatches(arms["now: quantizer + cuBLAS"]()[:m], ref, dot_abs)
            rows = max(16, 1 << (m - 1).bit_length())
            bad = {}
            configs = [(64, 1, 4, 4), *itertools.product((32, 64, 128), (2, 4, 8), (4,), (3, 5))]
            for bn, g, warps, stages in configs:
                if groups % g:
                    continue
                cfg = f"{bn}/{g}/{warps}/{stages}"
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                grid = (triton.cdiv(n, bn),)

                def arm(x=x, out=out, bn=bn, g=g, warps=warps, stages=stages, grid=grid):
                    qq, ss = quantize_activation(x, "blockscale", k_padded=k)
                    blockscale_rows_kernel[grid](qq, ss, wq, ws, out, m, n, k, ss.stride(1), ws.stride(0), BLOCK_N=bn,
                                                 G=g, ROWS=rows, num_warps=warps, num_stages=stages)
                    return out
                try:
                    got = arm()
                    torch.cuda.synchronize()
                except Exception as err:  # a config that does not compile (resources)
                    print(f"{name} M={m} {cfg}: ERROR {type(err).__name__}: {str(err)[:160]}", flush=True)
                    continue
                bad[cfg] = gemm_mismatches(got, ref, dot_abs)
                if bad[cfg]:
                    print(f"{name} M={m} {cfg}: WRONG, {bad[cfg]} outside the budget", flush=True)
                    continue
                arms[cfg] = arm
            t = graph_us(arms, 10, 3)
            base, now = t["nn.Linear bf16"], t["now: quantizer + cuBLAS"]
            best = sorted((v, a) for a, v in t.items() if "/" in a)[:4]
            print(f"{name} M={m}: bf16 {base:.1f} us, quantizer + cuBLAS {now:.1f} ({now / base:.2f}x; "
                  f"{cublas_bad} outside the budget) | best: "
                  + ", ".join(f"{a} {v:.1f} ({v / base:.2f}x)" for v, a in best), flush=True)
            out_rows.append({"shape": name, "n": n, "k": k, "m": m, "us": t, "outside_budget": bad,
                             "cublas_outside_budget": cublas_bad})
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "command": "python3 -m scripts.probe_blockscale_rows " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv), "rows": out_rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
