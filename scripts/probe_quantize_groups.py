"""Why blockscale's activation quantizer took ~6 us of device time at one row (and at K = 1792)
where it took ~2.5 us at 8..64 rows: the group quantizer (``quantize_groups_kernel``) timed under
CUDA-graph replay per (quant, K, M, M_OUT), as compiled (Triton specializes an integer argument
equal to 1) and with ``M`` and ``M_OUT`` left unspecialized, in the same passes. One GPU::

    python3 -m scripts.probe_quantize_groups --json probe.json

What it showed (one H200, 2026-12-04, docs/decode.md "The quantizer's zeros"): both arms equal in
every cell, so not the specialization; the slow cells were those whose tiles hold zeros (rows past
M, columns past K), which the IEEE division took a slow path for. ``_div_rn`` no longer divides a
zero in calls of at most ``quantize.SKIP_ZEROS_MAX_M`` rows (every cell here), and the same probe
then gave 2.3-3.2 us at every cell.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", type=int, action="append", help="repeatable; default 1792, 4096, 14336")
    p.add_argument("--calls", type=int, default=20, help="kernel launches per graph")
    p.add_argument("--passes", type=int, default=5, help="at least 3 (the arms alternate per pass)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_quantize_groups: needs a GPU")
    import triton

    from cco.bench.timing import time_arms
    from cco.quant import _TINY, FP8_MAX, MX_GROUP, SCALE_BLOCK
    from kernels_fused.hopper import quantize as QZ
    from kernels_fused.hopper import quantize_kernels as QK
    from scripts.bench_decode import graph_timings

    plain = QK.quantize_groups_kernel
    loose = triton.jit(plain.fn, do_not_specialize=["M", "M_OUT"])
    rows = []
    for quant in ("blockscale", "mxfp8"):
        group = SCALE_BLOCK if quant == "blockscale" else MX_GROUP
        for k in args.k or (1792, 4096, 14336):
            for m, m_out in ((1, 1), (1, 4), (2, 4), (4, 4), (8, 8), (64, 64)):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                q, s = QZ.empty_activation(quant, m_out, k, x.device)
                grid = (-(-m_out // QZ.GROUP_BLOCK_M), -(-k // QZ.GROUP_BLOCK_K))
                launches = {name: (lambda kernel=kernel: kernel[grid](
                    x, q, s, m, m_out, k, k, x.stride(0), _TINY, FP8_MAX, quant == "mxfp8", group, QZ.GROUP_BLOCK_M,
                    QZ.GROUP_BLOCK_K, m_out <= QZ.SKIP_ZEROS_MAX_M, False, num_warps=QZ.NUM_WARPS))
                    for name, kernel in (("specialized", plain), ("M unspecialized", loose))}
                timed = graph_timings(launches, args.calls, args.passes, time_arms)
                per = {name: [u / args.calls for u in t.pass_us] for name, t in timed.items()}
                row = {"quant": quant, "k": k, "m": m, "m_out": m_out,
                       **{f"{name} us": statistics.median(t) for name, t in per.items()}}
                rows.append(row)
                print(f"{quant:10s} K={k:6d} M={m:3d} M_OUT={m_out:3d} | " +
                      " | ".join(f"{name} {statistics.median(t):.2f} us ({min(t):.2f}..{max(t):.2f})"
                                 for name, t in per.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 -m scripts.probe_quantize_groups", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
