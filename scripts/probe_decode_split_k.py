"""The decode MMA over quantized rows (``decode_kernels.decode_mma_rows_kernel``) with K split over
programs, per config, against what else a call could run and bf16 ``nn.Linear``, device time under
graph replay, one GPU::

    python3 -m scripts.probe_decode_split_k 8b-down-tp1,8b-o-tp1,70b-down-tp1 1,8,16,64 split.json
    python3 -m scripts.probe_decode_split_k --quant blockscale 8b-o-tp1 8,64 bs.json
    python3 -m scripts.probe_decode_split_k --quant ptpc --block-n 64,128 --warps 4,8 8b-o-tp1 32,64 bn.json
    python3 -m scripts.probe_decode_split_k --from split.json --plot split.png   # its picture, no GPU

Why: one program per ``BLOCK_N`` (64) weight rows gives a Llama-3-8B layer (N = 4096) 64 programs
on a GPU of 132 multiprocessors, so before the split the MMA read its weight at 0.72-0.82x of
``nn.Linear``'s time where 70B down (128 programs) reached 0.54x (docs/decode.md). Arms, per
(shape, quant, M): ``nn.Linear bf16``; ``quantizer + cuBLAS`` (the activation quantizer's launch
and the vendor GEMM: the layer's general path, and blockscale's decode rows before the split);
``decode_gemm`` (the rule's pick as a graph capture takes it); at one row ``one-row kernel`` (the
one-row GEMV an eager call takes); and per config ``BLOCK_N/BLOCK_K/SPLIT/warps/stages`` the
quantizer's launch and the MMA built by ``decode._Launch`` with that config (``decode``'s tables and
``MMA_SPLIT`` set for it, the rule's waves bound lifted). Every arm is first checked against the fp32
product of the dequantized operands (``gemm_mismatches``: none outside the fp8 GEMM's budget) and for
equal bits on a repeat. ``--cold`` also times each arm as a graph whose calls are each on a weight
of its own (10 seeded copies, as a model's layers follow each other), in the same passes.
"""
import itertools
import json
import sys
import time

import torch

from cco import quant as Q
from scripts._cli import drew_an_earlier_run, ints, shape_probe_args
from scripts.tune_decode import SHAPES, checked_arms, decode_panel, earlier_run, graph_us, save_figure, shape_weight
from scripts.tune_decode import with_config as set_tables


GRAPH_CALLS = 10  # calls per captured graph (--cold: also each on a weight of its own)


def configs(quant: str, k: int, block_ns=(32, 64), warps=(4,), stages=None, block_ks=None, splits=(1, 2, 4, 8)):
    """(BLOCK_N, BLOCK_K, SPLIT, warps, stages) tried: at least two K steps per slice; ``stages``
    a list of num_stages, or None for the quant's own (ptpc 4, blockscale 3); ``block_ks`` a list
    of BLOCK_K, or None for the quant's own (ptpc 128 and 256, blockscale 256 and 512); ``splits``
    the K slices per block tried."""
    steps = block_ks or ((128, 256) if quant == "ptpc" else (256, 512))
    for bn, bk, split, w, st in itertools.product(block_ns, steps, splits, warps,
                                                  stages or [4 if quant == "ptpc" else 3]):
        if k % bk == 0 and k // bk >= 2 * split:
            yield bn, bk, split, w, st


_SPLIT_STYLES = (":", "-.", (0, (1, 3)), (0, (5, 2, 1, 2)), (0, (3, 1)))  # a line style per K-slice count drawn


INLINE = "inline: "  # the label's prefix of a config's --inline arm


def _config_arms(times: dict) -> list[str]:
    """The config arms of a row's times (``BLOCK_N/BLOCK_K/SPLIT/warps/stages``), the quantizer's
    launch and the MMA's."""
    return [a for a in times if a.count("/") == 4 and not a.startswith(INLINE)]


def _inline_arms(times: dict) -> list[str]:
    """The ``--inline`` arms of a row's times: the same configs with the quantizer inside the MMA."""
    return [a for a in times if a.startswith(INLINE)]


def one_row_kernel(launch):
    """The kernel an eager one-row call of ``launch`` (a ``decode._Launch`` of one row) runs: its
    eager path ``one`` beside the captured quantizer + MMA, or the launch's only kernel where the
    weight is under ``decode.CAPTURED_ROW_MIN_BYTES`` (a capture takes the one-row kernel too)."""
    return launch.one if launch.one is not None else launch.kernel


