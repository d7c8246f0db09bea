"""Where an eager decode step of ``bench_decode``'s model spends its host time, slot by slot (one GPU)::

    python3 -m scripts.probe_decode_model_host --quant ptpc --batch 1 --json host.json
    python3 -m scripts.probe_decode_model_host --from host.json [more.json ...] --plot host.png  # no GPU

Why: with o_proj and down_proj alone in fp8 the eager step is 1.03-1.17x of bf16's, yet with every
linear in fp8 it is 0.90-0.92x, and one layer call alone costs 0.4-1.0x of ``nn.Linear``'s host time
(docs/decode.md, "Targets"). The arms: ``bf16``; ``row`` (o_proj and down_proj cco layers, the
``cco <quant>`` arm); ``column`` (q/k/v_proj and gate/up_proj only); ``every`` (both). Per arm:
the eager step's host ms/token (``time_back_to_back``, arms alternating per pass, as bench_decode
times them); then the same steps with every linear slot wrapped in a timer (``perf_counter`` around
the slot's call, the wrapper the same in every arm), giving host us per call for each slot name and
what the rest of the step costs; and each slot's call alone, back to back on the same input (what
the per-call table measures), beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from scripts import bench_decode as B
from scripts._cli import ints

SLOTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Timed(torch.nn.Module):
    """``inner``'s call with its host time added to ``spent[name]`` (seconds) while ``on[0]``."""

    def __init__(self, inner, name: str, spent: dict, on: list):
        super().__init__()
        self.inner, self.name, self.spent, self.on = inner, name, spent, on

    def forward(self, x):
        if not self.on[0]:
            return self.inner(x)
        t0 = time.perf_counter()
        y = self.inner(x)
        self.spent[self.name] = self.spent.get(self.name, 0.0) + time.perf_counter() - t0
        return y


