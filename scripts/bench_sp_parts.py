"""The sequence-parallel ops' GEMM work on one GPU against the whole vendor GEMM of the same [M, N, K].

    python3 -m scripts.bench_sp_parts --json sp.json --plot sp.png
    python3 -m scripts.bench_sp_parts --pattern ag --quant ptpc --model llama3-70b --tp 4 -m 8192
    python3 -m scripts.bench_sp_parts --from sp.json --plot sp.png      # the plot alone, no GPU

What one GPU can measure of the CUDA backend's reduce-scatter along rows and all-gather
(``cco.backends.cuda``): W owners (W = the tensor-parallel degree) simulated as rank 0 of W, the
window local (``scripts.bench_gemm.local_window``), the op's own config for the CUDA backend
(its tile, chunks, producer streams). The arms call the backend's own methods, so they issue what
a call issues:

- ``rs-rows``: the producer of the reduce-scatter along rows (``CudaBackend._produce``) as the
  backend's rule picks it (``RS_ROWS_PRODUCER``, by the rows of the vendor producer's GEMM), and
  each producer forced: ``rs-rows vendor`` (counters zeroed, the call's stamp, one vendor GEMM per
  group of an owner's consecutive chunks, ``RS_PRODUCER_ROWS``, of A's rows into ``partial[owner]``,
  the peers' slices first, each followed by its chunks' counters' release, dealt to
  ``cco.cuda.dma.PRODUCER_STREAMS`` streams), ``rs-rows vendor chunks`` (the same with a GEMM per
  (owner, chunk): W*C GEMMs of M/(W*C) rows) and ``rs-rows kernel`` (one launch of the own Triton
  GEMM walking the row slices, each tile's add releasing its counter; its launch as
  ``RS_ROWS_KERNEL_LAUNCH`` picks it, and each forced: ``kernel-grid`` a program per entry of the
  tile table, ``kernel-ws`` persistent warp-specialized programs computing the walk, ``kernel-ws-lag``
  the same releasing each tile one tile late). Timed until every
  slice is released. The puts to the peers are not issued: one GPU has no link to time them on. The
  line shows the rule's arm, then the forced ones.
- ``ag``: the all-gather's call (``CudaBackend.all_gather_gemm``) with the peers' rows already in
  the window's slots: the own rows copied into the own slot and their GEMM (on a stream of its own,
  beside the rest: ``cco.cuda.dma``'s module note), the rule's GEMMs over the peers' rows in the
  order their flags would arrive, the stamp check. The rule: a GEMM per
  group of each peer's consecutive chunks (``AG_CONSUMER_ROWS``), or, where each peer's rows are one
  group, one GEMM over every peer's slots after the last wait (``CudaBackend.consumer_merges``; rank
  0 here: the peers' slots are one block, 2 GEMMs in all). Forced: ``ag chunks`` a GEMM per chunk
  (1 + (W-1)*C GEMMs), ``ag sources`` a GEMM per peer (1 + (W-1)), ``ag merged`` the peers' GEMM
  merged whatever the groups (2). The all-gather's window is built per M with ``m_max`` = M, so each
  call fills the slots (no pad rows between them, which the merge needs). The puts and the waits
  for the peers' flags are dropped (:class:`NoPeers`): no peer sends them here. ``--flags-landed``
  keeps the waits and sets every peer's flags of a call before it (:class:`LandedPeers`): the
  call's cost once every peer's rows have landed, its waits included (each stream wait holds the
  call's stream ~1.9 us even on a flag already set; ``scripts/probe_stream_ops.py``).
- ``whole``: one vendor GEMM of all M rows (the backend's prepared weight and accumulation), the
  baseline of both; where ``vendor.takes_rows`` keeps a shape off cuBLAS (blockscale at a K of
  ceil(K/128) % 4 != 0: DeepSeek-V3's down projection at TP 8, K = 2304), the plain GEMM the library
  runs there (``fp8_gemm``'s default, the own kernel), as the backend's arms then run it too.

Shapes (``layer_shape``): the MLP of Llama-3-70B (hidden 8192, intermediate 28672) and DeepSeek-V3's
dense layers (hidden 7168, intermediate 18432) at TP 2, 4, 8: the reduce-scatter follows the
row-parallel down projection (N = hidden, K = intermediate/TP), the all-gather feeds the
column-parallel gate+up projection (N = 2 * intermediate/TP, K = hidden); M counts the tokens of
the whole sequence (the GEMM's rows before the scatter, after the gather).

Every arm's output (sampled rows, every chunk's first and last) and, for ``rs-rows``, every
counter are checked first; a wrong arm posts no time, and a shape that posted none exits 1 (after the
JSON). Timing is ``cco.bench.timing.time_arms`` on
CUDA-graph replays (the arms of a shape alternate in each pass, L2 flushed before each call: the
``ag`` arm's peer rows sit in one place, the baseline's inputs rotate). Per (pattern, quant, shape,
M, W) one line: the arm's median time, its ratio to ``whole`` (taken pass by pass: median and
range; lower is better, the target is 1.1); progress goes to stderr. ``--json``: every record with
the per-pass times, date, device and versions; ``--plot``: the ratios over M, one panel per pattern.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

if not __package__:  # run by path (python3 scripts/bench_sp_parts.py): the repository root, which -m puts on
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # sys.path, holds scripts.*

import torch

from cco import layout
from cco import quant as Q
from cco.backends.cuda import AG_CONSUMER_ROWS, PRODUCERS, RS_PRODUCER_ROWS, WALKS, consumer_groups, rows_producer
from cco.cuda.dma import MAX_PRODUCER_STREAMS
from scripts._cli import DefaultsHelp

MODELS = {"llama3-70b": (8192, 28672), "deepseek-v3": (7168, 18432)}  # (hidden, intermediate) of the MLP
PATTERNS = {"rs-rows": "reduce-scatter-rows", "ag": "all-gather"}  # this script's names -> cco's
TARGET = 1.1  # the ratio to the whole GEMM the sequence-parallel issue asks for
ROWS_KERNEL_LAUNCHES = ("grid", *WALKS)  # rs-rows: the kernel producer forced to each (CudaBackend.rows_kernel_launch)


def layer_shape(pattern: str, model: str, tp: int) -> tuple[int, int, str]:
    """(N, K, layer) of the GEMM next to ``pattern`` in ``model``'s MLP at tensor-parallel degree ``tp``."""
    hidden, inter = MODELS[model]
    if inter % tp:
        raise ValueError(f"{model}: intermediate {inter} is not divisible by TP {tp}")
    if pattern == "rs-rows":  # row-parallel: each rank holds K/TP of the reduction
        return hidden, inter // tp, "down"
    return 2 * inter // tp, hidden, "gate_up"  # column-parallel: each rank holds N/TP of gate and of up