def parse_args(argv=None):
    def extra(p):
        p.add_argument("--block-n", type=ints, default=[32, 64], help="comma list of BLOCK_N tried (default 32,64)")
        p.add_argument("--warps", type=ints, default=[4], help="comma list of num_warps tried (default 4)")
        p.add_argument("--block-k", type=ints, default=None,
                       help="comma list of BLOCK_K tried (default: ptpc 128,256; blockscale 256,512; blockscale "
                            "takes multiples of 128)")
        p.add_argument("--stages", type=ints, default=None,
                       help="comma list of num_stages tried (default: the quant's own, ptpc 4, blockscale 3)")
        p.add_argument("--splits", type=ints, default=[1, 2, 4, 8],
                       help="comma list of K slices per weight block tried (default 1,2,4,8; each slice keeps "
                            "at least two K steps)")
        p.add_argument("--inline", action="store_true",
                       help="each config also as one launch instead of two (scripts/inline_quant_mma.py, a "
                            "probe's kernels): blockscale's MMA quantizing its own K slice; ptpc's quantizer and "
                            "split MMA as two phases of one cooperative launch with a grid-wide wait (where the "
                            "grid is resident at once), each checked for the two launches' bits first and "
                            "left out where a graph cannot capture it")
        p.add_argument("--cold", action="store_true",
                       help=f"each arm also timed as a graph whose {GRAPH_CALLS} calls are each on a weight of "
                            f"its own, as a model's layers (no call finds its weight in L2 from the call before), "
                            f"in the same passes as the one-weight graphs (us_cold)")

    return shape_probe_args(__doc__, SHAPES, argv, quants=("ptpc", "blockscale"), extra=extra)


def with_config(D, quant: str, cfg) -> None:
    """``decode``'s tables set so that a new ``_Launch`` of ``quant`` at 1..64 rows builds ``cfg``."""
    bn, bk, split, warps, stages = cfg
    for m in (2, D.MMA_ROWS_MAX):  # the rows' tables and the wide MMA's
        set_tables((bn, bk, warps, stages), quant, m)
    D.MMA_SPLIT[quant] = D.MMA_SPLIT_WIDE[quant] = split
    D.MMA_SPLIT_WAVES[quant] = 1 << 20  # the config's split wherever the steps allow it


def table_restorer(D, quants):
    """A function that puts every table :func:`with_config` sets for ``quants`` (``decode``'s own
    dicts, set in place) back to its values now, and drops the launches kept since."""
    tables = [t for quant in quants for m in (2, D.MMA_ROWS_MAX) for t in D.tables(quant, m)]
    tables += [D.MMA_SPLIT, D.MMA_SPLIT_WIDE, D.MMA_SPLIT_WAVES]
    saved = [dict(t) for t in tables]

    def restore():
        for table, old in zip(tables, saved):
            table.clear()
            table.update(old)
        D._LAUNCHES.clear()

    return restore