def plot(paths: list[str], out: str):
    """Draw runs of this probe (their JSON files): a panel per (quant, batch), each slot's host us per
    call in the model as bars per arm, its call alone as a dot, and each arm's step in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for path in paths:
        with open(path) as f:
            files.append(json.load(f))
    runs = [(d, r) for d in files for r in d["runs"]]
    panels = sorted({(d["quant"], r["batch"]) for d, r in runs})
    arms = list(dict.fromkeys(r["arm"] for _, r in runs))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    width = 0.8 / len(arms)
    for ax, (quant, batch) in zip(axes[:, 0], panels):
        mine = {r["arm"]: (d, r) for d, r in runs if d["quant"] == quant and r["batch"] == batch}
        for i, arm in enumerate(arms):
            if arm not in mine:
                continue
            d, r = mine[arm]
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(SLOTS))]
            ax.bar(xs, [r["slot_us_in_model"][n] for n in SLOTS], width,
                   label=f"{arm}: step {r['host_ms_per_token']:.2f} ms (rest {r['rest_ms_per_token']:.2f})")
            ax.plot(xs, [r["slot_us_alone"][n] for n in SLOTS], "k.", markersize=5,
                    label="the slot's call alone" if i == 0 else None)
        ax.set_xticks(range(len(SLOTS)), SLOTS)
        ax.set_ylim(0, 1.5 * max(max(r["slot_us_in_model"].values()) for _, r in mine.values()))  # (the legend's room)
        ax.set_ylabel("host us per call (lower is better)")
        d0 = next(iter(mine.values()))[0]
        ax.set_title(f"{quant}, batch {batch}: eager step, host time per linear slot in the model "
                     f"({d0['device']}, {d0['date']})", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return fig


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--from"]:  # draw earlier runs, no GPU
        if len(argv) < 4 or argv[-2] != "--plot":
            raise SystemExit("usage: python3 -m scripts.probe_decode_model_host --from RUN.json [RUN.json ...] "
                             "--plot OUT.png")
        plot(argv[1:-2], argv[-1])
        return 0
    p = argparse.ArgumentParser(description="host time of bench_decode's eager step, slot by slot")
    p.add_argument("--quant", default="ptpc")
    p.add_argument("--batch", type=ints, default=[1])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=200, help="each slot's call alone: back-to-back calls")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from cco.bench.timing import require_cuda, time_back_to_back
    from kernels_fused.hopper import native as NV

    require_cuda("probe_decode_model_host")
    device = torch.device("cuda", torch.cuda.current_device())
    model_args = B.parse_args(["--model-only"])
    comm = B.launched_or_one_rank(device)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "quant": args.quant, "runs": []}
    with comm:
        out["native"] = "loaded" if NV.start(wait=600) else f"not loaded: {NV.error()}"
        model = B.build_model(model_args, device)
        q = args.quant
        row = lambda lin: B.cco_layer(lin, q, comm, m_max=256)  # noqa: E731
        col = lambda lin: B.cco_column_layer(lin, q, comm, m_max=256)  # noqa: E731
        same = lambda lin: lin  # noqa: E731
        makers = {"bf16": (None, None), "row": (row, None), "column": (same, col), "every": (row, col)}
        for batch in args.batch:
            dec = B.Decoder(model, batch, model_args.prompt, args.tokens, device)
            spent, on = {}, [False]
            built = {}
            slots = [name for _, name, _ in model._cco_rowwise + model._cco_colwise]  # (swapped's order)
            for arm, (make, make_col) in makers.items():
                built[arm] = [Timed(m, f"{arm}/{name}", spent, on)
                              for m, name in zip(B.swapped(model, make, make_col), slots)]
            B.swapped(model, None)
            dec.prefill()
            dec.step()
            dec.mark()

            def eager(arm):
                B.place(model, built[arm])
                dec.rewind()
                for _ in range(args.tokens):
                    dec.step()

            t = time_back_to_back({arm: (lambda arm=arm: eager(arm)) for arm in makers}, calls=1,
                                  passes=args.repeats, warmup=1)
            steps = {arm: statistics.median(r["host_pass_us"]) / args.tokens for arm, r in t.items()}
            spent.clear()
            on[0] = True
            walls = {}
            for arm in makers:  # the same steps with the slots' timers on
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    eager(arm)
                walls[arm] = (time.perf_counter() - t0) / (args.repeats * args.tokens) * 1e6
            on[0] = False
            torch.cuda.synchronize()
            # each slot alone: its first layer's call on a [batch, 1, K] input, back to back
            alone = {}
            layers, rowwise = len(model.model.layers), len(model._cco_rowwise)
            for arm in makers:
                for mod in built[arm][:rowwise // layers] + \
                        built[arm][rowwise:][:len(model._cco_colwise) // layers]:
                    inner = mod.inner
                    k = inner.in_features if hasattr(inner, "in_features") else inner.in_features_per_rank
                    x = torch.randn(batch, 1, k, device=device, dtype=torch.bfloat16)
                    for _ in range(20):
                        inner(x)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        inner(x)
                    alone[mod.name] = (time.perf_counter() - t0) / args.calls * 1e6
                    torch.cuda.synchronize()
            calls = args.repeats * args.tokens * len(model.model.layers)
            for arm in makers:
                per_slot = {name: 1e6 * spent.get(f"{arm}/{name}", 0.0) / calls for name in SLOTS}
                linears = sum(per_slot.values()) * len(model.model.layers) / 1e3
                rec = {"batch": batch, "arm": arm, "host_ms_per_token": steps[arm] / 1e3,
                       "timed_ms_per_token": walls[arm] / 1e3, "linears_ms_per_token": linears,
                       "rest_ms_per_token": walls[arm] / 1e3 - linears, "slot_us_in_model": per_slot,
                       "slot_us_alone": {name: alone.get(f"{arm}/{name}") for name in SLOTS}}
                out["runs"].append(rec)
                print(f"batch {batch} {arm:7s} step {steps[arm] / 1e3:6.3f} ms (timers on {walls[arm] / 1e3:6.3f}: "
                      f"linears {linears:6.3f}, rest {rec['rest_ms_per_token']:6.3f})  "
                      + " ".join(f"{n} {per_slot[n]:5.1f}/{alone.get(f'{arm}/{n}', float('nan')):5.1f}"
                                 for n in SLOTS), flush=True)
            B.swapped(model, None)
            for arm in makers:
                B.close([m.inner for m in built[arm]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