def _list(kind, allowed):
    def parse(text):
        items = [kind(x) for x in text.split(",")]
        bad = [x for x in items if allowed is not None and x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad}: pick from {', '.join(map(str, allowed))}")
        return items
    return parse


def _names(choices) -> str:
    return ",".join(map(str, choices))


def parse_args(argv=None):
    # the comma-list options' defaults are strings, as the user types them (--help shows "2,4,8", not
    # "[2, 4, 8]"): argparse runs a string default through type=, so args holds the parsed list either way
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                                formatter_class=DefaultsHelp)
    p.add_argument("--pattern", type=_list(str, PATTERNS), default=_names(PATTERNS),
                   help=f"comma list of {', '.join(PATTERNS)} (rs-rows: the reduce-scatter's producer; ag: the "
                        f"all-gather's consumer)")
    p.add_argument("--quant", type=_list(str, Q.QUANTS), default=_names(Q.QUANTS),
                   help=f"comma list of {', '.join(Q.QUANTS)}")
    p.add_argument("--model", type=_list(str, MODELS), default=_names(MODELS),
                   help="comma list of " + ", ".join(f"{name} (hidden {hidden}, intermediate {inter})"
                                                     for name, (hidden, inter) in MODELS.items()))
    p.add_argument("--tp", type=_list(int, None), default="2,4,8",
                   help="comma list of tensor-parallel degrees = owners W, each >= 2")
    p.add_argument("-m", type=_list(int, None), default="4096,8192,16384",
                   help="comma list of tokens of the sequence, each a multiple of every --tp")
    p.add_argument("--passes", type=int, default=5, help="timing passes (>= 3), the arms alternating in each")
    p.add_argument("--iters", type=int, default=10, help="timed calls per arm and pass (>= 1)")
    p.add_argument("--rotate", type=int, default=2, help="input sets the calls cycle through (>= 1)")
    p.add_argument("--flags-landed", action="store_true",
                   help="ag: set every peer's flags of a call before it and run its waits on them (the call's "
                        "waits once every peer's rows have landed), instead of dropping the waits")
    p.add_argument("--producer-streams", type=_list(int, range(1, MAX_PRODUCER_STREAMS + 1)), default=[],
                   help=f"rs-rows: comma list of stream counts in 1..{MAX_PRODUCER_STREAMS}; the vendor producer "
                        f"also dealt to each of these many streams (extra arms; the call's own: "
                        f"cco.cuda.dma.PRODUCER_STREAMS)")
    p.add_argument("--json", help="write every record here")
    p.add_argument("--plot", help="write the ratios over M to this PNG")
    p.add_argument("--from", dest="from_json", help="plot these --json files (comma list) instead of measuring")
    p.add_argument("--compare", help="BEFORE.json,AFTER.json: with --plot, draw each cell's ratio in both runs side "
                                     "by side instead of measuring")
    args = p.parse_args(argv)
    if args.from_json and not args.plot:
        p.error(f"--from {args.from_json} draws --plot from those files; pass --plot PNG (nothing to do without it)")
    if args.from_json and args.compare:
        p.error("--from and --compare each draw --plot from files of earlier runs: pass one of them")
    if args.compare and (len(args.compare.split(",")) != 2 or not args.plot):
        p.error("--compare takes two --json files, BEFORE,AFTER, and needs --plot")
    if any(w < 2 for w in args.tp):
        p.error(f"--tp {args.tp}: a collective needs at least 2 owners")
    uneven = [(m, w) for m in args.m for w in args.tp if m % w or m < w]
    if uneven:
        p.error(f"-m/--tp: every M must be a positive multiple of every TP (the tokens split evenly); not {uneven}")
    if args.passes < 3 or args.iters < 1 or args.rotate < 1:
        p.error("--passes >= 3 (a spread needs them), --iters >= 1 and --rotate >= 1")
    from cco.bench.timing import check_output_dirs

    check_output_dirs(p, args, ("json", "plot"))
    return args


