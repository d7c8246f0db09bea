"""The activation quantizer alone on one GPU: the layer's Triton kernel against ``cco.quant.quantize_a``.

    python -m scripts.bench_quantize                          # every quant, M 1..16384, K 2048 and 2368
    python -m scripts.bench_quantize --quant ptpc -m 4096 -k 7168 --graph

Arms, per (quant, M, K): ``quantize_a`` (plain torch, as a model calls it today: an fp32 copy of x
and several kernels; a K that is not a whole number of 128-wide tiles is zero-padded first with
``torch.nn.functional.pad``, which the layer would otherwise need) and ``triton``
(``kernels_fused.hopper.quantize.quantize_activation``: one launch that writes the padding too).
Inputs are bf16 ``[M, K]``. The Triton arm's bytes are compared first with ``quantize_a`` on the
host (they must be equal; on a CUDA tensor ``quantize_a`` divides by 448 as a multiply by the
reciprocal, which can move a scale by one ulp); a wrong arm posts no time. Timing is
``cco.bench.timing.time_arms`` (arms alternate inside each pass, median over iterations, spread over
passes); eager calls by default (host launch cost included, as an eager model pays it), CUDA-graph
replays with ``--graph``. For ptpc up to ``SPLIT_COMPARE_MAX_M`` rows, the split-row kernel and the
two-pass kernel are timed beside the rule's pick (``kernels_fused.hopper.quantize.PTPC_SPLIT_MAX_M``).
``--json`` writes the rows. One line per shape, then ``RESULT_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cco import layout
from cco import quant as Q
from cco.bench.timing import check_output_dirs, graphed, idle_check, require_cuda, time_arms

DEFAULT_M = (1, 16, 128, 1024, 4096, 16384)
DEFAULT_K = (2048, 2368)  # 2368: Qwen2.5-7B's MLP at TP 8, padded to 2432
SPLIT_COMPARE_MAX_M = 4096  # ptpc: up to here the split-row and the two-pass kernels are timed beside the rule's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quant", action="append", choices=Q.QUANTS, help="repeatable; default: all")
    p.add_argument("-m", type=int, action="append", help=f"repeatable; default: {DEFAULT_M}")
    p.add_argument("-k", type=int, action="append", help=f"repeatable; default: {DEFAULT_K}")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rotate", type=int, default=3)
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    check_output_dirs(p, args, ("json",))  # now, not after every shape has been timed
    return args


def same_bytes(got, want) -> bool:
    """e4m3 values bit for bit, and the scales (e8m0 bits, or fp32 values in either layout)."""
    (q, s), (rq, rs) = got, want
    scales = torch.equal(s.view(torch.uint8), rs.view(torch.uint8)) if s.dtype == Q.E8M0 else torch.equal(s, rs)
    return torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and scales


def main(argv=None) -> int:
    opts = parse_args(argv)
    require_cuda("bench_quantize")  # after parsing: --help and argument errors need no GPU
    from kernels_fused.hopper.quantize import quantize_activation

    dev = torch.device("cuda")
    idle = idle_check()
    rows, ok = [], True
    for quant in opts.quant or Q.QUANTS:
        for k in opts.k or DEFAULT_K:
            k_pad = layout.padded_k(k)
            for m in opts.m or DEFAULT_M:
                xs = [torch.randn(m, k, device=dev).to(torch.bfloat16) for _ in range(opts.rotate)]

                def torch_arm(i, xs=xs, quant=quant, k_pad=k_pad):
                    x = xs[i]
                    if x.shape[1] != k_pad:
                        x = torch.nn.functional.pad(x, (0, k_pad - x.shape[1]))
                    return Q.quantize_a(x, quant)

                def triton_arm(i, xs=xs, quant=quant, k_pad=k_pad):
                    return quantize_activation(xs[i], quant, k_padded=k_pad)

                arms = {"quantize_a": torch_arm, "triton": triton_arm}
                if quant == "ptpc" and m <= SPLIT_COMPARE_MAX_M:  # the rule's two kernels side by side
                    for split in (True, False):
                        arms[f"triton {'split' if split else 'two-pass'}"] = (
                            lambda i, xs=xs, k_pad=k_pad, split=split: quantize_activation(
                                xs[i], "ptpc", k_padded=k_pad, ptpc_split=split))
                # checked against quantize_a on the host: on a CUDA tensor its division by 448 is a
                # multiply by the reciprocal (torch's kernel for a scalar divisor), a scale one ulp off
                host = Q.quantize_a(torch.nn.functional.pad(xs[0].cpu().float(), (0, k_pad - k)), quant)
                if not all(same_bytes(tuple(t.cpu() for t in fn(0)), host) for n, fn in arms.items() if n != "quantize_a"):
                    print(f"{quant} M={m} K={k}: triton's bytes differ from quantize_a's; not timed", flush=True)
                    ok = False
                    continue
                if opts.graph:
                    arms, _ = graphed(arms, opts.rotate)
                t = time_arms(arms, passes=opts.passes, iters=opts.iters, rotate=opts.rotate)
                ref, tri = t["quantize_a"], t["triton"]
                gbps = (m * k * 2 + m * k_pad) / (tri.median_us * 1e-6) / 1e9  # bf16 in, e4m3 out
                print(f"{quant:10s} M={m:6d} K={k:5d}->{k_pad:5d} | triton {tri.median_us:8.1f} us "
                      f"({tri.min_us:.1f}..{tri.max_us:.1f}) {gbps:7.1f} GB/s | quantize_a {ref.median_us:8.1f} us "
                      f"({ref.min_us:.1f}..{ref.max_us:.1f}) | {ref.median_us / tri.median_us:5.2f}x", flush=True)
                for name in [n for n in t if n.startswith("triton ")]:
                    print(f"{'':10s} {name}: {t[name].median_us:8.1f} us ({t[name].min_us:.1f}..{t[name].max_us:.1f})")
                rows.append({"quant": quant, "m": m, "k": k, "k_padded": k_pad, "triton": tri.as_dict(),
                             "quantize_a": ref.as_dict(), "speedup": ref.median_us / tri.median_us,
                             **{n: t[n].as_dict() for n in t if n.startswith("triton ")}})
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "graph": opts.graph, "passes": opts.passes, "iters": opts.iters, "idle": idle}
    print("RESULT_JSON " + json.dumps({"meta": meta, "rows": rows}))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
