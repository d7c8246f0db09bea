"""Where a decode-sized eager call of the layer spends its host time, per rank: ``RowParallelLinear``'s
call at M rows timed back to back, then each call issued on an idle queue (the GPU synchronized
before it: its own host cost, not the back-pressure of a device that runs behind), then the same
idle-queue calls under cProfile (tottime and cumulative, the project's own functions). Run it at
world 1 or under torchrun (two ranks may share one GPU: the host time is real there)::

    python3 -m scripts.profile_decode_call --quant ptpc -n 4096 -k 7168 -m 8 --out prof
    torchrun --nproc-per-node 2 -m scripts.profile_decode_call --quant ptpc -n 4096 -k 7168 -m 8 --out prof

Writes ``OUT/rank{r}.txt`` (the profile) and prints each rank's host and wall us per call (the
first line of that file).

``--parts`` adds, per rank, the host time of what a call is made of, each on an idle queue (median
and 10th..90th percentile): ``nn.Linear``'s call of the same shape (the control: a GPU shared by two
ranks slows every launch, not only the layer's), the activation quantizer alone, the op alone on
quantized rows, the layer, one stream write-value, one event record, an allocation and a reshape
(host operations without a launch); at world >= 2 on the lsa path, the layer with and without the
op's kept collective call, twice each (``CollectiveGemmOp._kept_collective``); then the layer's
calls again with the functions of its path timed inclusively (``PARTS_TIMED``: us per layer call, a function called twice a call counts twice;
~0.3 us of the timer itself per wrapped call). Written to ``OUT/parts_rank{r}.json`` and appended
to the rank's text.

``--alternate PASSES`` (world >= 2) compares the layer's call with and without the op's kept
collective call, pass by pass; ``--alternate-split PASSES`` its GEMM on the decode MMA before the lsa
kernel's transfers against the lsa kernel's own (``CCO_DECODE_SPLIT``, on by default: what an eager
call costs with the second launch)::

    torchrun --nproc-per-node 2 -m scripts.profile_decode_call --quant ptpc -n 4096 -k 7168 -m 8 --calls 100 --alternate-split 10
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import time

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", "")
                                .removesuffix("::") + ".")
    p.add_argument("--quant", default="ptpc", choices=("ptpc", "blockscale", "mxfp8"))
    p.add_argument("-n", type=int, default=4096, help="out_features")
    p.add_argument("-k", type=int, default=7168, help="in_features_per_rank")
    p.add_argument("-m", type=int, default=8, help="rows per call")
    p.add_argument("--calls", type=int, default=200, help="calls per measurement (three: back to back, each on an "
                                                         "idle queue, each on an idle queue under cProfile)")
    p.add_argument("--out", default="profile_decode_call")
    p.add_argument("--parts", action="store_true", help="also time the call's parts and nn.Linear's call (see above)")
    p.add_argument("--alternate", type=int, default=0, metavar="PASSES",
                   help="at world >= 2 on the lsa path: PASSES passes alternating the layer's call with and without "
                        "the op's kept collective call, each pass CALLS calls back to back (host us per call) and "
                        "CALLS on an idle queue (median); the median over passes of each, and every pass's, in "
                        "OUT/alternate_rank{r}.json")
    p.add_argument("--alternate-split", type=int, default=0, metavar="PASSES",
                   help="the same, alternating the layer's call with its GEMM on the decode MMA before the lsa "
                        "kernel's transfers (cco.backends.cuda.DECODE_SPLIT_ROWS, forced) and on the lsa kernel's own "
                        "GEMM (forced), both through the op's kept collective call; OUT/alternate_split_rank{r}.json")
    args = p.parse_args(argv)
    if min(args.n, args.k, args.m, args.calls) < 1:
        raise SystemExit("profile_decode_call: -n, -k, -m and --calls must be >= 1")

    from cco.nn import RowParallelLinear
    from scripts.bench_decode import launched_or_one_rank

    comm = launched_or_one_rank(torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    device = comm.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(comm.rank)
    layer = RowParallelLinear(args.k, args.n, group=comm, quant=args.quant, m_max=max(args.m, 64))
    layer.load_weight((torch.randn(args.n, args.k, generator=g) / args.k ** 0.5).to(torch.bfloat16).to(device))
    x = torch.randn(args.m, args.k, generator=g).to(torch.bfloat16).to(device)
    with torch.no_grad():
        for _ in range(20):  # first calls: plans, builds, kept launches
            layer(x)
        sync()
        comm.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            layer(x)
        host = (time.perf_counter() - start) / args.calls * 1e6
        sync()
        wall = (time.perf_counter() - start) / args.calls * 1e6
        # each call issued on an idle queue: its own host cost, without the back-pressure of a device
        # that runs behind (two ranks time-slicing one GPU run far behind their hosts)
        issue, prof = [], cProfile.Profile()
        for profiled in (False, True):
            for _ in range(args.calls):
                sync()
                start = time.perf_counter()
                if profiled:
                    prof.enable()
                layer(x)
                if profiled:
                    prof.disable()
                else:
                    issue.append((time.perf_counter() - start) * 1e6)
        sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(r"cco/|kernels_fused/", 30)
    os.makedirs(args.out, exist_ok=True)
    issue.sort()
    head = (f"rank {comm.rank}/{comm.world} {args.quant} N={args.n} K={args.k} M={args.m}: back to back host "
            f"{host:.1f} us, wall {wall:.1f} us per call; issued on an idle queue: median {issue[len(issue) // 2]:.1f} "
            f"us ({issue[len(issue) // 10]:.1f}..{issue[-1 - len(issue) // 10]:.1f}, 10th..90th percentile) "
            f"({args.calls} calls each, decode_rows {layer.decode_rows}); the profile: the idle-queue calls")
    with open(os.path.join(args.out, f"rank{comm.rank}.txt"), "w") as f:
        f.write(head + "\n\n" + text.getvalue())
    print(head, flush=True)
    if args.parts:
        with torch.no_grad():
            found = parts(layer, x, comm, args.calls, sync)
        lines = [f"rank {comm.rank}/{comm.world} parts, host us per call on an idle queue (median, 10th..90th):"]
        lines += [f"  {name:<24} {v['median']:8.1f}  ({v['p10']:.1f}..{v['p90']:.1f})" for name, v in found["arms"].items()]
        lines.append("  inside the layer's call (inclusive us per call, mean):")
        lines += [f"    {name:<44} {us:8.1f}  ({calls:g} calls)" for name, (us, calls) in found["timed"].items()]
        with open(os.path.join(args.out, f"rank{comm.rank}.txt"), "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
        with open(os.path.join(args.out, f"parts_rank{comm.rank}.json"), "w") as f:
            json.dump(dict(rank=comm.rank, world=comm.world, quant=args.quant, n=args.n, k=args.k, m=args.m,
                           calls=args.calls, **found), f, indent=1)
        print("\n".join(lines), flush=True)
    for passes, what, name in ((args.alternate, "kept", "alternate"), (args.alternate_split, "split", "alternate_split")):
        if not passes:
            continue
        with torch.no_grad():
            found = alternate(layer, x, comm, args.calls, passes, sync, *_alternatives(layer, x, comm, what))
        line = (f"rank {comm.rank}/{comm.world} alternating {passes} passes, host us per call (median over "
                f"passes; every pass in {name}_rank{comm.rank}.json): " + "; ".join(
                    f"{arm}: back to back {v['back_to_back']:.1f}, idle queue {v['idle']:.1f}"
                    for arm, v in found["median"].items()))
        with open(os.path.join(args.out, f"{name}_rank{comm.rank}.json"), "w") as f:
            json.dump(dict(rank=comm.rank, world=comm.world, quant=args.quant, n=args.n, k=args.k, m=args.m,
                           calls=args.calls, **found), f, indent=1)
        print(line, flush=True)
    layer.close()
    comm.close()


def _kept_call(op, on: bool) -> None:
    """Turn ``op``'s kept collective call off (its kept launches and the backend's ``keeps_fused``
    shadowed on the two instances by ones that find none and keep none: every call then takes the
    whole Python path) or back on (the shadows removed)."""
    if on:
        vars(op._launches).pop("launch_for", None)
        vars(op._backend).pop("keeps_fused", None)
    else:
        op._launches.launch_for = lambda *_: None
        op._backend.keeps_fused = lambda m: False


def _alternatives(layer, x, comm, what: str) -> tuple:
    """``(arms, restore)`` of ``alternate``: ``what`` "kept": the layer's call with (``kept``) and
    without (``not kept``: the op's kept launches and the backend's ``keeps_fused`` shadowed on the
    instances, its whole Python path) the op's kept collective call; "split": its GEMM forced on the
    decode MMA before the lsa kernel's transfers and on the lsa kernel's own (the backend's
    ``decode_split``; the rule's again after)."""
    if layer.op is None or comm.world < 2:
        raise SystemExit(f"profile_decode_call: --alternate{'-split' if what == 'split' else ''} needs the fused "
                         f"layer at world >= 2")
    op = layer.op
    if what == "kept":
        return {"kept": lambda: None, "not kept": lambda: _kept_call(op, False)}, lambda: _kept_call(op, True)
    from kernels_fused.hopper.decode import MMA_ROWS_MAX, QUANTIZED_ROWS

    backend, rows = op._backend, layer._rows_for(x.shape[0])
    if layer.quant not in QUANTIZED_ROWS or not 1 <= rows <= MMA_ROWS_MAX:
        raise SystemExit(f"profile_decode_call: --alternate-split: {layer.quant} calls of {rows} rows cannot take "
                         f"the decode MMA (decode.RowsMma: {sorted(QUANTIZED_ROWS)}, 1..{MMA_ROWS_MAX} rows)")
    taken = []
    real = backend._decode_lsa

    def split():
        backend.decode_split = True
        backend._decode_lsa = lambda *a: (taken.append(1), real(*a))[1]

    def restore():
        if not taken and backend.decode_split:
            raise SystemExit("profile_decode_call: --alternate-split: no call took the decode MMA")
        taken.clear()
        vars(backend).pop("_decode_lsa", None)
        backend.decode_split = None

    return {"decode MMA + lsa transfers": split, "lsa kernel": lambda: setattr(backend, "decode_split", False)}, restore


def alternate(layer, x, comm, calls: int, passes: int, sync, arms: dict, restore) -> dict:
    """``--alternate`` / ``--alternate-split``: the layer's call under each of the two ``arms``
    (name -> the switch that sets it; ``restore()`` undoes it), alternating per pass; per pass and
    arm the host us per call of ``calls`` calls issued back to back (the GPU synchronized before and
    after, the host loop timed) and the median of ``calls`` calls each issued on an idle queue."""
    def arm(name: str):
        arms[name]()
        try:
            for _ in range(5):  # warm (the kept arm: keeps its launch again)
                layer(x)
            sync()
            comm.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                layer(x)
            b2b = (time.perf_counter() - start) / calls * 1e6
            sync()
            comm.barrier()
            idle = _idle_times(lambda: layer(x), calls, sync)["median"]
        finally:
            restore()
        return dict(back_to_back=b2b, idle=idle)

    first, second = arms
    runs = {first: [], second: []}
    for p in range(passes):
        for name in ((first, second) if p % 2 == 0 else (second, first)):
            runs[name].append(arm(name))
    return dict(passes=runs, median={name: {what: statistics.median_high([r[what] for r in rs])
                                            for what in ("back_to_back", "idle")} for name, rs in runs.items()})


# The functions of a decode-sized call's path timed by ``--parts`` (module, attribute path): each is
# looked up where its callers look it up (a name imported into a module is timed in that module).
PARTS_TIMED = (
    ("cco.nn.linear", "quantize_activation"),
    ("cco.op", "ScatterGemmOp.__call__"),
    ("cco.op", "CollectiveGemmOp._call"),
    ("cco.op", "CollectiveGemmOp._collective"),
    ("cco.layout", "plan_call"),
    ("cco.backends.cuda", "CudaBackend.fused"),
    ("cco.backends.cuda", "CudaBackend._lsa"),
    ("cco.backends.cuda", "CudaBackend.raise_failed"),
    ("cco.backends.cuda", "CudaBackend.raise_deferred"),
    ("cco.cuda.dma", "CopyEngineSchedule.begin"),
    ("cco.cuda.memops", "write"),
    ("cco.cuda.watchdog", "CallMarks.enter"),
    ("cco.cuda.watchdog", "CallMarks.leave"),
    ("kernels_fused.hopper.gemm", "fp8_gemm_lsa"),
    ("kernels_fused.hopper.gemm", "_operands"),
    ("kernels_fused.hopper.gemm", "specialization"),
    ("kernels_fused.hopper.launch", "Kernel.__call__"),
)


def _idle_times(fn, calls: int, sync) -> dict:
    """Host us of ``fn()`` per call, each issued on an idle queue: median and 10th / 90th percentile."""
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    sync()
    times.sort()
    return dict(median=times[len(times) // 2], p10=times[len(times) // 10], p90=times[-1 - len(times) // 10])


def parts(layer, x, comm, calls: int, sync) -> dict:
    """``--parts``: the arms' idle-queue host times and the layer's path timed function by function
    (see the module note). Every rank runs the same arms in the same order (the op and the layer
    are collective calls)."""
    from cco.nn.linear import quantize_activation

    device = x.device
    qweight, scale = layer.quantized_weight()
    rows = layer._rows_for(x.shape[0]) if layer.op is not None else x.shape[0]
    a, a_scale = quantize_activation(x, layer.quant, k_padded=layer.k_padded, m_padded=rows)
    linear = torch.nn.Linear(x.shape[1], layer.out_features, bias=False, device=device, dtype=torch.bfloat16)
    arms = {"nn.Linear": lambda: linear(x),
            # two host operations without a launch: an allocation from the caching allocator, and a
            # view (pure CPU: slower here than at world 1 means the host itself, not the driver)
            "torch.empty": lambda: torch.empty(x.shape[0], layer.out_features, dtype=torch.bfloat16, device=device),
            "reshape": lambda: x.reshape(-1, x.shape[-1]),
            "quantizer": lambda: quantize_activation(x, layer.quant, k_padded=layer.k_padded, m_padded=rows),
            "layer": lambda: layer(x)}
    if layer.op is not None:
        arms["op on quantized rows"] = lambda: layer.op(a, qweight, a_scale, scale)
    backend = layer.op._backend if layer.op is not None else None
    kept = backend is not None and comm.world > 1 and backend.keeps_fused(rows)  # where a kept call is made
    if kept:  # the same call without the op's kept collective call: its whole Python path, as before it

        def unkept():
            _kept_call(layer.op, False)  # (undone after the arm)
            return layer(x)
        arms["layer, not kept"] = unkept
        arms["layer, kept (again)"] = lambda: layer(x)
        arms["layer, not kept (again)"] = unkept
    if device.type == "cuda":
        from cco.cuda import memops

        word = torch.zeros(1, dtype=torch.int64, device=device)
        event = torch.cuda.Event()
        arms["stream write-value"] = lambda: memops.write(torch.cuda.current_stream().cuda_stream, word.data_ptr(), 1)
        arms["event record"] = lambda: event.record()
    found = {}
    for name, fn in arms.items():
        for _ in range(10):  # warm
            fn()
        comm.barrier()
        found[name] = _idle_times(fn, calls, sync)
        if kept:  # the kept call back (a no-op after the other arms)
            _kept_call(layer.op, True)
    # the layer's path, function by function
    spent: dict[str, list] = {}
    undo = []
    for module_name, path in PARTS_TIMED:
        owner = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        original = getattr(owner, attr, None) if owner is not None else None
        if original is None:
            continue
        cell = spent.setdefault(path, [0.0, 0])

        def timed(*a, _fn=original, _cell=cell, **kw):
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                _cell[0] += time.perf_counter() - start
                _cell[1] += 1

        setattr(owner, attr, timed)
        undo.append((owner, attr, original))
    try:
        for cell in spent.values():
            cell[:] = [0.0, 0]
        comm.barrier()
        whole = _idle_times(lambda: layer(x), calls, sync)
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)
    found["layer, its parts timed"] = whole
    timed = {path: (total / calls * 1e6, n / calls) for path, (total, n) in spent.items() if n}
    return dict(arms=found, timed=timed)


if __name__ == "__main__":
    main()
