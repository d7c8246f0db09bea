"""What a world >= 2 decode call's GEMM costs on the device, as one GPU can measure it: the lsa
kernel's GEMM (its tiles, one program per tile) against the decode MMA (K split over programs),
each after the activation quantizer, and bf16 ``nn.Linear``, under graph replay::

    python3 -m scripts.probe_decode_world_gemm 8b-o-tp2,8b-down-tp2,70b-o-tp2,70b-down-tp2 1,8,32,64 world.json
    python3 -m scripts.probe_decode_world_gemm --quant ptpc 8b-down-tp8,70b-down-tp8 1,8,64 tp8.json
    python3 -m scripts.probe_decode_world_gemm --from world.json --plot world.png   # its picture, no GPU

Why: at world >= 2 a decode-sized call runs the lsa kernel (``transport="auto"``), whose programs
each compute one output tile over the whole K and then move it (docs/decode.md, "World 2 and
more"). At decode sizes that is N / BLOCK_N programs (16 at N = 4096 with ptpc's 256-column tile)
reading the whole weight: the GPU's other multiprocessors idle. The other design computes the
partial with the world-1 decode GEMM (every multiprocessor) and then runs the same kernel's
transfers on it (``from_partial``): one more launch, no GEMM inside. Both designs' transfers are
the same kernel's, so what one GPU can tell apart is their GEMMs. Arms per (shape, quant, M):

- ``nn.Linear bf16``: the layer a model would otherwise call (the all-reduce not counted);
- ``lsa GEMM``: the activation quantizer, then the lsa kernel on a world of one
  (``fp8_gemm`` with the lsa config's tiles and ``launch="ticket"``: its epilogue only writes
  ``out``), i.e. the fused call's device work less its transfers;
- ``decode GEMM``: ``decode_gemm`` as a capture takes it (the quantizer, the MMA);
- ``decode GEMM + copy``: the same and a copy of its output (a stand-in for the second launch
  of the other design, whose transfers then read the partial).

Every arm is checked against the fp32 product (none outside the fp8 budget, equal bits on a
repeat) before it is timed; each is timed as a graph of 10 calls on one weight and, in the same
passes, on 10 weights in turn (``us_cold``: a model's layers each read their own). Lower is better.
"""
import json
import sys
import time

import torch

from cco import quant as Q
from scripts._cli import drew_an_earlier_run, shape_probe_args
from scripts.tune_decode import SHAPES, checked_arms, decode_panel, earlier_run, graph_us, save_figure, shape_weight

GRAPH_CALLS = 10
ARMS = ("lsa GEMM", "decode GEMM", "decode GEMM + copy")


