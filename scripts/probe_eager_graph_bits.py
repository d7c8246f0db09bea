"""Do a layer's eager calls and its CUDA-graph replays give the same bits? Per (layer, quant, shape,
rows): a world-1 ``RowParallelLinear`` or ``ColumnParallelLinear`` over tune_decode's seeded weight,
called eagerly three times (the first call builds the shape's launches, the next go through the
kept launches and the C++ table), then captured and replayed on the same input. One GPU::

    python3 -m scripts.probe_eager_graph_bits 8b-o-tp1,8b-down-tp1 1,2,8,16,64 bits.json
    python3 -m scripts.probe_eager_graph_bits --quant ptpc --layer column 8b-qkv-tp1 8 bits.json

Why: the 8-layer model's greedy tokens under graphs were not all those of its eager decode for the
cco arms (``bench_decode``'s ``same_tokens_as_eager``; docs/decode.md), where bf16's were. A
one-row call runs the one-launch GEMV eagerly and the quantizer + MMA under a capture (weights of
20 MiB or more), which sum in another order; this probe says at which (shape, rows) the bits
differ, and by how much (the largest difference over the output's largest magnitude). Each line
also says whether the eager calls agreed among themselves and the replays among themselves.
"""
from __future__ import annotations

import json

import torch

from scripts._cli import shape_probe_args
from scripts.tune_decode import SHAPES

QUANTS = ("ptpc", "blockscale", "mxfp8")


def _extra(p) -> None:
    p.add_argument("--layer", choices=("row", "column"), default="row",
                   help="RowParallelLinear (o/down) or ColumnParallelLinear (qkv/gate/up), world 1")


def compare(layer, x: torch.Tensor, replays: int = 3) -> dict:
    """Eager calls and graph replays of ``layer`` at ``x``: their agreement, and the eager-vs-graph
    difference (elements that differ, the largest difference over max |eager|)."""
    from cco.bench.timing import graphed

    eager = [layer(x).clone() for _ in range(3)]
    torch.cuda.synchronize()
    replays_of, uncaptured = graphed({"layer": lambda i: layer(x)}, rotate=1)
    if uncaptured:  # (graphed would time it eagerly: eager against eager, which always agrees)
        raise RuntimeError(f"probe_eager_graph_bits: the layer's call could not be captured ({layer!r})")
    replayed = []
    for _ in range(replays):
        out = replays_of["layer"](0)
        torch.cuda.synchronize()
        replayed.append(out.clone())
    e, g = eager[-1].float(), replayed[-1].float()
    differ = int((eager[-1].view(torch.int16) != replayed[-1].view(torch.int16)).sum())
    scale = e.abs().max().item() or 1.0
    return {"eager_self_equal": all(torch.equal(eager[0], t) for t in eager[1:]),
            "graph_self_equal": all(torch.equal(replayed[0], t) for t in replayed[1:]),
            "elements": e.numel(), "differ": differ,
            "max_diff_over_max_abs": (e - g).abs().max().item() / scale}


def main(argv=None) -> None:
    args = shape_probe_args(__doc__, SHAPES, argv, quants=QUANTS, extra=_extra)
    from cco.bench.timing import require_cuda

    require_cuda("probe_eager_graph_bits")
    from scripts.bench_decode import cco_column_layer, cco_layer, launched_or_one_rank, seeded_linear

    device = torch.device("cuda", torch.cuda.current_device())
    comm = launched_or_one_rank(device)
    make = cco_layer if args.layer == "row" else cco_column_layer
    rows = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        linear = seeded_linear(n, k, device)
        for quant in args.quant:
            layer = make(linear, quant, comm, max(args.m))
            for m in args.m:
                g = torch.Generator(device="cpu").manual_seed(m)
                x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
                with torch.no_grad():
                    row = {"layer": args.layer, "shape": shape, "quant": quant, "m": m, **compare(layer, x)}
                rows.append(row)
                print(f"{args.layer} {shape:12s} {quant:10s} M={m:3d} | eager vs graph: {row['differ']} of "
                      f"{row['elements']} differ, max diff / max|y| {row['max_diff_over_max_abs']:.2e} | "
                      f"eager repeats equal {row['eager_self_equal']}, replays equal {row['graph_self_equal']}",
                      flush=True)
            del layer
        with open(args.json, "w") as f:
            json.dump({"command": "python3 -m scripts.probe_eager_graph_bits", "device": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