def sp_config(pattern: str, quant: str, n: int, k: int, m_max: int, world: int) -> layout.OpConfig:
    """The config the op builds for the CUDA backend (``cco.op``: its tile and default chunks)."""
    from cco.backends.cuda import CudaBackend

    block_m, block_n = CudaBackend.tile(quant)
    return layout.build_config(n=n, k=k, m_max=m_max, world=world, quant=quant, chunks=CudaBackend.default_chunks,
                               block_m=block_m, block_n=block_n, default_transport=CudaBackend.default_transport,
                               weight_layout="row-major", pattern=PATTERNS[pattern])


def sp_backend(cfg: layout.OpConfig, dev):
    """A CUDA backend as rank 0 of ``cfg.world`` over a local window (nothing is sent)."""
    from cco.backends.cuda import CudaBackend
    from scripts.bench_gemm import local_window

    class Unwatched(CudaBackend):
        watched = False  # no call here waits on a peer: nothing for a watchdog to release

    return Unwatched(config=cfg, comm=None, window=local_window(cfg, dev), deadline_s=60.0)


class LandedPeers:
    """The stream memory operations of a rank whose peers are absent and whose peers' flags the
    benchmark set before the call (``--flags-landed``: as if every peer's rows had landed by then):
    copies to peers are dropped, the waits and the own words' writes run, so the call's stream pays
    for its waits."""

    def __init__(self, memops):
        self.memops = memops

    def __getattr__(self, name):
        return getattr(self.memops, name)

    def _dropped(self, *args, **kwargs):
        return None

    copy = copy_2d = _dropped


class NoPeers(LandedPeers):
    """The stream memory operations of a rank whose peers are absent: waits on words only a peer
    would set and copies to peers are dropped, the rest (own words' writes) runs."""

    wait_geq = wait_geq_kernel = wait_block_kernel = LandedPeers._dropped


