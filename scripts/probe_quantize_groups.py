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

``--tiles 8x512,8x128,...`` times instead the kernel with each ``BLOCK_M x BLOCK_K`` tile side by
side (the shipped ones are ``quantize.group_tile``'s; each launch's grid from its tile), at the
rows of ``-m`` (M = M_OUT), after checking that every tile writes the first tile's bytes (values
and scales). Why: at decode sizes the 8 x 512 tile (blockscale's until 2026-12-06) gave 8 rows of
K 4096 only 8 programs, each correctly rounding 32 divisions a thread in turn (docs/decode.md, "Cold
weights": the quantizer alone 4.1 us there under Nsight Compute)::

    python3 -m scripts.probe_quantize_groups --tiles 8x512,8x256,8x128,4x128,1x128 -m 8,32,64 -k 4096
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from scripts._cli import ints


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", type=int, action="append", help="repeatable; default 1792, 4096, 14336")
    p.add_argument("--calls", type=int, default=20, help="kernel launches per graph")
    p.add_argument("--passes", type=int, default=5, help="at least 3 (the arms alternate per pass)")
    p.add_argument("--tiles", type=_tiles, help="comma list of BLOCK_MxBLOCK_K tiles timed side by side")
    p.add_argument("-m", type=ints, help="--tiles: comma list of rows (M = M_OUT; default 1,8,64)")
    p.add_argument("--quant", default="blockscale,mxfp8", help="comma list of blockscale, mxfp8")
    p.add_argument("--json")
    args = p.parse_args(argv)
    quants = args.quant.split(",")
    if not set(quants) <= {"blockscale", "mxfp8"}:
        p.error(f"--quant {args.quant}: the group quantizer takes blockscale and mxfp8")
    if args.m and not args.tiles:
        p.error("-m picks the rows of --tiles' cells: pass --tiles")
    if args.tiles and any(bk % 128 for _, bk in args.tiles) and "blockscale" in quants:
        p.error(f"--tiles {args.tiles}: blockscale's BLOCK_K must be a multiple of 128 (one scale group)")
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
    if args.tiles:
        for quant in quants:
            rows += _tile_cells(args, quant, graph_timings, time_arms)
        quants = []  # (the cells below are the run without --tiles)
    for quant in quants:
        group = SCALE_BLOCK if quant == "blockscale" else MX_GROUP
        for k in args.k or (1792, 4096, 14336):
            for m, m_out in ((1, 1), (1, 4), (2, 4), (4, 4), (8, 8), (64, 64)):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                q, s = QZ.empty_activation(quant, m_out, k, x.device)
                bm, bk = QZ.group_tile(quant, m_out)
                grid = (-(-m_out // bm), -(-k // bk))
                launches = {name: (lambda kernel=kernel: kernel[grid](
                    x, q, s, m, m_out, k, k, x.stride(0), _TINY, FP8_MAX, quant == "mxfp8", group, bm, bk,
                    m_out <= QZ.SKIP_ZEROS_MAX_M, False, num_warps=QZ.NUM_WARPS))
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


def _tiles(text: str) -> list[tuple[int, int]]:
    """``"8x512,4x128"`` as ``[(8, 512), (4, 128)]``: powers of two, BLOCK_K at least 32."""
    out = []
    for part in text.split(","):
        try:
            bm, bk = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not BLOCK_MxBLOCK_K (such as 8x512)") from None
        if bm < 1 or bk < 32 or bm & (bm - 1) or bk & (bk - 1):
            raise argparse.ArgumentTypeError(f"{part!r}: BLOCK_M and BLOCK_K must be powers of two, BLOCK_K >= 32")
        out.append((bm, bk))
    return out


def _tile_cells(args, quant: str, graph_timings, time_arms) -> list[dict]:
    """Per (K, M): the group quantizer with each of ``args.tiles``, timed under graph replay in the
    same passes, after checking that each writes the first tile's bytes."""
    from cco.quant import _TINY, FP8_MAX, MX_GROUP, SCALE_BLOCK
    from kernels_fused.hopper import quantize as QZ
    from kernels_fused.hopper import quantize_kernels as QK

    group = SCALE_BLOCK if quant == "blockscale" else MX_GROUP
    rows = []
    for k in args.k or (4096, 14336):
        for m in args.m or (1, 8, 64):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            launches, outs = {}, {}
            for bm, bk in args.tiles:
                q, s = QZ.empty_activation(quant, m, k, x.device)
                grid = (-(-m // bm), -(-k // bk))
                name = f"{bm}x{bk}"
                launches[name] = (lambda grid=grid, q=q, s=s, bm=bm, bk=bk: QK.quantize_groups_kernel[grid](
                    x, q, s, m, m, k, k, x.stride(0), _TINY, FP8_MAX, quant == "mxfp8", group, bm, bk,
                    m <= QZ.SKIP_ZEROS_MAX_M, False, num_warps=QZ.NUM_WARPS))
                launches[name]()
                outs[name] = (q, s)
            torch.cuda.synchronize()
            first = next(iter(outs))
            raw = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 - bytes (blockscale's scales: a transposed view)
            differ = [name for name, (q, s) in outs.items()
                      if not (torch.equal(raw(q), raw(outs[first][0])) and torch.equal(raw(s), raw(outs[first][1])))]
            timed = graph_timings(launches, args.calls, args.passes, time_arms)
            per = {name: statistics.median(u / args.calls for u in t.pass_us) for name, t in timed.items()}
            rows.append({"quant": quant, "k": k, "m": m, "us": per, "bytes_differ_from": {n: first for n in differ}})
            print(f"{quant:10s} K={k:6d} M={m:3d} | " + " | ".join(f"{n} {u:.2f} us" for n, u in per.items())
                  + (f" | BYTES DIFFER from {first}: {differ}" if differ else ""), flush=True)
    return rows


if __name__ == "__main__":
    main()