def plot(path: str, png: str):
    """One panel per shape of the run at ``path``: device us per call over M (a ``--cold`` run's cold
    times), ``nn.Linear`` bf16 and 0.8x of it (the target), and per quant the quantizer + cuBLAS
    (dashed), the rule's ``decode_gemm`` (solid), at one row the one-row kernel (hollow), and per K
    slice count the best config of that many slices (thin); lower is better. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, rows = earlier_run(path, "probe_decode_split_k")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    # a --cold run's figures are the model's (each call on its own weight): draw those where every row has them
    key = "us_cold" if all("us_cold" in r for r in rows) else "us"
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.6), squeeze=False)
    colors = {"ptpc": "tab:blue", "blockscale": "tab:orange"}
    for ax, shape in zip(axes[0], shapes):
        mine = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["m"])
        bf16 = {r["m"]: r[key]["nn.Linear bf16"] for r in mine if r["quant"] == mine[0]["quant"]}
        ax.plot(list(bf16), list(bf16.values()), color="black", marker="o", label="nn.Linear bf16")
        ax.plot(list(bf16), [0.8 * v for v in bf16.values()], color="gray", linestyle="--", linewidth=0.8,
                label="0.8x nn.Linear (the target)")
        for quant in dict.fromkeys(r["quant"] for r in mine):
            q = [r for r in mine if r["quant"] == quant]
            ms = [r["m"] for r in q]
            ax.plot(ms, [r[key]["quantizer + cuBLAS"] for r in q], color=colors.get(quant), linestyle="--",
                    marker="x", label=f"{quant}: quantizer + cuBLAS")
            ax.plot(ms, [r[key]["decode_gemm"] for r in q], color=colors.get(quant), marker="s",
                    label=f"{quant}: decode_gemm (the rule, captured)")
            one = [(r["m"], r[key]["one-row kernel"]) for r in q if "one-row kernel" in r[key]]
            if one:
                ax.plot(*zip(*one), color=colors.get(quant), marker="o", fillstyle="none", linestyle="none",
                        label=f"{quant}: one-row kernel (eager's)")
            inline = [(r["m"], min(r[key][a] for a in _inline_arms(r[key]))) for r in q if _inline_arms(r[key])]
            if inline:  # (the cells whose one launch was checked and captured: an arm left out is not drawn)
                what = "quantizer inside the MMA" if quant == "blockscale" else "quantizer and MMA in one launch"
                ax.plot(*zip(*inline), color=colors.get(quant), marker="^", linewidth=1.6,
                        label=f"{quant}: {what}, best config (--inline)")
            for split, style in zip(sorted({int(c.split("/")[2]) for c in _config_arms(q[0][key])}), _SPLIT_STYLES):
                best = [min(v for c, v in r[key].items() if c in _config_arms(r[key]) and int(c.split("/")[2]) == split)
                        for r in q]
                ax.plot(ms, best, color=colors.get(quant), linestyle=style, linewidth=0.9, alpha=0.8,
                        label=f"{quant}: best config of {split} K slice{'s' if split > 1 else ''}")
        decode_panel(ax, mine[0], key == "us_cold")
    return save_figure(fig, "decode MMA with K split", run, png)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if drew_an_earlier_run(argv, "probe_decode_split_k", plot):
        return
    args = parse_args(argv)
    from cco.bench.timing import require_cuda

    require_cuda("probe_decode_split_k")  # after parsing: --help and argument errors need no GPU
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import native as NV
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.quantize import quantize_activation
    from scripts.bench_decode import one_weight_and_cold, switched_off
    from scripts.inline_quant_mma import InlineLaunch, PtpcOneLaunch

    NV.ENABLED = False  # the Python path's launches, as a graph captures them
    restore = table_restorer(D, args.quant)
    dev = torch.device("cuda")
    out_rows = []
    t0 = time.time()
    for name in args.shapes:
        n, k, w, w_bf16 = shape_weight(name, dev)
        # --cold: the graph's other calls each on a weight of its own (seeds 1..), as a model's layers
        others = [shape_weight(name, dev, seed)[2:] for seed in range(1, GRAPH_CALLS if args.cold else 1)]
        for quant in args.quant:
            wq, ws = Q.quantize_b(w, quant)
            copies = [(w_bf16, wq, ws, vendor.prepare_weight(wq, ws, quant))]
            for w_i, w_bf16_i in others:
                wq_i, ws_i = Q.quantize_b(w_i, quant)
                copies.append((w_bf16_i, wq_i, ws_i, vendor.prepare_weight(wq_i, ws_i, quant)))
            wd = Q.dequantize_b(wq, ws, quant)  # (the reference's weight, the same at every M)
            for m in args.m:
                restore()
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                q, sa = quantize_activation(x, quant, k_padded=k)
                ad = Q.dequantize_a(q, sa, quant)
                ref, dot_abs = ad @ wd.t(), ad.abs() @ wd.abs().t()
                rows_v = vendor.padded_rows(quant, m)
                row = None
                if m == 1:  # (restore() left no launch: the one made here is the row's)
                    D.decode_gemm(x, wq, ws, quant, n=n)
                    (row,) = D._LAUNCHES.values()
                launches, inline = [], []
                for cfg in configs(quant, k, args.block_n, args.warps, args.stages, args.block_k, args.splits):
                    with_config(D, quant, cfg)
                    launches.append(("/".join(map(str, cfg)), D._Launch(m, k, k, n, quant, False, 0)))
                    if args.inline and quant == "blockscale":
                        inline.append((INLINE + launches[-1][0], InlineLaunch(m, k, k, n, cfg, dev)))
                    elif args.inline and quant == "ptpc":
                        try:
                            inline.append((INLINE + launches[-1][0], PtpcOneLaunch(m, k, k, n, cfg, dev)))
                        except ValueError as err:  # a grid not resident at once: no arm
                            print(f"{name} {quant} M={m} {launches[-1][0]}: no one launch: {err}", flush=True)
                restore()

                def arms_of(w_bf16, wq, ws, vw, x=x, m=m, quant=quant, rows_v=rows_v, row=row, launches=launches,
                            inline=inline):
                    """Every arm over one weight copy, each a callable of no argument."""
                    arms = {"nn.Linear bf16": lambda: torch.nn.functional.linear(x, w_bf16),
                            "quantizer + cuBLAS": lambda: vendor.vendor_gemm(
                                *quantize_activation(x, quant, k_padded=k, m_padded=rows_v), vw)[:m],
                            "decode_gemm": lambda: D.decode_gemm(x, wq, ws, quant, n=n)}
                    if row is not None:
                        o1 = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
                        kernel = one_row_kernel(row)
                        arms["one-row kernel"] = lambda o=o1: (
                            kernel(0, *row._row(x, wq, ws, o, o, x.stride(0), ws.stride(0))), o)[1]
                    for label, launch in launches:
                        # the launch's quantizer and MMA, as a capture takes them (eagerly too: the one launch off)
                        arms[label] = switched_off(lambda launch=launch, o=torch.empty(m, n, dtype=torch.bfloat16,
                                                                                     device=dev):
                                                   (launch(x, x.stride(0), wq, ws, None, o), o)[1], D, "ONE_LAUNCH")
                    for label, launch in inline:
                        arms[label] = lambda launch=launch, o=torch.empty(m, n, dtype=torch.bfloat16, device=dev): \
                            launch(x, wq, ws, o)
                    return arms

                arms = arms_of(*copies[0])
                cold = [arms_of(*c) for c in copies[1:]]
                # --inline: each config's one launch against its two launches, bit for bit (twice: the
                # inline counters carry over from call to call); an arm that differs is left out
                bits = {}

                def drop(label, why, arms=arms, cold=cold):  # an --inline arm left out of every copy's arms
                    print(f"{name} {quant} M={m}: {label} {why}: left out", flush=True)
                    del arms[label]
                    for c in cold:
                        del c[label]

                for label, _ in inline:
                    two = arms[label[len(INLINE):]]().clone()
                    bits[label] = all(torch.equal(arms[label](), two) for _ in range(2))
                    if not bits[label]:
                        drop(label, "differs from its two launches' bits")
                for label, _ in inline:  # (compiled by the bit check above) a launch a graph cannot capture: left out
                    if label in arms:
                        try:
                            torch.cuda.synchronize()
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g):
                                arms[label]()
                            g.replay()
                            torch.cuda.synchronize()
                            del g
                        except Exception as err:  # noqa: BLE001 - recorded, the arm dropped
                            torch.cuda.synchronize()
                            bits[label] = f"not captured: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
                            drop(label, bits[label])
                _, bad, wrong, _ = checked_arms(arms, ref, dot_abs, f"{name} {quant} M={m}")
                # --cold: each arm also as a graph over every copy, in the same passes as the one-weight graphs
                # (an arm found wrong on the first copy is left out of both)
                t, t_cold = one_weight_and_cold(arms, cold, lambda graphs: graph_us(graphs, GRAPH_CALLS, 3))
                if t_cold:
                    c = t_cold["nn.Linear bf16"]
                    print(f"{name} {quant} M={m} cold ({len(copies)} weights): bf16 {c:.1f} us | "
                          + " | ".join(f"{a} {t_cold[a]:.1f} ({t_cold[a] / c:.2f}x)" for a in
                                       ("quantizer + cuBLAS", "decode_gemm", "one-row kernel") if a in t_cold)
                          + " | best: " + ", ".join(f"{a} {v:.1f} ({v / c:.2f}x)" for v, a in
                                                    sorted((t_cold[a], a) for a in _config_arms(t_cold))[:4])
                          + "".join(f" | best {a} {v:.1f} ({v / c:.2f}x)" for v, a in
                                    sorted((t_cold[a], a) for a in _inline_arms(t_cold))[:1]),
                          flush=True)
                base = t["nn.Linear bf16"]
                cfgs = [(t[a], a) for a in _config_arms(t)]
                best = sorted(cfgs)[:4]
                unsplit = min(((v, a) for v, a in cfgs if a.split("/")[2] == "1"), default=None)  # (--splits without 1)
                print(f"[{time.time() - t0:.0f} s] {name} {quant} M={m}: bf16 {base:.1f} us | "
                      + " | ".join(f"{a} {t[a]:.1f} ({t[a] / base:.2f}x)" for a in
                                   ("quantizer + cuBLAS", "decode_gemm", "one-row kernel") if a in t)
                      + (f" | unsplit best {unsplit[1]} {unsplit[0]:.1f} ({unsplit[0] / base:.2f}x)" if unsplit else "")
                      + " | best: "
                      + ", ".join(f"{a} {v:.1f} ({v / base:.2f}x)" for v, a in best)
                      + "".join(f" | best {a} {v:.1f} ({v / base:.2f}x)" for v, a in
                                sorted((t[a], a) for a in _inline_arms(t))[:1]), flush=True)
                out_rows.append({"shape": name, "n": n, "k": k, "m": m, "quant": quant, "us": t,
                                 **({"us_cold": t_cold, "cold_weights": len(copies)} if t_cold else {}),
                                 **({"inline_same_bits": bits} if bits else {}),
                                 "outside_budget": bad, "wrong": wrong})
                with open(args.json, "w") as f:  # after every cell: a run cut short keeps what it timed
                    json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "command": "python3 -m scripts.probe_decode_split_k " + " ".join(argv),
                               "rows": out_rows}, f, indent=1)
    restore()


if __name__ == "__main__":
    main()