def rows_of(p: Q.Problem, r0: int, r1: int) -> Q.Problem:
    """Rows [r0, r1) of ``p`` as a caller holding only them passes them (blockscale's A scale
    M-major over its own rows, as ``cco.quant.quantize_a`` makes it)."""
    scale = p.a_scale[r0:r1]
    if p.quant == "blockscale":
        scale = scale.t().contiguous().t()
    return Q.Problem(p.quant, p.a[r0:r1], p.b, scale, p.b_scale)


def device_problems(m: int, n: int, k: int, quant: str, sets: int, dev) -> list[Q.Problem]:
    """``sets`` problems of one weight, generated on ``dev`` (``cco.quant.random_problem`` draws on
    the host: seconds per operand at these shapes, minutes over the sweep); rows and K columns of
    spread magnitudes, so a wrong row or scale shows."""
    g = torch.Generator(device=dev).manual_seed(0)

    def spread(shape):
        return torch.exp2(torch.randint(-3, 4, shape, generator=g, device=dev).float())

    b, b_scale = Q.quantize_b(torch.randn(n, k, generator=g, device=dev) * spread((1, k)), quant)
    out = []
    for _ in range(sets):
        a, a_scale = Q.quantize_a(torch.randn(m, k, generator=g, device=dev) * spread((m, 1)), quant)
        out.append(Q.Problem(quant, a, b, a_scale, b_scale))
    return out


def check_rows(m: int, block: int = 64) -> torch.Tensor:
    """Rows the checks compare: the first and last of every ``block`` rows (every chunk's and
    slice's edges; a full fp32 reference costs more than the timing at these shapes)."""
    starts = torch.arange(0, m, block)
    return torch.cat([starts, (starts + block).clamp(max=m) - 1]).unique()


