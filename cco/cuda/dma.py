"""The ``dma`` transport on CUDA: copy-engine puts triggered by the GEMM's counters, and the reduce,
gather and assemble phases on side streams, so every phase of chunk c overlaps the GEMM's work on
later chunks.

One call on rank r (W ranks, C chunks; ``p`` ranges over peers, ``c`` over chunks)::

    main      : counters = 0 (the backend) | stamp=(seq, m) | GEMM (a layout tile
                order; counters[d, c] += 1 per layout tile) | join
                or, a producer of whole chunks (the vendor GEMM per chunk): for c: GEMM rows c
                (every column) ; counters[d, c] = T_c for every d (stream write-values) | join
                (``PRODUCER_STREAMS`` S > 1: chunk c and its releases on stream c % S, the
                others forked from and joined into this one)
    put[p][l] : copies in the order S0 S1 G0 S2 G1 ... G(C-1), or S0 .. S(C-1) G0 .. G(C-1) behind a
                GEMM that computes every peer's tiles first (see submission_order), dealt in turn to
                the peer's ``lanes`` streams l (one by default), where
                S c = wait counters[p,c] >= T_c ; (a lane's first S: copy stamp -> peer.scatter_m[r])
                      copy partial[p][rows c] -> peer.recv[r][rows c] ; set peer.scatter_flags[r,c]
                      (a 2-D copy of a pitched block where the producer wrote whole rows)
                G c = wait red[c] ; copy gather[r][rows c] (+ scales) -> peer.gather[r][rows c]
                      set peer.gather_flags[r,c]
    reduce    : wait counters[r,c] >= T_c ; wait scatter_flags[src,c] >= 1 (each src, then = 0)
                reduce kernel: partial[r] + recv[src...] -> gather[r][rows c] and out[rows c, own cols]
                event red[c]
                (``reduced_in_gemm``: the GEMM's own tiles waited for the flags and reduced themselves;
                here only wait counters[r,c] >= T_c ; scatter_flags[src,c] = 0 ; event red[c])
    assemble  : wait gather_flags[o,c] >= 1 (each owner o != r, then = 0)
                bf16: pitched copy gather[o][rows c] -> out[rows c, o cols] (the driver runs it as an SM
                kernel; a Triton copy kernel measured the same); fp8: dequant kernel

Waits are stream memory operations (``cuStreamWaitValue64``), writes are ``cuStreamWriteValue64``
(ordered after the stream's earlier copies), copies are ``cuMemcpyAsync`` on the copy engines, a
consumed flag's reset is a memset (``cuMemsetD8Async``: half a write-value's device time). No
SM spins beside the GEMM, so nothing here can starve it of multiprocessors (the one-warp spin
kernels of ``memops`` stand in only where a driver cannot capture stream memory operations into a
graph). The one spin by design is the all-gather's block wait (``_wait_block``) on the call's own
stream, before the peers' GEMMs (and before its end's wait for every peer): its puts need no
multiprocessor, and the one GEMM that may run beside it, the own rows', is awaited by no peer (the
puts carry input rows, not its output), so an SM the spin holds can only delay it. A spin beside a
GEMM whose tiles a peer waits for (the all-reduce's, the reduce-scatter's) could take the
multiprocessor that GEMM's last block needs while the peer waits for those tiles before it sets
what the spin waits for: those patterns keep stream waits.
"Set" a peer's flag is a write of ``FLAG_SET`` into its memory or (``flag_by_copy``) an 8-byte
copy of a local word holding it, queued on the copy engine behind the data (``FLAG_BY_COPY``).

Lanes (``PUT_LANES``, 1 by default until measured on two GPUs): each step of a stream (its wait,
the copy engine's start, the flag) leaves the link idle for ~15 us between one copy and the next;
with two streams per peer taking the steps in turn, one lane's copy fills the other's gap. With
more peers their streams fill each other's gaps, so a peer gets ``ceil(PUT_LANES / peers)`` lanes
(at 2: two with one peer, one from two peers on). Every flag still follows its own data on its
lane, and each lane copies the stamp before its first flag, so a peer that sees any flag of the
call also sees the call's stamp.

Graph safety: a wait's value is baked into a captured graph, so a monotonic word would satisfy a
replayed wait at once. Each word therefore has exactly one waiter and is back at zero before the
next call can write it: the counters are zeroed on the main stream at each call's start, before the
GEMM and every side stream; a scatter or gather flag is zeroed by its waiter (the owner of the
window) after its wait, on the waiting stream, by a memset (``_consume``; the all-gather's main
stream zeroes every source's flags of the call with one memset after the call's last wait, and
every end of a call its peers' finish words with one: ``_consume_rows``; with
``reduced_in_gemm``, the scatter flags every own tile of a chunk reads are zeroed by the reduce
stream once the chunk's counter shows every reader done). Every
rewrite of a flag happens-after its reset: a rank starts call s+1 only after its own call s joined,
and a peer's call-(s+1) write needs that rank's call-(s+1) data. So a set flag is 1 (``FLAG_SET``),
not the call's seq, and the only per-call value, the (seq, M) stamp a peer's reduce checks, travels
through a device word (``stamp``, written at the call's start): the side work of a call is the same
for every call with the same M and ``out``.

Replayed side work (``replay=True``, the CUDA backend): an eager call spends most of its host time
issuing the side streams' ~50 waits, writes, copies and kernel launches (757 us per call at
M=2048 on an H200 host, docs/experiments.md). So the schedule captures that work into a CUDA graph
the second time it sees a (M, ``out`` address) and from then on replays it on a launch stream gated
like the side streams (``GraphCache``); the GEMM stays an ordinary launch. While the caller itself
captures a graph, the work is enqueued as usual (and lands in the caller's graph).

Patterns (``cco.layout.PATTERNS``): one schedule object, the pattern decides which steps carry
work. The reduce-scatter runs the all-reduce's steps without the gather's data: its reduce writes
the own slice into ``out`` (column 0; nothing into ``gather``), its last G step puts only a flag
(``gather_flags[r, 0]``, "this rank finished the call") and its last assemble step only waits for
every peer's (module ``cco.backends.base``, v1.7: a rank whose own share was complete must not
return while a peer fails the same call). Along rows (``scatter_dim=0``) a slice is M/W rows of
every column, produced by one GEMM per group of a dest's chunks (:meth:`CopyEngineSchedule.produce`). The
all-gather (:meth:`CopyEngineSchedule.gather_inputs`) moves inputs instead::

    main      : stamp | own rows -> a_rows[r] (+ scales) | event inputs_ready
                | for c, for src: wait scatter_flags[src,c] >= 1 ; GEMM rows c of src
                  (or one spin launch waiting for every flag, then the GEMMs: _wait_block)
                | scatter_flags[src, 0..C-1] = 0 (every src: one memset over their rows)
                | set peer.gather_flags[r,0] (each peer) ; wait gather_flags[p,0] >= 1 (each, then = 0)
                | join the put streams and the own GEMM's | stamp check (NaN out, status, on another
                  (seq, M))
    own       : wait inputs_ready ; GEMM own rows (``produce_sides[0]``)
    put[p][l] : wait inputs_ready ; for c: (first: copy stamp -> peer.scatter_m[r]) ; copy rows c
                (+ scales) -> peer.a_rows[r] ; set peer.scatter_flags[r,c]

Its waits sit on the call's stream (the GEMM of a chunk needs them there anyway); every put is
submitted before the first of them (``submission_order``'s rule). The own rows' GEMM runs on a
stream of its own, beside the waits and the peers' GEMMs rather than before them: it overlaps the
puts either way, and where the peers' rows land before it ends (a fast link; every peer's at once,
one GPU timing the consumer) the peers' GEMM fills the multiprocessors its last partial wave leaves
idle instead of waiting for it (DeepSeek-V3 at W = 8, 4096 tokens: 512 own rows, 72 tiles of 132
SMs; docs/BENCHMARKS.md).

Deadlines (``marks``, ``cco.cuda.watchdog``): the assemble stream writes the call's "in call" mark
before any wait of the call and, once the reduce stream's last chunk is done and its own waits
are, the "left" marks; a watchdog thread releases a call that stays in for ``deadline_s``.
``check()`` reports a peer M mismatch found by the reduce kernel.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from cco import layout
from cco.cuda import kernels
from cco.cuda import memops as cuda_memops
from cco.cuda.kernels import STATUS_WORDS
from cco.transport.base import stamp_of_plan, stamp_rejected

_WORD = 8  # bytes of one int64 counter or flag
STREAMS_KEPT = 64  # current_stream's Stream objects kept, by (stream id, device, type)
FLAG_SET = 1  # a set scatter or gather flag (its one waiter zeroes it)
GRAPH_CACHE = 8  # captured side-work graphs kept per op (least recently used dropped)
# beyond the first GRAPH_CACHE captures, one more capture per this many replays: a working set of
# keys larger than the cache would otherwise evict and recapture graphs call after call
REPLAYS_PER_CAPTURE = 8
# CUDA: a peer's flag set by an 8-byte copy from a local word holding FLAG_SET, queued on the copy
# engine behind the data it announces, instead of a stream write-value into peer memory: 820.2 vs
# 835.7 us at 16384x7168 on 2 H200 (docs/experiments.md)
FLAG_BY_COPY = True
# put streams per rank that take the put steps in turn, at least one per peer (module note, "Lanes";
# docs/experiments.md). 1 until two GPUs measure 2 (one GPU did: steps-2-lanes of scripts/bench_link)
PUT_LANES = 1
LANES_MADE = 2  # put streams per rank a schedule makes (a call may use fewer: the benchmark's arms)
# Programs of the reduce and assemble kernels beside the fused GEMM. None: one program per row (and
# the bf16 assemble on the driver's pitched copy). Fewer programs, striding the rows, leave the
# GEMM more multiprocessors but put a slower reduce on the critical path: 32 measured 1103 us
# against 833 us at 16384x7168 (docs/experiments.md).
SIDE_PROGRAMS: int | None = None
# Streams the producer of whole chunks (the vendor GEMM per chunk) deals its chunk GEMMs to in turn,
# each followed on its stream by the chunk's counter releases: with 2, chunk c + 1's GEMM fills the
# multiprocessors chunk c's last wave leaves idle instead of starting after it (module note). 2
# measured 1.04-1.11x of the whole vendor GEMM at [8192..32768, 7168] K=2048 where 1 stream took
# 1.03-1.27x (docs/hopper_gemm.md)
PRODUCER_STREAMS = 2
MAX_PRODUCER_STREAMS = 4  # streams a schedule makes for it (a call may use fewer: the benchmark's arms)


def put_lanes(world: int, lanes: int | None = None) -> int:
    """Put streams per peer: ``lanes`` (default ``PUT_LANES``) streams in all, at least one per peer."""
    return -(-(PUT_LANES if lanes is None else lanes) // max(1, world - 1))


def current_stream() -> torch.cuda.Stream:
    """``torch.cuda.current_stream()`` for the current device, its Stream object kept per (stream id,
    device, type): building one per call (device guard, lazy-init check) cost an eager decode-sized
    call ~7 us of host time (docs/decode.md, "World 2 and more"). A Stream object holds only those
    three values, so a kept one is the same stream."""
    data = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
    stream = _STREAMS.get(data)
    if stream is None:
        if len(_STREAMS) >= STREAMS_KEPT:  # user streams come and go: never grown without bound
            _STREAMS.clear()
        stream = _STREAMS[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
    return stream


_STREAMS: dict = {}


class GraphCache:
    """Which calls replay captured side work: a key (M, ``out`` address and row stride, put order) is
    captured the second time it is seen (a one-off address never pays a capture), the ``size`` most
    recently used graphs are kept, and past ``size`` captures a capture needs ``replays_per_capture``
    replays since the last one (a working set larger than the cache then runs mostly eager instead
    of recapturing what it just evicted)."""

    def __init__(self, size: int = GRAPH_CACHE, replays_per_capture: int = REPLAYS_PER_CAPTURE):
        self.size = size
        self.replays_per_capture = replays_per_capture
        self.graphs: OrderedDict = OrderedDict()
        self.seen: OrderedDict = OrderedDict()
        self.captures = self.replays = 0
        self._credit = 0  # replays since the last capture

    def lookup(self, key):
        """(graph or None, whether to capture one now)."""
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            self.replays += 1
            self._credit += 1
            return graph, False
        if key in self.seen and (self.captures < self.size or self._credit >= self.replays_per_capture):
            del self.seen[key]
            self.captures += 1
            self._credit = 0
            return None, True
        self.seen[key] = None
        self.seen.move_to_end(key)
        while len(self.seen) > 4 * self.size:
            self.seen.popitem(last=False)
        return None, False

    def store(self, key, graph) -> None:
        self.graphs[key] = graph
        while len(self.graphs) > self.size:
            self.graphs.popitem(last=False)


def submission_order(chunks: int, *, scatters_first: bool = False) -> list[tuple[str, int]]:
    """Host submission order of one call's side-stream work: ``(phase, chunk)`` steps.

    Each peer's put stream carries its copies in the order ``S0, S1, G0, S2, G1, ..., G(C-1)``
    (S: scatter, G: gather): the copies use the link one at a time, a scatter is never slowed by a
    gather beside it (the chunk it carries gates a reduce on the peer), and each gather is queued
    behind one scatter, by when its reduce has usually run. Separate scatter and gather streams
    measured 890 us against 857 us at 16384x7168 on 2 H200 (docs/experiments.md).

    The order of submission matters beyond each stream's order: streams are multiplexed onto a few
    hardware queues, and a blocked wait holds every later submission of its queue. So nothing is
    submitted after a wait that (through a peer) depends on it: each scatter goes before the reduce
    that waits for the peer's scatter of the same chunk, and the assemble waits, which need the
    peers' gathers, go last. Submitting every reduce first hung on the H200s (both ranks' reduces
    waited for scatters queued behind them); ``tests/python/cco/test_cuda_op.py`` replays both
    orders on in-order queues.

    ``scatters_first``: for a GEMM that computes every peer's tiles before its own (the CUDA fused
    launch, ``cco.backends.cuda.DMA_PEERS_FIRST``), the put streams carry ``S0 .. S(C-1)`` and then
    the gathers, which could not start earlier anyway: no gather waits in front of a scatter.
    """
    if scatters_first:
        steps = [("scatter", c) for c in range(chunks)]
        steps += [step for c in range(chunks) for step in (("reduce", c), ("gather", c))]
        return steps + [("assemble", c) for c in range(chunks)]
    steps = [("scatter", 0)]
    for c in range(1, chunks):
        steps += [("scatter", c), ("reduce", c - 1), ("gather", c - 1)]
    steps += [("reduce", chunks - 1), ("gather", chunks - 1)]
    return steps + [("assemble", c) for c in range(chunks)]


class CopyEngineSchedule:
    """Streams, events and window addresses of the ``dma`` transport for one op on one rank."""

    def __init__(self, *, config: layout.OpConfig, window, device: torch.device, silent: bool = False, memops=None,
                 replay: bool = False, flag_by_copy: bool = False, lanes: int | None = None, marks=None,
                 drops=None):
        self.memops = cuda_memops if memops is None else memops
        self.cfg = config
        self.rank, self.world = window.rank, window.world
        self.silent = silent  # fault injection: flags released, no bytes moved (self_test must catch it)
        self.marks = marks  # cco.cuda.watchdog.CallMarks, or None: nothing watches the calls
        self.drops = drops  # fault injection: FaultPlan.dropped(phase=, seq=, src=, dest=, chunk=), or None
        self.rejected_seq = None  # the call this rank rejected (its stamp says so): cco.backends.cuda
        self.plan, self.path = None, None  # the last call begun, and "dma" or "lsa" (the backend says)
        self.chunk_events = False  # the reduced events show the call in flight (the watchdog's diagnosis)
        self.lsa_rows = 0  # the most rows of a call the lsa kernel ran (the watchdog releases their tile flags)
        w = config.window
        r = self.rank
        self.peers = [d for d in layout.dest_order(r, self.world) if d != r]
        # the pattern's steps: a gather phase with data (all-reduce) or a flag only (reduce-scatter);
        # the reduce's own slice at its column of an [M, N] out, or (no gather) the whole out
        self.gathers = config.pattern_spec.gather
        self.out_col0 = r * config.n_slice if self.gathers else 0
        self.counters = window.words(w.counters, rank=r)
        self.scatter_flags = window.words(w.scatter_flags, rank=r)
        self.gather_flags = window.words(w.gather_flags, rank=r)
        self.scatter_m = window.words(w.scatter_m, rank=r)
        self.partial = window.tensor(w.partial, rank=r)
        self.recv = window.tensor(w.recv, rank=r)
        self.gather = window.tensor(w.gather, rank=r)
        self.gather_scale = window.tensor(w.gather_scale, rank=r) if config.gather_dtype == "fp8" else None
        self.a_rows = window.tensor(w.a_rows, rank=r)  # all-gather: [W(src), rows, K] e4m3 (else empty)
        self.a_scales = window.tensor(w.a_scales, rank=r)  # ... and their scales (layout.input_scale_shape)
        self.peer = {
            p: {
                "recv": window.tensor(w.recv, rank=p),
                "gather": window.tensor(w.gather, rank=p),
                "gather_scale": window.tensor(w.gather_scale, rank=p) if self.gather_scale is not None else None,
                "scatter_flags": window.words(w.scatter_flags, rank=p),
                "gather_flags": window.words(w.gather_flags, rank=p),
                "scatter_m": window.words(w.scatter_m, rank=p),
                "a_rows": window.tensor(w.a_rows, rank=p),
                "a_scales": window.tensor(w.a_scales, rank=p),
            }
            for p in self.peers
        }
        self.status = torch.zeros(STATUS_WORDS, dtype=torch.int64, device=device)
        self.stamp = torch.zeros(1, dtype=torch.int64, device=device)  # this call's (seq, M) stamp
        self.ticket = torch.zeros(1, dtype=torch.int64, device=device)  # the epilogue-reduce GEMM's claims
        self.flag_set = torch.full((1,), FLAG_SET, dtype=torch.int64, device=device)  # source of flag copies
        self.flag_by_copy = flag_by_copy
        if lanes is None:
            lanes = put_lanes(self.world)
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"CopyEngineSchedule: lanes must be an int >= 1, got {lanes!r}")
        self.lanes = lanes  # put streams per peer a call uses
        self.lanes_made = max(lanes, put_lanes(self.world, LANES_MADE))
        self.replay = replay
        self.main = None  # the stream of the call in progress (begin() sets it)
        self.graphs = GraphCache()
        self.replays = 0  # calls that replayed captured side work
        self.side_programs = SIDE_PROGRAMS
        # probe (and warm the fallback kernels) now: neither may happen inside a graph capture
        self.capture_memops = self.memops.capture_supported(self.status.device.index)
        if not self.capture_memops:
            scratch = torch.ones(1, dtype=torch.int64, device=device)
            self.memops.write_kernel(None, scratch.data_ptr(), 1)
            self.memops.wait_geq_kernel(None, scratch.data_ptr(), 1)
            torch.cuda.synchronize(device)
        if config.pattern_spec.gathers_input:  # the all-gather's block wait (_wait_block), on words already set
            scratch = torch.zeros(self.world * layout.MAX_CHUNKS, dtype=torch.int64, device=device)
            self.memops.wait_block_kernel(None, scratch, layout.MAX_CHUNKS, (0, self.world), (0, 1), -1, 0)
            torch.cuda.synchronize(device)
        with torch.cuda.device(device):
            lo, hi = torch.cuda.Stream.priority_range()
            self.put = {p: [torch.cuda.Stream(device=device) for _ in range(self.lanes_made)] for p in self.peers}
            self.reduce = torch.cuda.Stream(device=device, priority=hi)  # reduce CTAs ahead of waiting GEMM CTAs
            self.assemble = torch.cuda.Stream(device=device)
            self.begin_event = torch.cuda.Event()
            self.gemm_event = torch.cuda.Event()
            self.inputs_ready = torch.cuda.Event()  # all-gather: the own rows are in the window's slot
            self.reduced = [torch.cuda.Event() for _ in range(layout.MAX_CHUNKS)]
            self.done = {s: torch.cuda.Event() for s in self._side_streams(every=True)}
            self.launch = torch.cuda.Stream(device=device)  # replays of the captured side work
            self.capture = torch.cuda.Stream(device=device)
            self.launched = torch.cuda.Event()
            self.fork = torch.cuda.Event()
            self.producer_streams = PRODUCER_STREAMS
            # produce_by_chunks' streams beside the call's, each joined back by its event
            self.produce_sides = [torch.cuda.Stream(device=device) for _ in range(MAX_PRODUCER_STREAMS - 1)]
            self.produced = [torch.cuda.Event() for _ in self.produce_sides]
            self.produce_fork = torch.cuda.Event()

    def load_kernels(self, partials) -> None:
        """Compile and load the reduce and dequant kernels a call launches behind its waits on peers,
        for each layout of ``partials`` the producers write (``cco.cuda.kernels``: a kernel loaded
        in the middle of a call can deadlock the ranks). Once, before any call."""
        out = torch.empty(1, self.cfg.n, dtype=torch.bfloat16, device=self.status.device)  # a call's out, 1 row
        if self.cfg.pattern_spec.gathers_input:  # no reduce: the stamp check ends the call
            kernels.check_stamps(out=out, scatter_m=self.scatter_m, status=self.status, stamp=self.stamp,
                                 rank=self.rank, world=self.world, load_only=True)
            return
        for partial in partials:
            kernels.reduce_chunk(partial=partial, recv=self.recv, gather=self.gather if self.gathers else None,
                                 gather_scale=self.gather_scale, out=out, scatter_m=self.scatter_m, status=self.status,
                                 rank=self.rank, rows=(0, 1), stamp=self.stamp, programs=self.side_programs,
                                 load_only=True, out_col0=self.out_col0)
        if self.gathers:
            kernels.dequant_chunk(gather=self.gather, gather_scale=self.gather_scale, out=out, rank=self.rank,
                                  rows=(0, 1), programs=self.side_programs, load_only=True)

    def _side_streams(self, every: bool = False):
        """The streams a call uses (``every``: also the put streams beyond ``lanes``)."""
        used = self.lanes_made if every else self.lanes
        return [*(s for lanes in self.put.values() for s in lanes[:used]), self.reduce, self.assemble]

    @staticmethod
    def _addr(words: torch.Tensor, index: int) -> int:
        return words.data_ptr() + index * _WORD

    def _use_kernels(self) -> bool:
        """Spin/store kernels instead of stream memory operations: only while capturing a graph on a
        driver that cannot capture the latter (probed once)."""
        return not self.capture_memops and torch.cuda.is_current_stream_capturing()

    def _wait(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        if self._use_kernels():
            with torch.cuda.stream(stream):
                self.memops.wait_geq_kernel(stream, addr, value)
        else:
            self.memops.wait_geq(stream.cuda_stream, addr, value)

    def _write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        if self._use_kernels():
            with torch.cuda.stream(stream):
                self.memops.write_kernel(stream, addr, value)
        else:
            self.memops.write(stream.cuda_stream, addr, value)

    def _wait_block(self, stream: torch.cuda.Stream, words: torch.Tensor, chunks: int) -> None:
        """Wait on ``stream`` until every peer's first ``chunks`` flags in ``words`` are set: one
        spin launch polling them all (``memops.wait_block_kernel``) where a call waits for every
        one before it goes on, instead of a stream wait per flag, each of which holds the stream
        ~1.9 us of device time even once the flag is set (module note): an all-gather at W = 8
        with 4 chunks waited 28 times, ~52 us, after its last chunk had landed."""
        with torch.cuda.stream(stream):
            self.memops.wait_block_kernel(stream, words, layout.MAX_CHUNKS, (0, self.world), (0, chunks), self.rank,
                                          FLAG_SET)

    def _consume(self, stream: torch.cuda.Stream, words: torch.Tensor, index: int, count: int = 1) -> None:
        """Zero ``count`` consecutive flags from ``words[index]`` on ``stream``, after their waits
        there (module note, "Graph safety"): one memset, not a write-value per word. A stream
        write-value holds its stream ~1.8 us of device time and a memset of a few words ~0.9 us
        (graph replay on an H200, 2026-12-04); a flag needs no fence (it announces no data of this
        stream), and a memset is captured where stream memory operations are not."""
        self.memops.fill(stream.cuda_stream, self._addr(words, index), 0, count * _WORD)

    def _consume_rows(self, stream: torch.cuda.Stream, words: torch.Tensor, sources, chunks: int) -> None:
        """Zero the flags ``[src, 0..chunks)`` of every src in ``sources`` (after their waits on
        ``stream``) with one memset over the words from the lowest source's first to the highest's
        last: 7 memsets become one at W = 8 (~0.9 us of device time each, ``_consume``). The words
        between are dead in the call: the own row (no rank sets its own flags) and chunks past the
        call's (no peer sets them); a peer writes any of them again only in a later call, which it
        starts after this rank has told it that this one ended, after this memset (module note,
        "Graph safety")."""
        first, last = layout.counter_index(min(sources), 0), layout.counter_index(max(sources), chunks - 1)
        self._consume(stream, words, first, last + 1 - first)

    # ---- one call -----------------------------------------------------------------------------------
    def begin(self, plan: layout.CallPlan) -> None:
        """The call's (seq, M) stamp word, on the current stream. Peers check the stamp (copied into
        their ``scatter_m``) and never read the header, so its (seq, m) words stay unwritten here:
        every stream write-value on the main stream delays the GEMM's start."""
        main = self.main = current_stream()  # run() joins into it
        self.plan, self.path = plan, "dma"  # the call in flight, for the watchdog's diagnosis
        self._write(main, self.stamp.data_ptr(), self.stamp_of(plan))
        self.begin_event.record(main)

    def stamp_of(self, plan: layout.CallPlan) -> int:
        """The (seq, tag, M) stamp of ``plan``'s call; the rejected stamp for a call this rank rejected."""
        return stamp_rejected(plan.seq) if plan.seq == self.rejected_seq else stamp_of_plan(plan)

    def set_counters(self, plan: layout.CallPlan) -> None:
        """Bring this call's counters to their targets without a GEMM (``all_reduce_window``)."""
        for c in range(plan.chunks):
            self.release_chunk(plan, c)
        self.begin_event.record(self.main)

    def release_chunk(self, plan: layout.CallPlan, chunk: int, stream=None) -> None:
        """Raise every dest's counter of ``chunk`` to its target (own dest last), on ``stream`` (the
        call's by default): a stream write-value runs once the stream's earlier work is done and
        fences it, so a wait that sees the value sees the chunk's rows written by that work."""
        stream = self.main if stream is None else stream
        for d in layout.dest_order(self.rank, self.world):
            self._write(stream, self._addr(self.counters, layout.counter_index(d, chunk)), self._tiles(plan, d, chunk))

    def produce_by_chunks(self, plan: layout.CallPlan, chunk_gemm) -> None:
        """The producer of whole chunks (``cco.backends.cuda``, producer ``"vendor"``):
        ``chunk_gemm(c)`` enqueues chunk c's rows of the GEMM, every column, on the current stream,
        then :meth:`release_chunk` releases its counters on that stream, so the puts of chunk c
        start while later chunks are computed. Same counters and targets as a producer of tiles.

        ``producer_streams`` (``PRODUCER_STREAMS``) S > 1: chunk c goes to stream c % S, stream 0
        being the call's and the others ``produce_sides``, which start after everything the call's
        stream holds so far (the stamp, and what ``chunk_gemm`` prepared for all chunks) and are
        joined back before this returns. One stream runs the chunk GEMMs back to back, each starting
        after the previous one's last wave. (The releases on a stream of their own, the GEMMs on one,
        measured no faster and cost each eager call two more host calls per chunk:
        docs/hopper_gemm.md.)"""
        dests = layout.dest_order(self.rank, self.world)
        self.produce(plan, [(lambda c=c: chunk_gemm(c), [(d, c) for d in dests]) for c in range(plan.chunks)])

    def produce(self, plan: layout.CallPlan, units) -> None:
        """A producer of whole slots: ``units`` is a list of ``(gemm, slots)``, in order; ``gemm()``
        enqueues its rows on the current stream, then each ``(dest, chunk)`` of ``slots`` gets its
        counter raised to its target on that stream (``produce_by_chunks``: a unit per chunk, every
        dest; the reduce-scatter along rows: a unit per group of a dest's chunks, the peers' first,
        since each slice is its own rows of A). Units are dealt to ``producer_streams`` streams in
        turn."""
        main = self.main
        if main is None:
            raise RuntimeError("CopyEngineSchedule.produce: call begin() first")
        if not (isinstance(self.producer_streams, int) and 1 <= self.producer_streams <= MAX_PRODUCER_STREAMS):
            raise ValueError(f"CopyEngineSchedule: producer_streams={self.producer_streams!r}; pick 1 .. "
                             f"{MAX_PRODUCER_STREAMS}")
        sides = self.produce_sides[:min(self.producer_streams, len(units)) - 1]
        if sides:
            self.produce_fork.record(main)
            for s in sides:
                s.wait_event(self.produce_fork)
        streams = [main, *sides]
        for i, (gemm, slots) in enumerate(units):
            s = streams[i % len(streams)]
            if s is main:
                gemm()
            else:
                with torch.cuda.stream(s):
                    gemm()
            for d, c in slots:
                self._write(s, self._addr(self.counters, layout.counter_index(d, c)), self._tiles(plan, d, c))
        for s, done in zip(sides, self.produced):
            done.record(s)
            main.wait_event(done)

    def run(self, plan: layout.CallPlan, out: torch.Tensor, *, after_gemm: bool, scatters_first: bool = False,
            reduced_in_gemm: bool = False, partial: torch.Tensor | None = None) -> None:
        """Enqueue steps 3-5 of call ``plan`` and join them into the stream :meth:`begin` ran on.

        ``after_gemm=True`` (split mode, self-test): every side stream first waits for the whole
        GEMM (an event recorded now on that stream); otherwise the puts start as the
        counters complete, while the GEMM is still running. ``scatters_first``: see
        :func:`submission_order`. ``reduced_in_gemm``: the GEMM reduces its own tiles itself
        (``kernels_fused.hopper.gemm.ReduceEpilogue``); the reduce stream only waits for them and
        resets the words they read. ``partial``: the [W, rows, n_slice] planes of the partial
        region the producer wrote (``cco.layout.partial_strides``; None: the region's own
        dest-major planes)."""
        main = self.main
        if main is None:
            raise RuntimeError("CopyEngineSchedule.run: call begin() first (it records the call's start)")
        gate = self.begin_event
        if after_gemm:
            self.gemm_event.record(main)
            gate = self.gemm_event
        if not 1 <= self.lanes <= self.lanes_made:
            raise ValueError(f"CopyEngineSchedule: lanes={self.lanes!r}; this schedule made {self.lanes_made} put "
                             f"streams per peer")
        partial = self.partial if partial is None else partial
        variant = (scatters_first, reduced_in_gemm, self.lanes, partial.data_ptr(), partial.stride())
        capturing = torch.cuda.is_current_stream_capturing()  # the caller's capture takes the work as is
        graph = None if capturing else self._graph(plan, out, variant, partial)
        # the reduced events a replayed call records are the graph's own: the host's stay as they were
        self.chunk_events = graph is None and not capturing
        if graph is None:
            self._fork_join(main, gate, plan, out, variant, partial)
            return
        self.replays += 1
        self.launch.wait_event(gate)
        if hasattr(graph, "raw_cuda_graph_exec"):
            self.memops.graph_launch(graph.raw_cuda_graph_exec(), self.launch.cuda_stream)
        else:  # a torch without raw_cuda_graph_exec
            with torch.cuda.stream(self.launch):
                graph.replay()
        self.launched.record(self.launch)
        main.wait_event(self.launched)

    def gather_inputs(self, plan: layout.CallPlan, *, out, consume_own=None, consume=None, consume_all=None,
                      assemble=None) -> None:
        """The all-gather's call after :meth:`begin` and the own rows' copy into ``a_rows[rank]``
        (module note): the puts of the own rows to every peer, chunk by chunk, on the put streams;
        ``consume_own()`` (the own rows' GEMM) on a stream of its own, beside what follows; on the
        call's stream per (chunk, source) the wait for its rows and ``consume(src, chunk)`` (that
        chunk's GEMM); or (``consume`` None:
        split mode, or a consumer that merges every peer's rows) one wait for every chunk and
        ``consume_all()``; then the end of the call: every peer told this rank has
        its rows, the wait for every peer's word, ``assemble()`` (the gathered input), the stamp
        check into ``out`` (None: the self test, which checks the bytes itself)."""
        main = self.main
        if main is None:
            raise RuntimeError("CopyEngineSchedule.gather_inputs: call begin() first (it records the call's stamp)")
        if not 1 <= self.lanes <= self.lanes_made:
            raise ValueError(f"CopyEngineSchedule: lanes={self.lanes!r}; this schedule made {self.lanes_made} put "
                             f"streams per peer")
        self.chunk_events = False  # no reduce events: the watchdog's diagnosis names no chunk
        if self.marks is not None:  # before the call's first wait (they are all on this stream)
            self.marks.enter(self._write, main)
        self.inputs_ready.record(main)
        puts = [s for lanes in self.put.values() for s in lanes[:self.lanes]]
        for s in puts:
            s.wait_event(self.inputs_ready)
        for c in range(plan.chunks):  # every put is submitted before the first wait (submission_order)
            lane = c % self.lanes
            for p in self.peers:
                self._put(plan, p, c, lane, self._input_blocks(plan, p, c), stamp=c < self.lanes)
        for s in puts:
            self.done[s].record(s)
        own = self.produce_sides[0]
        if consume_own is not None:  # beside the peers' GEMMs, not before them (module note)
            own.wait_event(self.inputs_ready)
            with torch.cuda.stream(own):
                consume_own()
            self.produced[0].record(own)
        sources = layout.input_order(self.rank, self.world)[1:]
        if consume is None:  # nothing consumed before every chunk is in: one wait for all of them
            self._wait_block(main, self.scatter_flags, plan.chunks)
        else:
            for c in range(plan.chunks):  # the order the peers' puts arrive in (layout.input_order)
                for src in sources:
                    self._wait(main, self._addr(self.scatter_flags, layout.counter_index(src, c)), FLAG_SET)
                    consume(src, c)
        self._consume_rows(main, self.scatter_flags, sources, plan.chunks)  # after the last wait
        if consume_all is not None:
            consume_all()
        for p in self.peers:  # this rank has every peer's rows: tell them, then wait for theirs
            self._set_peer_flag(main, self._addr(self.peer[p]["gather_flags"], layout.counter_index(self.rank, 0)))
        self._finish_wait(main, block=True)
        for s in puts:
            main.wait_event(self.done[s])
        if consume_own is not None:
            main.wait_event(self.produced[0])
        if assemble is not None:
            assemble()
        if out is not None:
            kernels.check_stamps(out=out, scatter_m=self.scatter_m, status=self.status, stamp=self.stamp,
                                 rank=self.rank, world=self.world)
        if self.marks is not None:
            self.marks.leave(self._write, main)

    def _input_blocks(self, plan, p, c) -> list[tuple[int, int, int, int, int, int]]:
        """The all-gather's put of chunk c to peer p (``_put``'s blocks): the own slot's rows c into
        the peer's ``a_rows[rank]``, and their scales into its ``a_scales[rank]`` (blockscale's slot is
        ``[K/128, rows]``: a chunk is a column block, one 2-D copy)."""
        (r0, r1), r = plan.rows[c], self.rank
        blocks = []
        for src, dst, columns in ((self.a_rows[r], self.peer[p]["a_rows"][r], False),
                                  (self.a_scales[r], self.peer[p]["a_scales"][r], self.cfg.quant == "blockscale")):
            item = src.element_size()
            if columns:
                pitch = src.stride(0) * item  # [K/128, rows]: chunk c is columns r0..r1 of every row
                blocks.append((dst.data_ptr() + r0 * item, pitch, src.data_ptr() + r0 * item, pitch, (r1 - r0) * item,
                               src.shape[0]))
            else:
                row = (src.stride(0) if src.dim() == 2 else 1) * item
                blocks.append((dst.data_ptr() + r0 * row, row, src.data_ptr() + r0 * row, row, row, r1 - r0))
        return blocks

    def _fork_join(self, origin, gate, plan, out, variant, partial) -> None:
        scatters_first, reduced_in_gemm = variant[:2]
        for s in self._side_streams():
            s.wait_event(gate)
        if self.marks is not None:  # submitted before any wait of the call, on any stream
            self.marks.enter(self._write, self.assemble)
        self._enqueue(plan, out, submission_order(plan.chunks, scatters_first=scatters_first), reduced_in_gemm,
                      partial)
        if self.marks is not None:  # the assemble and the reduce stream hold every wait on a peer
            self.assemble.wait_event(self.reduced[plan.chunks - 1])
            self.marks.leave(self._write, self.assemble)
        for s in self._side_streams():
            self.done[s].record(s)
            origin.wait_event(self.done[s])

    def _graph(self, plan, out, variant, partial):
        """The captured side work of this call, captured now if its key was seen before; None: enqueue it.
        Not while the caller captures (``run``)."""
        if not self.replay:
            return None
        key = (plan.m, out.data_ptr(), out.stride(0), variant)
        graph, capture = self.graphs.lookup(key)
        if not capture:
            return graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.capture):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.fork.record(self.capture)
                self._fork_join(self.capture, self.fork, plan, out, variant, partial)
            finally:
                graph.capture_end()
        self.graphs.store(key, graph)
        return graph

    def _tiles(self, plan, dest, chunk) -> int:
        return plan.slot_tiles(dest, chunk)

    def _rows_bytes(self, region: torch.Tensor, rows: tuple[int, int]) -> tuple[int, int]:
        """(byte offset, byte count) of rows [r0, r1) of one [rows_max, n_slice] plane of ``region``."""
        row_bytes = region.shape[-1] * region.element_size()
        return rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes

    def _enqueue(self, plan, out, order, reduced_in_gemm, partial):
        puts = 0  # put steps so far: step i goes to lane i % lanes
        stamped = set()  # lanes that carried the stamp
        for phase, c in order:
            if phase == "reduce":
                self._reduce_chunk(plan, out, c, reduced_in_gemm, partial)
            elif phase == "assemble":
                self._assemble_chunk(plan, out, c)
            else:
                lane = puts % self.lanes
                puts += 1
                for p in self.peers:
                    if phase == "gather":
                        self._gather_chunk(plan, p, c, lane)
                    else:
                        self._scatter_chunk(plan, p, c, lane, partial[p], stamp=lane not in stamped)
                if phase == "scatter":
                    stamped.add(lane)

    def _set_peer_flag(self, stream, addr: int) -> None:
        """Set a peer's flag once every earlier copy of ``stream`` has landed."""
        if self.flag_by_copy:
            self.memops.copy(stream.cuda_stream, addr, self.flag_set.data_ptr(), _WORD)
        else:
            self._write(stream, addr, FLAG_SET)

    def _dropped(self, phase, plan, p, c) -> bool:
        return self.drops is not None and self.drops(phase=phase, seq=plan.seq, src=self.rank, dest=p, chunk=c)

    def _scatter_chunk(self, plan, p, c, lane, source, *, stamp):
        """Chunk c of ``source`` (dest p's [rows, n_slice] plane of the partial) into the peer's
        ``recv[rank]``, once the chunk's counter shows it written: one copy of a contiguous block,
        or a 2-D copy where the plane's rows lie further apart (a producer of whole rows)."""
        (r0, r1), width = plan.rows[c], source.shape[1] * source.element_size()
        pitch = source.stride(0) * source.element_size()
        block = (self.peer[p]["recv"][self.rank].data_ptr() + r0 * width, width, source.data_ptr() + r0 * pitch, pitch,
                 width, r1 - r0)
        self._put(plan, p, c, lane, [block], stamp=stamp,
                  counter=(self._addr(self.counters, layout.counter_index(p, c)), self._tiles(plan, p, c)))

    def _put(self, plan, p, c, lane, blocks, *, stamp, counter=None):
        """One scatter-phase put to peer ``p`` on its lane: (wait ``counter`` = (address, target)), the
        call's stamp into the peer's ``scatter_m[rank]`` (``stamp``: the lane's first flag of the call
        follows), the ``blocks`` (dst, dst pitch, src, src pitch, width, height in bytes: a copy, or a
        2-D copy where the rows lie apart), then ``scatter_flags[rank, c]`` in the peer. The
        all-reduce's and reduce-scatter's chunks of partial products and the all-gather's input
        rows go this way alike (``_dropped``: a lost put, neither data nor flag arrive)."""
        r, s, peer = self.rank, self.put[p][lane], self.peer[p]
        if self._dropped("scatter", plan, p, c):
            return
        if counter is not None:
            self._wait(s, *counter)
        if stamp:
            self.memops.copy(s.cuda_stream, self._addr(peer["scatter_m"], r), self.stamp.data_ptr(), _WORD)
        if not self.silent:
            for dst, dst_pitch, src, src_pitch, width, height in blocks:
                if height == 1 or (dst_pitch == width and src_pitch == width):
                    self.memops.copy(s.cuda_stream, dst, src, height * width)
                else:
                    self.memops.copy_2d(s.cuda_stream, dst=dst, dst_pitch=dst_pitch, src=src, src_pitch=src_pitch,
                                        width=width, height=height)
        self._set_peer_flag(s, self._addr(peer["scatter_flags"], layout.counter_index(r, c)))

    def _gather_chunk(self, plan, p, c, lane):
        r, s, peer = self.rank, self.put[p][lane], self.peer[p]
        if self._dropped("gather", plan, p, c):
            return
        if not self.gathers:  # reduce-scatter: no data; the last step tells p this rank finished the call
            if c == plan.chunks - 1:
                s.wait_event(self.reduced[c])  # (the reduce stream is in order: every chunk is reduced)
                self._set_peer_flag(s, self._addr(peer["gather_flags"], layout.counter_index(r, 0)))
            return
        s.wait_event(self.reduced[c])
        off, nbytes = self._rows_bytes(self.gather, plan.rows[c])
        if not self.silent:
            self.memops.copy(s.cuda_stream, peer["gather"][r].data_ptr() + off, self.gather[r].data_ptr() + off, nbytes)
            if self.gather_scale is not None:
                off, nbytes = self._rows_bytes(self.gather_scale, plan.rows[c])
                self.memops.copy(s.cuda_stream, peer["gather_scale"][r].data_ptr() + off,
                                 self.gather_scale[r].data_ptr() + off, nbytes)
        self._set_peer_flag(s, self._addr(peer["gather_flags"], layout.counter_index(r, c)))

    def _reduce_chunk(self, plan, out, c, in_gemm, partial):
        """Reduce chunk c, or (``in_gemm``) wait until the GEMM has: its own tiles read the scatter
        flags without consuming them, so they are zeroed here, after the last reader counted."""
        r, s = self.rank, self.reduce
        with torch.cuda.stream(s):
            self._wait(s, self._addr(self.counters, layout.counter_index(r, c)), self._tiles(plan, r, c))
            for src in layout.reduce_order(r, self.world):
                if not in_gemm:
                    self._wait(s, self._addr(self.scatter_flags, layout.counter_index(src, c)), FLAG_SET)
                self._consume(s, self.scatter_flags, layout.counter_index(src, c))
            if not in_gemm:
                kernels.reduce_chunk(partial=partial, recv=self.recv, gather=self.gather if self.gathers else None,
                                     gather_scale=self.gather_scale, out=out, scatter_m=self.scatter_m,
                                     status=self.status, rank=r, rows=plan.rows[c], stamp=self.stamp,
                                     programs=self.side_programs, out_col0=self.out_col0)
            self.reduced[c].record(s)

    def _finish_wait(self, stream, *, block: bool = False) -> None:
        """Wait until every peer finished the call (its ``gather_flags[p, 0]`` here, then = 0): the
        end of a call of a pattern without a gather phase (module note). ``block``: one spin launch
        for every peer's word (``_wait_block``) where there are two or more; only where no GEMM
        that a peer waits for runs beside it (the all-gather's end: module note)."""
        if block and len(self.peers) > 1:
            self._wait_block(stream, self.gather_flags, 1)
        else:
            for o in self.peers:
                self._wait(stream, self._addr(self.gather_flags, layout.counter_index(o, 0)), FLAG_SET)
        self._consume_rows(stream, self.gather_flags, self.peers, 1)

    def _assemble_chunk(self, plan, out, c):
        r, s, ns = self.rank, self.assemble, self.cfg.n_slice
        if not self.gathers:  # reduce-scatter: the reduce wrote out; the last step waits for the peers
            if c == plan.chunks - 1:
                with torch.cuda.stream(s):
                    self._finish_wait(s)
            return
        with torch.cuda.stream(s):
            for o in self.peers:
                self._wait(s, self._addr(self.gather_flags, layout.counter_index(o, c)), FLAG_SET)
                self._consume(s, self.gather_flags, layout.counter_index(o, c))
            r0, r1 = plan.rows[c]
            if self.gather_scale is not None or self.side_programs is not None:
                kernels.dequant_chunk(gather=self.gather, gather_scale=self.gather_scale, out=out, rank=r, rows=(r0, r1),
                                      programs=self.side_programs)
                return
            for o in self.peers:
                self.memops.copy_2d(s.cuda_stream, dst=out.data_ptr() + (r0 * out.stride(0) + o * ns) * 2,
                               dst_pitch=out.stride(0) * 2, src=self.gather[o].data_ptr() + r0 * ns * 2,
                               src_pitch=ns * 2, width=ns * 2, height=r1 - r0)

    def check(self) -> int:
        """Synchronizes; returns the status word (0: fine; 1 + src: rank src sent another M/seq)."""
        torch.cuda.synchronize(self.status.device)
        return int(self.status[0].item())

    def close(self) -> None:
        self.put = {}
        self.reduce = self.assemble = None