def lsa_config(quant: str, n: int, world: int):
    """The GemmConfig the CUDA backend's lsa kernel runs for ``quant`` at N = ``n`` over ``world``
    ranks (``CudaBackend._init_lsa``: the layout's m-tile, the quant's tile two layout tiles wide
    where the slice allows, the ticket launch)."""
    from cco.backends import cuda
    from kernels_fused.hopper.gemm import default_config

    block_m, block_n = cuda.CudaBackend.tile(quant)
    return cuda.lsa_config(default_config(quant), block_m=block_m, block_n=block_n, n_slice=n // world)[0]


def parse_args(argv=None):
    def extra(p):
        p.add_argument("--world", type=int, default=0,
                       help="the world whose lsa tiles are timed (default: the shape's TP, from its name)")
    return shape_probe_args(__doc__, SHAPES, argv, quants=("ptpc", "blockscale"), extra=extra)


def plot(path: str, png: str):
    """One panel per shape of the run at ``path``: cold device us per call over M, ``nn.Linear`` bf16,
    and per quant the lsa kernel's GEMM (dashed) against the decode MMA plus the stand-in of the
    transfers' launch (solid); lower is better. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, rows = earlier_run(path, "probe_decode_world_gemm")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cols = min(3, len(shapes))
    lines = -(-len(shapes) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(5 * cols, 4.2 * lines), squeeze=False)
    for ax in axes.flat[len(shapes):]:
        ax.set_visible(False)
    colors = {"ptpc": "tab:blue", "blockscale": "tab:orange"}
    for ax, shape in zip(axes.flat, shapes):
        mine = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["m"])
        first = [r for r in mine if r["quant"] == mine[0]["quant"]]
        ax.plot([r["m"] for r in first], [r["us_cold"]["nn.Linear bf16"] for r in first], color="black", marker="o",
                label="nn.Linear bf16")
        for quant in dict.fromkeys(r["quant"] for r in mine):
            q = [r for r in mine if r["quant"] == quant]
            for arm, style, marker in (("lsa GEMM", "--", "x"), ("decode GEMM + copy", "-", "s")):
                pts = [(r["m"], r["us_cold"][arm]) for r in q if arm in r["us_cold"]]
                if pts:
                    ax.plot(*zip(*pts), color=colors.get(quant), linestyle=style, marker=marker, label=f"{quant}: {arm}")
        decode_panel(ax, mine[0], True, fontsize=9)
    return save_figure(fig, "a world >= 2 decode call's GEMM: the lsa kernel's tiles vs the decode MMA", run, png)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if drew_an_earlier_run(argv, "probe_decode_world_gemm", plot):
        return
    args = parse_args(argv)
    from cco.bench.timing import require_cuda

    require_cuda("probe_decode_world_gemm")
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import native as NV
    from kernels_fused.hopper.gemm import fp8_gemm
    from kernels_fused.hopper.quantize import quantize_activation
    from scripts.bench_decode import one_weight_and_cold

    NV.ENABLED = False  # the Python path's launches, as a graph captures them
    dev = torch.device("cuda")
    rows, t0 = [], time.time()
    for name in args.shapes:
        n, k, w, w_bf16 = shape_weight(name, dev)
        world = args.world or int(name.rsplit("tp", 1)[1])
        others = [shape_weight(name, dev, seed)[2:] for seed in range(1, GRAPH_CALLS)]
        for quant in args.quant:
            cfg = lsa_config(quant, n, max(world, 2))
            copies = [(w_bf16, *Q.quantize_b(w, quant))] + [(wb, *Q.quantize_b(wi, quant)) for wi, wb in others]
            wd = Q.dequantize_b(copies[0][1], copies[0][2], quant)
            for m in args.m:
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                q, sa = quantize_activation(x, quant, k_padded=k)
                ad = Q.dequantize_a(q, sa, quant)
                ref, dot_abs = ad @ wd.t(), ad.abs() @ wd.abs().t()

                def arms_of(w_bf16, wq, ws, x=x, m=m, quant=quant, cfg=cfg):
                    o = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                    o2 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)

                    def lsa():
                        a, a_scale = quantize_activation(x, quant, k_padded=k)
                        return fp8_gemm(a, wq, a_scale, ws, quant=quant, out=o, config=cfg)

                    return {"nn.Linear bf16": lambda: torch.nn.functional.linear(x, w_bf16),
                            "lsa GEMM": lsa,
                            "decode GEMM": lambda: D.decode_gemm(x, wq, ws, quant, n=n),
                            "decode GEMM + copy": lambda: o2.copy_(D.decode_gemm(x, wq, ws, quant, n=n))}

                arms = arms_of(*copies[0])
                cold = [arms_of(*c) for c in copies[1:]]
                where = f"{name} {quant} M={m}"
                _, bad, wrong, errors = checked_arms(arms, ref, dot_abs, where)
                for c in cold:
                    for label in wrong + list(errors):
                        c.pop(label, None)
                t, t_cold = one_weight_and_cold(arms, cold, lambda graphs: graph_us(graphs, GRAPH_CALLS, 3))
                c = t_cold["nn.Linear bf16"]
                print(f"[{time.time() - t0:.0f} s] {where} (lsa tile {cfg.block_m}x{cfg.block_n}, "
                      f"{-(-m // cfg.block_m) * (n // cfg.block_n)} programs) cold: bf16 {c:.1f} us | "
                      + " | ".join(f"{a} {t_cold[a]:.1f} ({t_cold[a] / c:.2f}x)" for a in ARMS if a in t_cold)
                      + f" || one weight: bf16 {t['nn.Linear bf16']:.1f} | "
                      + " | ".join(f"{a} {t[a]:.1f}" for a in ARMS if a in t), flush=True)
                rows.append({"shape": name, "n": n, "k": k, "m": m, "quant": quant, "world": world,
                             "lsa_tile": [cfg.block_m, cfg.block_n], "us": t, "us_cold": t_cold,
                             "outside_budget": bad, "wrong": wrong, "errors": errors})
                with open(args.json, "w") as f:  # after every cell: a run cut short keeps what it timed
                    json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "command": "python3 -m scripts.probe_decode_world_gemm " + " ".join(argv),
                               "graph_calls": GRAPH_CALLS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