def _pick(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``t`` (one-byte dtypes through their bytes: fp8 and e8m0 indexing is not a
    given on every torch)."""
    if t.element_size() == 1:
        return t.view(torch.uint8)[idx].view(t.dtype)
    return t[idx]


def sampled_terms(p: Q.Problem, idx: torch.Tensor):
    """``cco.bench.timing.budget_terms`` of rows ``idx`` of ``p``."""
    from cco.bench.timing import budget_terms

    idx = idx.to(p.a.device)
    return budget_terms(Q.Problem(p.quant, _pick(p.a, idx), p.b, _pick(p.a_scale, idx), p.b_scale))


def sp_arms(pattern: str, backend, sets: list[Q.Problem], m: int, dev, landed: bool = False,
            streams=()) -> dict:
    """name -> (call(i), read(output of call, rows idx) -> (those rows of the [M, N] product, wrong
    counters)): the pattern's arm through ``backend`` and ``whole``; ``sets`` share one weight and
    have ``m`` rows, the tokens of the whole sequence. ``streams``: rs-rows' vendor producer also
    dealt to each of these many producer streams (``CopyEngineSchedule.producer_streams``)."""
    from kernels_fused.hopper import vendor

    cfg, world, rank = backend.config, backend.world, backend.rank
    weight = backend._vendor(sets[0].b, sets[0].b_scale)  # kept by the backend, as its calls take it
    fast = not backend.fused_config.precise_acc  # the accumulation the backend's row GEMMs ask for
    whole = torch.empty(m, cfg.n, dtype=torch.bfloat16, device=dev)
    if vendor.takes_rows(cfg.quant, m, cfg.k):
        def whole_gemm(i):
            return vendor.vendor_gemm(sets[i].a, sets[i].a_scale, weight, out=whole, fast_accum=fast)
    else:  # a K cuBLAS is not trusted with (vendor.takes_rows): the GEMM the library runs there
        from kernels_fused.hopper import gemm as hopper_gemm

        def whole_gemm(i):
            p = sets[i]
            return hopper_gemm.fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=cfg.quant, out=whole)
    arms = {"whole": (whole_gemm, lambda out, idx: (out[idx], 0))}
    base = layout.zero_counters(world)
    if pattern == "rs-rows":
        plan = layout.plan_call(cfg, m=m, seq=1, rank=rank, counter_base=base)

        sch, dealt = backend.schedule, backend.schedule.producer_streams

        def producing(producer, least=None, on=None, launch=None):
            def rs(i):
                p, backend.producer, backend.producer_rows = sets[i], producer, least
                sch.producer_streams, backend.rows_kernel_launch = (dealt if on is None else on), launch
                try:
                    return backend._produce(p.a, p.b, p.a_scale, p.b_scale, plan)
                finally:
                    backend.producer = backend.producer_rows = backend.rows_kernel_launch = None
                    sch.producer_streams = dealt
            return rs

        def rs_read(planes, idx):
            counted = backend.counters.view(world, layout.MAX_CHUNKS).tolist()
            wrong = sum(counted[d][c] != plan.target(d, c) for d in range(world) for c in range(plan.chunks))
            return planes[idx // plan.slice_m, idx % plan.slice_m], wrong

        # the rule's pick (RS_ROWS_PRODUCER), and each producer forced: the rule's data; the vendor
        # producer at RS_PRODUCER_ROWS's groups of a slice's chunks, and with a GEMM per chunk
        arms[pattern] = (producing(None), rs_read)
        for producer in PRODUCERS:
            arms[f"{pattern} {producer}"] = (producing(producer), rs_read)
        for launch in ROWS_KERNEL_LAUNCHES:  # the kernel producer's launches (RS_ROWS_KERNEL_LAUNCH, WALKS)
            arms[f"{pattern} kernel-{launch}"] = (producing("kernel", launch=launch), rs_read)
        arms[f"{pattern} vendor chunks"] = (producing("vendor", 1), rs_read)
        for on in streams:
            arms[f"{pattern} vendor streams{on}"] = (producing("vendor", on=on), rs_read)
        return arms
    rows = m // world
    plan = layout.plan_call(cfg, m=rows, seq=1, rank=rank, counter_base=base)
    sch = backend.schedule
    peers = LandedPeers if landed else NoPeers
    if type(sch.memops) is not peers:
        sch.memops = peers(getattr(sch.memops, "memops", sch.memops))
    flags = [sch.scatter_flags.view(world, -1)[:, :plan.chunks], sch.gather_flags.view(world, -1)[:, :1]]
    for src in range(world):  # the peers' rows and stamps, where their puts would have left them
        if src != rank:
            slot_rows, slot_scales = backend._slots(src)
            slot_rows[:rows].copy_(sets[0].a[src * rows:(src + 1) * rows])
            into = backend._scale_rows(slot_scales, 0, rows)
            into.copy_(sets[0].a_scale[src * rows:(src + 1) * rows].reshape(into.shape))
            sch.scatter_m[src] = sch.stamp_of(plan)
    own = [rows_of(p, rank * rows, (rank + 1) * rows) for p in sets]
    out = torch.empty(m, cfg.n, dtype=torch.bfloat16, device=dev)

    def consuming(knobs):
        def ag(i):
            p = own[i]
            for knob, value in knobs.items():
                setattr(backend, knob, value)
            if landed:  # every peer's flags of the call set, as their puts would leave them
                for f in flags:
                    f.fill_(1)
            try:
                backend.all_gather_gemm(p.a, p.b, p.a_scale, p.b_scale, out=out, plan=plan)
            finally:
                backend.consumer_rows = backend.consumer_merge = None
            return out
        return ag

    # the rule (AG_CONSUMER_ROWS's groups, merged where each peer is one), and its choices forced
    for name, knobs in CONSUMERS.items():
        arms[f"{pattern} {name}".strip()] = (consuming(knobs), lambda got, idx: (got[idx], 0))
    return arms


# the all-gather's arms: the consumer's knobs (CudaBackend.consumer_rows, .consumer_merge): the rule's,
# a GEMM per chunk, a GEMM per source (all its chunks: more rows than any call has), and the peers'
# GEMMs merged into one after the last wait; the first two forced unmerged (the rule would merge
# a source of one chunk)
CONSUMERS = {"": {}, "chunks": {"consumer_rows": 1, "consumer_merge": False},
             "sources": {"consumer_rows": 1 << 40, "consumer_merge": False}, "merged": {"consumer_merge": True}}


def gemm_count(pattern: str, world: int, chunks, producer: str = "vendor", quant: str = "ptpc",
               padded: bool = False) -> int:
    """GEMM launches one call of the pattern's arm issues (``cco.backends.cuda``): the reduce-scatter's
    vendor producer one per group of an owner's chunks (``RS_PRODUCER_ROWS``), its kernel producer
    one; the all-gather's consumer one for the own rows and one per group of each peer's chunks
    (``consumer_groups`` of ``chunks``,
    the call's ``CallPlan.rows``, at ``AG_CONSUMER_ROWS``), or where each peer's rows are one group
    and the call fills the slots (``padded``: its rows are ``m_max_padded``) one for the peers' slots
    (rank 0: one block after the own slot)."""
    if pattern == "rs-rows":
        return world * len(consumer_groups(chunks, RS_PRODUCER_ROWS[quant])) if producer == "vendor" else 1
    groups = len(consumer_groups(chunks, AG_CONSUMER_ROWS[quant]))
    return 2 if padded and groups == 1 else 1 + (world - 1) * groups


def run_shape(args, backend, pattern, sets, m, dev, label) -> dict:
    """One (pattern, quant, shape, M, W): the arms checked, timed and printed; the record."""
    from cco.bench.timing import gemm_mismatches, graphed, per_pass_ratio, time_arms

    arms = sp_arms(pattern, backend, sets, m, dev, landed=args.flags_landed, streams=args.producer_streams)
    idx = check_rows(m).to(dev)
    ref, dot_abs = sampled_terms(sets[0], idx)
    bad = {}
    for name, (call, read) in arms.items():
        got, wrong = read(call(0), idx)
        bad[name] = gemm_mismatches(got, ref, dot_abs) + wrong
    del ref, dot_abs
    record = {"pattern": pattern, **label, "m": m, "bad": bad}
    if any(bad.values()):
        print(f"{pattern} {label['quant']} {label['shape']} M={m}: wrong elements or counters {bad}; not timed",
              flush=True)
        return {**record, "error": "check failed"}
    timed, eager = graphed({name: call for name, (call, _) in arms.items()}, args.rotate)
    t = time_arms(timed, passes=args.passes, iters=args.iters, rotate=args.rotate, flush_l2=True)
    del timed
    arm, base = t[pattern], t["whole"]
    med, lo, hi = per_pass_ratio(arm.pass_us, base.pass_us)
    others = {name: per_pass_ratio(t[name].pass_us, base.pass_us) for name in t if name not in ("whole", pattern)}
    print(f"{pattern:8s} {label['quant']:10s} {label['shape']:36s} M={m:<6d} W={label['world']} "
          f"({record['gemms']} GEMMs): {arm.median_us:9.1f} us "
          f"(whole {base.median_us:9.1f}) | {med:.3f}x | {lo:.3f}-{hi:.3f}"
          + "".join(f" | {name.split()[-1]} {r[0]:.3f}x" for name, r in others.items())
          + (f"  eager: {eager}" if eager else ""), flush=True)
    return {**record, "eager": eager, "ratio": {"median": med, "min": lo, "max": hi},
            "ratios": {name: {"median": r[0], "min": r[1], "max": r[2]} for name, r in others.items()},
            "arms": {name: a.as_dict() for name, a in t.items()}}


def _failed(pattern: str, label: dict, err: Exception) -> dict:
    print(f"{pattern} {label['quant']} {label['shape']} M={label['m']}: {type(err).__name__}: "
          f"{str(err).splitlines()[0] if str(err) else ''}; not timed", flush=True)
    return {"pattern": pattern, **label, "error": f"{type(err).__name__}: {err}"}


def measure(args, dev) -> list[dict]:
    """Every (pattern, quant, model, TP, M) of ``args``: one backend and one set of operands per
    (pattern, quant, model, TP), every M a row prefix of them, but per M for the all-gather (its
    window of M rows: each call fills the slots, as the consumer's merge needs); the records."""
    runs = []
    todo = [(pat, q, model, tp, ms) for pat in args.pattern for q in args.quant for model in args.model
            for tp in args.tp for ms in ([[m] for m in args.m] if pat == "ag" else [args.m])]
    done, total = 0, sum(len(ms) for *_, ms in todo)
    print("One GPU, W owners as rank 0 of W: no puts, no waits on peers (no link to time). rs-rows: the "
          "producer until every slice is released; ag: the consumer's GEMMs, own rows beside the peers'; "
          "whole: one vendor GEMM of every row.\n"
          "pattern  quant      shape (per-rank GEMM)                  M        W (GEMMs issued): arm us (whole us) | "
          "arm/whole, lower is better | range over passes", flush=True)
    for pattern, quant, model, tp, ms in todo:
        n, k, layer = layer_shape(pattern, model, tp)
        label = {"quant": quant, "model": model, "layer": layer, "tp": tp, "world": tp, "n": n, "k": k,
                 "shape": f"{model} {layer} TP{tp} N={n} K={k}"}
        backend = full = None
        try:
            cfg = sp_config(pattern, quant, n, k, max(ms), tp)
            backend = sp_backend(cfg, dev)
            full = device_problems(max(ms), n, k, quant, args.rotate, dev)
        except (RuntimeError, ValueError) as err:  # (torch.cuda.OutOfMemoryError is a RuntimeError)
            runs += [_failed(pattern, {**label, "m": m}, err) for m in ms]
            done += len(ms)
        for m in ms if full is not None else ():
            done += 1
            print(f"[{done}/{total}] {pattern} {quant} {label['shape']} M={m}", file=sys.stderr, flush=True)
            chunks = layout.chunk_rows(cfg, m if pattern == "rs-rows" else m // tp)
            producer = rows_producer(cfg, m) if pattern == "rs-rows" else "vendor"
            padded = pattern == "ag" and m // tp == cfg.m_max_padded
            shape = {**label, "chunks": len(chunks), "gemms": gemm_count(pattern, tp, chunks, producer, quant, padded)}
            if pattern == "rs-rows":
                shape["producer"] = producer
            try:  # a failure (cuBLAS refusing a call, memory) ends this shape only
                runs.append(run_shape(args, backend, pattern, [rows_of(p, 0, m) for p in full], m, dev, shape))
            except (RuntimeError, ValueError) as err:
                runs.append(_failed(pattern, {**shape, "m": m}, err))
        if backend is not None:
            backend.close()
        backend = full = None
        gc.collect()  # the window and the graphs of a (pattern, quant, model, TP) may sit in reference cycles:
        torch.cuda.empty_cache()  # freed now, not after the sweep has stacked up several GiB of them
    return runs


def plot(runs: list[dict], path: str) -> None:
    """One panel per pattern: each (quant, model, W)'s ratio to the whole GEMM over M, error bars
    the range over passes; the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if "ratio" in r]
    patterns = [p for p in PATTERNS if any(r["pattern"] == p for r in runs)]
    fig, axes = plt.subplots(1, max(1, len(patterns)), figsize=(8 * max(1, len(patterns)), 6), squeeze=False)
    colors = dict(zip(Q.QUANTS, ("tab:blue", "tab:orange", "tab:green")))
    styles = dict(zip(MODELS, ("-", "--")))
    markers = {2: "o", 4: "s", 8: "^"}
    for ax, pattern in zip(axes[0], patterns):
        keys = sorted({(r["quant"], r["model"], r["world"]) for r in runs if r["pattern"] == pattern},
                      key=lambda key: (Q.QUANTS.index(key[0]), key[1], key[2]))
        for j, (quant, model, world) in enumerate(keys):
            mine = sorted((r for r in runs if (r["pattern"], r["quant"], r["model"], r["world"]) ==
                           (pattern, quant, model, world)), key=lambda r: r["m"])
            shift = 1 + 0.012 * (j - len(keys) / 2)  # side by side, so the error bars stay readable
            y = [r["ratio"]["median"] for r in mine]
            err = [[v - r["ratio"]["min"] for v, r in zip(y, mine)], [r["ratio"]["max"] - v for v, r in zip(y, mine)]]
            ax.errorbar([r["m"] * shift for r in mine], y, yerr=err, capsize=2, color=colors.get(quant),
                        linestyle=styles.get(model, ":"), marker=markers.get(world, "x"),
                        label=f"{quant} {model} W={world}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(TARGET, color="red", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens of the sequence)")
        ax.set_ylabel("time / whole vendor GEMM (lower is better)")
        ax.set_title("reduce-scatter rows: producer until every slice is released" if pattern == "rs-rows" else
                     "all-gather: the consumer's GEMMs (own rows beside the peers')", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_compare(before: list[dict], after: list[dict], path: str, labels=("before", "after")) -> None:
    """Each cell (pattern, quant, shape, M) of both runs: its ratio to the whole GEMM in ``before``
    and ``after`` side by side (error bars the range over passes), one panel per M, the target
    dashed: 36 pairs read as a picture, not a table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cells(runs):
        return {(r["pattern"], r["quant"], r["shape"], r["m"]): r["ratio"] for r in runs if "ratio" in r}

    old, new = cells(before), cells(after)
    keys = [k for k in old if k in new]
    ms = sorted({k[3] for k in keys})
    fig, axes = plt.subplots(len(ms), 1, figsize=(14, 4.5 * len(ms)), squeeze=False)
    for ax, m in zip(axes[:, 0], ms):
        mine = [k for k in keys if k[3] == m]
        for shift, runs, label, color in ((-0.18, old, labels[0], "tab:gray"), (0.18, new, labels[1], "tab:blue")):
            y = [runs[k]["median"] for k in mine]
            err = [[v - runs[k]["min"] for v, k in zip(y, mine)], [runs[k]["max"] - v for v, k in zip(y, mine)]]
            ax.errorbar([i + shift for i in range(len(mine))], y, yerr=err, fmt="o", capsize=2, color=color,
                        label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(TARGET, color="red", linewidth=0.8, linestyle="--", label=f"target {TARGET}")
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([f"{q}\n{shape.split()[0]}\n{shape.split()[2]}" for _, q, shape, _ in mine], fontsize=7)
        ax.set_ylabel("time / whole vendor GEMM (lower is better)")
        ax.set_title(f"M = {m} tokens", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def failures(runs: list[dict]) -> list[str]:
    """The records of ``runs`` that posted no time (a failed check, or a shape that raised): one line each."""
    return [f"{r['pattern']} {r['quant']} {r['shape']} M={r['m']}: {r['error']}" for r in runs if "error" in r]


FROM = {"who": "bench_sp_parts", "keys": ("pattern", "quant")}  # runs_from_json: what every record of this script has


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        from scripts.bench_gemm import runs_from_json

        before, after = args.compare.split(",")
        plot_compare(runs_from_json(before, **FROM), runs_from_json(after, **FROM), args.plot)
        print(f"bench_sp_parts: wrote {args.plot} ({before} against {after})", flush=True)
        return 0
    if args.from_json:
        from scripts.bench_gemm import runs_from_json

        runs = runs_from_json(args.from_json, **FROM)
        if not any("ratio" in r for r in runs):
            raise SystemExit(f"bench_sp_parts: --from {args.from_json}: no timed record (every one has an error) "
                             f"to draw")
        plot(runs, args.plot)
        print(f"bench_sp_parts: wrote {args.plot} (from {args.from_json})", flush=True)
        return 0
    from cco.bench.timing import idle_check, require_cuda

    require_cuda("bench_sp_parts")
    import triton

    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    idle_before = idle_check()
    started = time.time()
    runs = measure(args, dev)
    idle_after = idle_check()
    print(f"idle before: {idle_before}; after: {idle_after}; {time.time() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "hardware": {"gpu": props.name, "sms": props.multi_processor_count,
                                    "memory_gib": round(props.total_memory / 2**30, 1)},
                       "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                       "command": "python3 -m scripts.bench_sp_parts " + " ".join(sys.argv[1:] if argv is None
                                                                                 else argv),
                       "idle_before": idle_before, "idle_after": idle_after, "runs": runs}, f, indent=1)
    if args.plot:
        plot(runs, args.plot)
        print(f"bench_sp_parts: wrote {args.plot}", flush=True)
    failed = failures(runs)
    if failed:  # after the JSON and the plot: what was measured is kept, the run still fails
        print(f"bench_sp_parts: FAILED, {len(failed)} not timed: " + "; ".join(failed), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
