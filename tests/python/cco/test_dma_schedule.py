"""What the CUDA copy-engine schedule (``cco.cuda.dma.CopyEngineSchedule``) enqueues, recorded on the
host: streams, events and kernels are stand-ins that log, the memory operations a recorder.

Guards the order of the words' waits, writes and copies per stream (the GPU test only sees whether
a run ended right):
- with the own tiles reduced in the GEMM (``reduced_in_gemm``), the reduce stream launches no
  kernel, waits for the chunk's counter and only then zeroes the scatter flags the GEMM's own tiles
  read (zeroed earlier, a tile still polling would wait forever or a late flag would survive into
  the next call); without it, it waits for each flag before the reduce kernel;
- a peer's flag is set after the data it announces, by an 8-byte copy of the word holding
  ``FLAG_SET`` (``flag_by_copy``) or by a write-value of it;
- every reduce and dequant kernel a call launches behind its waits is one the schedule loaded when
  it was built (a kernel compiled or loaded in the middle of a call can deadlock the ranks);
- the producer of whole chunks (the vendor GEMM per chunk): each chunk's counters are released
  on the call's stream after that chunk's GEMM and before the next one, each to exactly its
  target; the puts then move a pitched block per destination (2-D copies of the row-major partial)
  and the reduce kernel reads the same planes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import pytest
import torch

from cco import layout

WORLD, RANK, M = 2, 0, 512


class _Log:
    def __init__(self):
        self.ops = []  # (stream name, op, *details)
        self.current = None


def _fake_cuda(log: _Log):
    class Stream:
        count = 0

        def __init__(self, device=None, priority=0):
            Stream.count += 1
            self.name = self.cuda_stream = f"stream{Stream.count}"

        @staticmethod
        def priority_range():
            return 0, -1

        def wait_event(self, event):
            log.ops.append((self.name, "wait_event", event.name))

    class Event:
        count = 0

        def __init__(self):
            Event.count += 1
            self.name = f"event{Event.count}"

        def record(self, stream=None):
            log.ops.append(((stream or log.current).name, "record", self.name))

    @contextlib.contextmanager
    def stream(s):
        before, log.current = log.current, s
        try:
            yield
        finally:
            log.current = before

    log.current = Stream()
    log.current.name = log.current.cuda_stream = "main"
    return types.SimpleNamespace(Stream=Stream, Event=Event, stream=stream, current_stream=lambda: log.current,
                                 device=lambda device: contextlib.nullcontext(),
                                 is_current_stream_capturing=lambda: False, synchronize=lambda device=None: None)


class _Memops:
    def __init__(self, log: _Log):
        self.log = log

    def capture_supported(self, index):
        return True

    def wait_geq(self, stream, addr, value):
        self.log.ops.append((stream, "wait", addr, value))

    def write(self, stream, addr, value):
        self.log.ops.append((stream, "write", addr, value))

    def fill(self, stream, dst, byte, nbytes):
        self.log.ops.append((stream, "fill", dst, byte, nbytes))

    def wait_block_kernel(self, stream, words, row, rows, cols, skip, value):
        # one spin launch on the current stream: recorded with the words it waits for
        name = self.log.current.name if self.log.current is not None else "current"
        addrs = tuple(words.data_ptr() + (s * row + c) * 8 for s in range(*rows) if s != skip for c in range(*cols))
        self.log.ops.append((name, "wait_block", addrs, value))

    def copy(self, stream, dst, src, nbytes):
        self.log.ops.append((stream, "copy", dst, src, nbytes))

    def copy_2d(self, stream, *, dst, dst_pitch, src, src_pitch, width, height):
        self.log.ops.append((stream, "copy_2d", dst, dst_pitch, src, src_pitch, width, height))


def _schedule(monkeypatch, log, *, gather, lanes=1, world=WORLD, pattern="all-reduce", quant="ptpc", rank=RANK,
              m_max=M):
    from cco.cuda import dma
    from cco.window import Window

    k = 512 if quant == "blockscale" else 256  # blockscale: 4 scale columns, a K cuBLAS is sent (vendor.takes_rows)
    cfg = layout.build_config(n=512 * world, k=k, m_max=m_max, world=world, quant=quant, transport="dma",
                              gather_dtype=gather, block_m=128, block_n=128, pattern=pattern)

    class HostWindow(Window):
        def __init__(self):
            super().__init__(comm=types.SimpleNamespace(rank=rank, world=world), layout=cfg.window)
            self._buffers = [torch.zeros(cfg.window.nbytes, dtype=torch.uint8) for _ in range(world)]

        @property
        def device(self):
            return torch.device("cpu")

        def _raw(self, rank):
            return self._buffers[rank]

        def _release(self):
            pass

    def kernel(name):
        def launch(**kw):
            if kw.get("load_only"):  # loaded when the schedule is built: no launch
                return
            planes = (kw["partial"].data_ptr(), kw["partial"].stride()) if "partial" in kw else ()
            if name == "check_stamps":
                log.ops.append((log.current.name, name, kw["out"].data_ptr()))
                return
            log.ops.append((log.current.name, name, kw["rows"]) + planes + (
                ("no gather", kw["out_col0"]) if name == "reduce_kernel" and kw["gather"] is None else ()))
        return launch

    fake = _fake_cuda(log)
    monkeypatch.setattr(dma, "torch", types.SimpleNamespace(zeros=torch.zeros, full=torch.full, empty=torch.empty,
                                                            int64=torch.int64, bfloat16=torch.bfloat16, cuda=fake))
    monkeypatch.setattr(dma, "current_stream", fake.current_stream)  # (the real one asks torch._C)
    monkeypatch.setattr(dma, "kernels", types.SimpleNamespace(reduce_chunk=kernel("reduce_kernel"),
                                                              dequant_chunk=kernel("dequant_kernel"),
                                                              check_stamps=kernel("check_stamps")))
    window = HostWindow()
    sched = dma.CopyEngineSchedule(config=cfg, window=window, device=torch.device("cpu"), memops=_Memops(log),
                                   lanes=lanes)
    m = cfg.slice_m_max if cfg.pattern_spec.gathers_input else m_max  # the all-gather's M: rows per rank
    plan = layout.plan_call(cfg, m=m, seq=1, rank=rank, counter_base=layout.zero_counters(world))
    return sched, plan, window


def _addr(words, index):
    return words.data_ptr() + 8 * index


def _lane_of(puts, op):
    """(lane, position) of the one occurrence of ``op`` over every lane's log."""
    hits = [(lane, i) for lane, ops in enumerate(puts) for i, o in enumerate(ops) if o == op]
    assert len(hits) == 1, (op, hits)
    return hits[0]


@pytest.mark.parametrize("lanes", [1, 2], ids=["1-lane", "2-lanes"])
@pytest.mark.parametrize("flag_by_copy", [True, False], ids=["flag-copy", "flag-write"])
@pytest.mark.parametrize("in_gemm", [True, False], ids=["reduce-in-gemm", "reduce-kernel"])
def test_reduce_stream_and_peer_flags(monkeypatch, in_gemm, flag_by_copy, lanes):
    log = _Log()
    sched, plan, window = _schedule(monkeypatch, log, gather="bf16", lanes=lanes)
    sched.flag_by_copy = flag_by_copy
    peer = 1 - RANK
    sched.begin(plan)
    sched.run(plan, torch.zeros(M, 1024, dtype=torch.bfloat16), after_gemm=False, scatters_first=True,
              reduced_in_gemm=in_gemm)
    assert plan.chunks == 4
    reduce = [op[1:] for op in log.ops if op[0] == sched.reduce.name]
    puts = [[op[1:] for op in log.ops if op[0] == s.name] for s in sched.put[peer][:lanes]]
    assert not any(op[0] == s.name for s in sched.put[peer][lanes:] for op in log.ops)  # made, unused
    peer_scatter = window.words(sched.cfg.window.scatter_flags, rank=peer)
    peer_gather = window.words(sched.cfg.window.gather_flags, rank=peer)
    stamp = ("copy", _addr(window.words(sched.cfg.window.scatter_m, rank=peer), RANK), sched.stamp.data_ptr(), 8)
    row_bytes = sched.cfg.n_slice * 2
    for c in range(plan.chunks):
        counter = ("wait", _addr(sched.counters, layout.counter_index(RANK, c)), sched._tiles(plan, RANK, c))
        flag_wait = ("wait", _addr(sched.scatter_flags, layout.counter_index(peer, c)), 1)
        flag_zero = ("fill", _addr(sched.scatter_flags, layout.counter_index(peer, c)), 0, 8)
        reduced = ("record", sched.reduced[c].name)
        assert counter in reduce and flag_zero in reduce and reduced in reduce
        assert reduce.index(counter) < reduce.index(flag_zero) < reduce.index(reduced)
        kernel = ("reduce_kernel", plan.rows[c], sched.partial.data_ptr(), sched.partial.stride())
        if in_gemm:
            assert flag_wait not in reduce and kernel not in reduce
        else:
            assert reduce.index(flag_wait) < reduce.index(flag_zero) < reduce.index(kernel) < reduce.index(reduced)
        # a put lane: the chunk's data, then its flag in the peer, before the lane's next copy of data
        (r0, r1), off = plan.rows[c], plan.rows[c][0] * row_bytes
        for dst, src, flags in ((sched.peer[peer]["recv"][RANK], sched.partial[peer], peer_scatter),
                                (sched.peer[peer]["gather"][RANK], sched.gather[RANK], peer_gather)):
            data = ("copy", dst.data_ptr() + off, src.data_ptr() + off, (r1 - r0) * row_bytes)
            target = _addr(flags, layout.counter_index(RANK, c))
            flag_set = (("copy", target, sched.flag_set.data_ptr(), 8) if flag_by_copy else ("write", target, 1))
            lane, at = _lane_of(puts, data)
            assert _lane_of(puts, flag_set)[0] == lane
            ops = puts[lane]
            later_data = [i for i, op in enumerate(ops) if i > at and op[0] == "copy" and op[3] > 8]
            assert at < ops.index(flag_set) and (not later_data or ops.index(flag_set) < later_data[0])
            if flags is peer_scatter:  # the lane carried the call's stamp before this flag
                assert stamp in ops[:ops.index(flag_set)]
    for ops in puts:
        assert any(op[0] == "copy" and op[3] > 8 for op in ops)  # every lane carries data
        if flag_by_copy:
            assert not any(op[0] == "write" and op[2] == 1 for op in ops)  # no flag write-value left
    # the counters are zeroed at the call's start (by the backend), never by a side stream
    counter_words = {_addr(sched.counters, i) for i in range(sched.counters.numel())}
    assert not any(op[1] == "write" and op[2] in counter_words for op in log.ops)


def test_lanes_per_peer_and_their_bounds(monkeypatch):
    """Two put streams in all, at least one per peer; a call cannot use more lanes than were made."""
    from cco.cuda import dma

    assert [dma.put_lanes(w, 2) for w in (1, 2, 3, 4, 8)] == [2, 2, 1, 1, 1]
    assert dma.put_lanes(2, 1) == 1
    sched, plan, _ = _schedule(monkeypatch, _Log(), gather="bf16", lanes=None)
    assert sched.lanes == dma.put_lanes(WORLD)
    assert all(len(s) == max(sched.lanes, dma.put_lanes(WORLD, dma.LANES_MADE)) for s in sched.put.values())
    sched.lanes = sched.lanes_made + 1
    sched.begin(plan)
    with pytest.raises(ValueError, match="lanes=3"):
        sched.run(plan, torch.zeros(M, 1024, dtype=torch.bfloat16), after_gemm=False)
    with pytest.raises(ValueError, match="lanes must be an int >= 1"):
        _schedule(monkeypatch, _Log(), gather="bf16", lanes=0)


@pytest.mark.parametrize("streams", [1, 2, 3], ids=["1-stream", "2-streams", "3-streams"])
@pytest.mark.parametrize("world", [2, 3])
def test_chunk_producer_releases_after_each_gemm_and_puts_pitched_blocks(monkeypatch, world, streams):
    """The vendor producer (``produce_by_chunks``) and the transfers of its row-major partial."""
    log = _Log()
    sched, plan, window = _schedule(monkeypatch, log, gather="bf16", world=world)
    sched.producer_streams = streams
    cfg = sched.cfg
    by_rows = torch.as_strided(sched.partial, sched.partial.shape, layout.partial_strides(cfg, by_rows=True))
    sched.begin(plan)
    log.ops.append(("main", "prepare"))  # what chunk_gemm's maker enqueues for every chunk (scales)
    sched.produce_by_chunks(plan, lambda c: log.ops.append((log.current.name, "gemm", plan.rows[c])))
    joined = len(log.ops)
    sched.run(plan, torch.zeros(M, cfg.n, dtype=torch.bfloat16), after_gemm=False, partial=by_rows)
    assert plan.chunks == 4
    counters = {_addr(sched.counters, layout.counter_index(d, c)): (d, c) for d in range(world) for c in range(8)}
    sides = sched.produce_sides[:streams - 1]
    names = ["main"] + [s.name for s in sides]
    gemm_stream = {}
    for name in names:
        ops = [op[1:] for op in log.ops if op[0] == name and (op[1] == "gemm" or op[1] == "write" and op[2] in counters)]
        mine = [c for c in range(plan.chunks) if c % streams == names.index(name)]
        # per chunk of this stream: its GEMM, then one write per dest (own last) of exactly the slot's tiles
        expect = []
        for c in mine:
            gemm_stream[c] = name
            expect.append(("gemm", plan.rows[c]))
            expect += [("write", _addr(sched.counters, layout.counter_index(d, c)), plan.slot_tiles(d, c))
                       for d in layout.dest_order(RANK, world)]
        assert ops == expect, name
    assert sorted(gemm_stream) == list(range(plan.chunks))
    assert all(plan.slot_tiles(d, c) == plan.target(d, c) for d in range(world) for c in range(plan.chunks))
    # every other stream starts after what main holds so far (the prepared scales), and main joins
    # each before the side streams fork from it
    fork = ("main", "record", sched.produce_fork.name)
    assert (fork in log.ops) == bool(sides)
    for side, done in zip(sides, sched.produced):
        f = log.ops.index(fork)
        assert log.ops.index(("main", "prepare")) < f < log.ops.index((side.name, "wait_event", sched.produce_fork.name))
        assert f < min(i for i, op in enumerate(log.ops) if op[0] == side.name and op[1] != "wait_event")
        d = log.ops.index((side.name, "record", done.name))
        assert d < log.ops.index(("main", "wait_event", done.name)) < joined
        assert all(op[0] != side.name for op in log.ops[d + 1:])
    unused = {s.name for s in sched.produce_sides[streams - 1:]}
    assert not any(op[0] in unused for op in log.ops)
    ns, row_bytes = cfg.n_slice, cfg.n * 2
    for p in (d for d in layout.dest_order(RANK, world) if d != RANK):
        puts = [op[1:] for op in log.ops if op[0] == sched.put[p][0].name]
        recv = sched.peer[p]["recv"][RANK]
        into_recv = range(recv.data_ptr(), recv.data_ptr() + recv.numel() * 2)
        scatters = [op[0] for op in puts if op[0] in ("copy", "copy_2d") and op[1] in into_recv]
        assert scatters == ["copy_2d"] * plan.chunks  # the chunks' data only as pitched blocks
        for c, (r0, r1) in enumerate(plan.rows):
            block = ("copy_2d", sched.peer[p]["recv"][RANK].data_ptr() + r0 * ns * 2, ns * 2,
                     sched.partial.data_ptr() + r0 * row_bytes + p * ns * 2, row_bytes, ns * 2, r1 - r0)
            wait = ("wait", _addr(sched.counters, layout.counter_index(p, c)), plan.slot_tiles(p, c))
            assert block in puts and puts.index(wait) < puts.index(block)
    reduce = [op[1:] for op in log.ops if op[0] == sched.reduce.name and op[1] == "reduce_kernel"]
    assert reduce == [("reduce_kernel", rows, by_rows.data_ptr(), by_rows.stride()) for rows in plan.rows]


def test_cuda_backend_vendor_producer_end_to_end_on_the_host(monkeypatch):
    """The CUDA backend's fused dma call with the vendor producer, run on the host: torch's CPU
    ``_scaled_mm`` is the vendor GEMM (ptpc), the streams and memory operations are the recorders
    above. The partial region read row-major must hold the product's rows, every counter must be
    released to its target once, and the transfers must read the row-major planes (pitched puts,
    the reduce kernel's strides)."""
    from cco import quant as Q
    from cco.backends.cuda import CudaBackend
    from cco.preshuffle import preshuffle_b

    log = _Log()
    sched, plan, window = _schedule(monkeypatch, log, gather="bf16")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr("cco.cuda.dma.CopyEngineSchedule", lambda **kw: sched)  # streams: the recorders
    monkeypatch.setattr(CudaBackend, "watched", False)  # the watchdog's pinned words need a device
    backend = CudaBackend(config=sched.cfg, comm=None, window=window, deadline_s=1.0)
    backend.producer = "vendor"  # whatever DMA_PRODUCER picks for ptpc
    cfg = sched.cfg
    p = Q.random_problem(M, cfg.n, cfg.k, "ptpc", seed=4)
    backend.fused(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale, out=torch.zeros(M, cfg.n, dtype=torch.bfloat16),
                  plan=plan)
    want = torch._scaled_mm(p.a, p.b.t(), scale_a=p.a_scale.view(-1, 1), scale_b=p.b_scale.view(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=True)
    assert torch.equal(backend.partial_rows[:M], want)
    counter_words = {_addr(sched.counters, i) for i in range(sched.counters.numel())}
    released = [op[2:] for op in log.ops if op[1] == "write" and op[2] in counter_words and op[3]]
    assert sorted(released) == sorted((_addr(sched.counters, layout.counter_index(d, c)), plan.target(d, c))
                                      for d in range(WORLD) for c in range(plan.chunks))
    by_rows = backend.partial_by_rows
    assert by_rows.stride() == layout.partial_strides(cfg, by_rows=True)
    reduce = [op[2:] for op in log.ops if op[1] == "reduce_kernel"]
    assert reduce == [(rows, by_rows.data_ptr(), by_rows.stride()) for rows in plan.rows]
    assert sum(op[1] == "copy_2d" for op in log.ops) == plan.chunks * (WORLD - 1) + plan.chunks  # scatters, assembles


@pytest.mark.parametrize("m, k, producer", [(128, 512, "vendor"), (130, 512, "kernel"), (128, 384, "kernel")])
def test_cuda_backend_takes_the_kernel_producer_where_cublas_refuses_the_rows(monkeypatch, m, k, producer):
    """blockscale: cuBLAS's blockwise recipe refuses row counts that are not a multiple of 4, and is
    not sent a K of ceil(K/128) % 4 != 0 (``kernels_fused.hopper.vendor.takes_rows``; 384: 3 scale
    columns); a call with such an M or K runs the fused Triton kernel
    into the dest-major planes instead (here under Triton's interpreter), the others the vendor
    GEMM into the row-major ones. The transfers read what the producer wrote."""
    from cco import quant as Q
    from cco.backends.cuda import CudaBackend
    from cco.preshuffle import preshuffle_b
    from kernels_fused.hopper import vendor

    pytest.importorskip("triton")
    from tests.python.cco.test_triton_gemm import _blockwise_scaled_mm

    log = _Log()
    sched, _, window = _schedule(monkeypatch, log, gather="bf16")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch, "_scaled_mm", _blockwise_scaled_mm)  # the CPU build has no blockwise recipe
    monkeypatch.setattr("cco.cuda.dma.CopyEngineSchedule", lambda **kw: sched)
    monkeypatch.setattr(CudaBackend, "watched", False)  # the watchdog's pinned words need a device
    cfg = layout.build_config(n=sched.cfg.n, k=k, m_max=M, world=WORLD, quant="blockscale", transport="dma",
                              block_m=64, block_n=128)
    backend = CudaBackend(config=cfg, comm=None, window=window, deadline_s=1.0)
    backend.producer = "vendor"
    backend.fused_config = dataclasses.replace(backend.fused_config, block_n=128, num_stages=1)  # interpreter-sized
    backend.tile_weight = 1
    plan = layout.plan_call(cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
    assert vendor.takes_rows("blockscale", plan.rows, cfg.k) == (producer == "vendor")
    p = Q.random_problem(m, cfg.n, cfg.k, "blockscale", seed=5)
    backend.fused(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale, out=torch.zeros(m, cfg.n, dtype=torch.bfloat16),
                  plan=plan)
    planes = backend.partial_by_rows if producer == "vendor" else backend.partial
    got = torch.cat([planes[d][:m] for d in range(WORLD)], dim=1)
    assert Q.count_mismatches(got, p.reference()) == 0
    reduce = [op[2:] for op in log.ops if op[1] == "reduce_kernel"]
    assert reduce == [(rows, planes.data_ptr(), planes.stride()) for rows in plan.rows]


def _host_backend(monkeypatch, log, *, pattern, quant, mode="fused", world=WORLD, rank=RANK, m_max=M):
    """A CudaBackend of ``pattern`` over the recorders above, its vendor GEMM torch's CPU one (the
    blockwise recipe: test_triton_gemm's model of it), its own kernel under Triton's interpreter;
    rank ``rank`` of ``world``, ``m_max`` rows at most."""
    from cco.backends.cuda import CudaBackend

    pytest.importorskip("triton")
    from tests.python.cco.test_triton_gemm import _blockwise_scaled_mm

    sched, _, window = _schedule(monkeypatch, log, gather="bf16", pattern=pattern, quant=quant, world=world,
                                 rank=rank, m_max=m_max)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    if quant == "blockscale":
        monkeypatch.setattr(torch, "_scaled_mm", _blockwise_scaled_mm)  # the CPU build has no blockwise recipe
    monkeypatch.setattr("cco.cuda.dma.CopyEngineSchedule", lambda **kw: sched)
    monkeypatch.setattr(CudaBackend, "watched", False)  # the watchdog's pinned words need a device
    cfg = dataclasses.replace(sched.cfg, mode=mode) if mode != sched.cfg.mode else sched.cfg
    return CudaBackend(config=cfg, comm=None, window=window, deadline_s=1.0), sched


@pytest.mark.parametrize("producer", ["vendor", "kernel"])
@pytest.mark.parametrize("quant, m", [("ptpc", M), ("blockscale", M), ("blockscale", 260), ("mxfp8", 130)],
                         ids=["ptpc", "blockscale-vendor", "blockscale-own-kernel", "mxfp8"])
def test_cuda_backend_reduce_scatter_rows_produces_each_slice_from_its_rows_on_the_host(monkeypatch, quant, m,
                                                                                       producer):
    """The reduce-scatter along rows on the CUDA backend, run on the host: slice d is rows
    d*M/W.. of the product in ``partial[d]``, every counter at its target, the peers' slices before
    the own one; the reduce reads the dest-major planes. The vendor producer: one GEMM per group of
    a dest's chunks (the own kernel where cuBLAS's blockwise recipe refuses the row count), each
    counter released once by a write; the kernel producer (under Triton's interpreter): one tile-table
    launch walking the row slices, whose tiles' adds reach the targets (no write releases them)."""
    from cco import quant as Q
    from cco.preshuffle import preshuffle_b

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern="reduce-scatter-rows", quant=quant)
    backend.producer = producer
    cfg = backend.config
    plan = layout.plan_call(cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
    p = Q.random_problem(m, cfg.n, cfg.k, quant, seed=6)
    backend.partial.fill_(float("nan"))
    backend.fused(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale,
                  out=torch.zeros(*layout.out_shape(cfg, m), dtype=torch.bfloat16), plan=plan)
    sm, want = m // WORLD, p.reference()
    for d in range(WORLD):
        assert Q.count_mismatches(backend.partial[d][:sm], want[d * sm:(d + 1) * sm]) == 0, d
    counter_words = {_addr(sched.counters, i): i for i in range(sched.counters.numel())}
    released = [op[2:] for op in log.ops if op[1] == "write" and op[2] in counter_words and op[3]]
    order = [(_addr(sched.counters, layout.counter_index(d, c)), plan.target(d, c))
             for d in layout.dest_order(RANK, WORLD) for c in range(plan.chunks)]
    if producer == "vendor":
        assert released == order  # the peers' slices first, each (dest, chunk) once
    else:
        assert released == [] and sched.counters.view(WORLD, layout.MAX_CHUNKS).tolist() == [
            list(t) for t in plan.counter_targets]
        table = backend._table(plan).tolist()
        assert [row[1] for row in table] == sorted((row[1] for row in table), key=layout.dest_order(RANK, WORLD).index)
    reduce = [op[2:] for op in log.ops if op[1] == "reduce_kernel"]
    assert reduce == [(rows, sched.partial.data_ptr(), sched.partial.stride(), "no gather", 0) for rows in plan.rows]


@pytest.mark.parametrize("least", [1, "slice", None], ids=["per-chunk", "slice", "rule"])
def test_cuda_backend_reduce_scatter_rows_vendor_gemm_per_group_of_a_slices_chunks(monkeypatch, least):
    """The vendor producer of the reduce-scatter along rows issues one GEMM per group of a dest's
    consecutive chunks (``consumer_groups`` at ``producer_rows``, else ``RS_PRODUCER_ROWS``): its
    rows of A into ``partial[d]``'s rows, then each chunk of the group released once, before the
    next group's GEMM; the peers' slices first. The slices are the product's rows either way."""
    from cco import quant as Q
    from cco.backends.cuda import RS_PRODUCER_ROWS, consumer_groups
    from cco.preshuffle import preshuffle_b

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern="reduce-scatter-rows", quant="ptpc")
    backend.producer = "vendor"
    cfg = backend.config
    _recorded_row_gemms(monkeypatch, backend, log)
    m = M
    plan = layout.plan_call(cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
    assert plan.chunks == 2  # the cases below: a GEMM per chunk, or one per slice (the rule's, at these rows)
    backend.producer_rows = {1: 1, "slice": plan.slice_m, None: None}[least]
    groups = consumer_groups(plan.rows, RS_PRODUCER_ROWS["ptpc"] if least is None else backend.producer_rows)
    assert len(groups) == (plan.chunks if least == 1 else 1)
    p = Q.random_problem(m, cfg.n, cfg.k, "ptpc", seed=9)
    backend.partial.fill_(float("nan"))
    backend.fused(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale,
                  out=torch.zeros(*layout.out_shape(cfg, m), dtype=torch.bfloat16), plan=plan)
    sm, want = plan.slice_m, p.reference()
    for d in range(WORLD):
        assert Q.count_mismatches(backend.partial[d][:sm], want[d * sm:(d + 1) * sm]) == 0, d
    counter_of = {_addr(sched.counters, layout.counter_index(d, c)): (d, c) for d in range(WORLD)
                  for c in range(plan.chunks)}
    seen = [("gemm", op[2], op[3]) if op[1] == "gemm" else ("release", counter_of[op[2]])
            for op in log.ops if op[1] == "gemm" or (op[1] == "write" and op[2] in counter_of and op[3])]
    want_seen = []
    for d in layout.dest_order(RANK, WORLD):
        for c0, c1 in groups:
            r0, r1 = plan.rows[c0][0], plan.rows[c1 - 1][1]
            want_seen += [("gemm", r1 - r0, backend.partial[d][r0:].data_ptr())]
            want_seen += [("release", (d, c)) for c in range(c0, c1)]
    assert seen == want_seen


def test_cuda_backend_reduce_scatter_rows_passes_cublas_aligned_ptpc_scales(monkeypatch):
    """cuBLAS's row-wise fp8 GEMM refuses an A scale vector that does not start on 16 bytes
    (CUBLAS_STATUS_NOT_SUPPORTED on an H200 at M = 6, world 2: the second owner's 3 rows start 12
    bytes into the scales). Here the CPU ``_scaled_mm`` refuses the same way, and the reduce-scatter
    along rows at M = 6 still gives every slice: the backend copies such a scale slice."""
    from cco import quant as Q
    from cco.preshuffle import preshuffle_b
    from kernels_fused.hopper.vendor import SCALE_ALIGNMENT

    real = torch._scaled_mm

    def like_cublas(a, b, *, scale_a, scale_b, **kw):
        if scale_a.numel() > 1 and scale_a.data_ptr() % SCALE_ALIGNMENT:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED: row-wise scale_a not 16-byte aligned")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern="reduce-scatter-rows", quant="ptpc")
    backend.producer = "vendor"  # the GEMMs per (dest, chunk) whose scale slices cuBLAS reads
    monkeypatch.setattr(torch, "_scaled_mm", like_cublas)
    cfg, m = backend.config, 6
    plan = layout.plan_call(cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
    p = Q.random_problem(m, cfg.n, cfg.k, "ptpc", seed=7)
    a_scale = torch.empty(m + 1, dtype=torch.float32)[1:]  # the caller's scales may start anywhere, too
    a_scale.copy_(p.a_scale)
    backend.fused(p.a, preshuffle_b(p.b), a_scale, p.b_scale,
                  out=torch.zeros(*layout.out_shape(cfg, m), dtype=torch.bfloat16), plan=plan)
    sm, want = m // WORLD, p.reference()
    for d in range(WORLD):
        assert Q.count_mismatches(backend.partial[d][:sm], want[d * sm:(d + 1) * sm]) == 0, d


@pytest.mark.parametrize("producer", ["vendor", "kernel"])
def test_cuda_backend_reduce_scatter_cols_runs_the_all_reduce_producers_on_the_host(monkeypatch, producer):
    """The reduce-scatter along columns takes the all-reduce's producers as they are (the vendor GEMM
    into the row-major reading, the tile kernel into the dest-major planes, here under Triton's
    interpreter), and its reduce writes out from column 0 with no gather region."""
    from cco import quant as Q
    from cco.preshuffle import preshuffle_b

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern="reduce-scatter-cols", quant="ptpc")
    backend.producer = producer
    backend.fused_config = dataclasses.replace(backend.fused_config, block_n=128, num_stages=1)  # interpreter-sized
    backend.tile_weight = 1
    cfg, m = backend.config, 200
    plan = layout.plan_call(cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
    p = Q.random_problem(m, cfg.n, cfg.k, "ptpc", seed=9)
    backend.fused(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale,
                  out=torch.zeros(*layout.out_shape(cfg, m), dtype=torch.bfloat16), plan=plan)
    planes = backend.partial_by_rows if producer == "vendor" else backend.partial
    got = torch.cat([planes[d][:m] for d in range(WORLD)], dim=1)
    assert Q.count_mismatches(got, p.reference()) == 0
    reduce = [op[2:] for op in log.ops if op[1] == "reduce_kernel"]
    assert reduce == [(rows, planes.data_ptr(), planes.stride(), "no gather", 0) for rows in plan.rows]


def test_consumer_groups_close_at_the_least_rows_and_fold_a_short_tail():
    from cco.backends.cuda import consumer_groups

    rows = ((0, 128), (128, 256), (256, 384), (384, 500))
    assert consumer_groups(rows, 1) == ((0, 1), (1, 2), (2, 3), (3, 4))  # a GEMM per chunk
    assert consumer_groups(rows, 128) == ((0, 1), (1, 2), (2, 4))  # the last chunk (116 rows) folded in
    assert consumer_groups(rows, 200) == ((0, 2), (2, 4))
    assert consumer_groups(rows, 300) == ((0, 4),)  # 384 rows, then a tail of 116 folded in
    assert consumer_groups(rows, 10 ** 6) == ((0, 4),)  # fewer rows than asked: one GEMM of all
    assert consumer_groups(((0, 64),), 1024) == ((0, 1),)
    assert consumer_groups((), 1024) == ()


def test_rows_producer_reads_the_vendor_gemms_groups_and_takes_the_kernel_where_cublas_refuses():
    """``rows_producer``: the reduce-scatter along rows' producer by the rows of the vendor
    producer's GEMM (a group of a slice's chunks), and the kernel where cuBLAS's blockwise recipe
    does not take the K (the vendor producer's GEMMs would each be the own kernel's launch)."""
    from cco.backends.cuda import RS_PRODUCER_ROWS, RS_ROWS_PRODUCER, dma_producer, rows_producer

    for quant in ("ptpc", "blockscale", "mxfp8"):
        for k in (2048, 2304):  # 16 and 18 scale columns: cuBLAS's blockwise recipe takes the first only
            cfg = layout.build_config(n=4096, k=k, m_max=4096, world=8, quant=quant, transport="dma",
                                      pattern="reduce-scatter-rows")
            rows = layout.chunk_rows(cfg, 4096)
            assert rows[0][1] - rows[0][0] < RS_PRODUCER_ROWS[quant] <= cfg.slice_m_max  # a group of chunks
            per_chunk = rows_producer(cfg, 4096, least=1)
            want = "kernel" if quant == "blockscale" and k == 2304 else dma_producer(quant, 512, RS_ROWS_PRODUCER)
            assert rows_producer(cfg, 4096) == want, (quant, k)
            assert per_chunk == ("kernel" if quant == "blockscale" and k == 2304 else
                                 dma_producer(quant, rows[0][1] - rows[0][0], RS_ROWS_PRODUCER))


@pytest.mark.parametrize("least", [None, 1, "chunk"], ids=["rule", "per-chunk", "chunk-rows"])
@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_cuda_backend_all_gather_gemm_on_the_host(monkeypatch, quant, mode, least):
    """The all-gather on the CUDA backend, run on the host (no bytes move between the recorded
    ranks: the peer's slot holds what the test wrote there): the own rows land in the own slot,
    and ``out`` holds every source's rows times the weight, in rank order, the gathered input too.
    Fused, the GEMMs: the own rows first, then one per group of the peer's chunks
    (``consumer_groups`` at ``consumer_rows``, else ``AG_CONSUMER_ROWS``), each after the wait for its
    group's last chunk and before the next chunk's wait."""
    from cco import quant as Q
    from cco.backends.cuda import AG_CONSUMER_ROWS, consumer_groups
    from cco.preshuffle import preshuffle_b

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern="all-gather", quant=quant, mode=mode)
    cfg = backend.config
    _recorded_row_gemms(monkeypatch, backend, log)
    m = cfg.slice_m_max - (0 if mode == "split" else 4)  # split at full slots: one GEMM of every row
    plan = layout.plan_call(cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
    backend.consumer_rows = min(r1 - r0 for r0, r1 in plan.rows) if least == "chunk" else least
    mine, theirs = (Q.random_problem(m, cfg.n, cfg.k, quant, seed=s) for s in (7, 8))
    peer = 1 - RANK
    rows, scales = sched.a_rows[peer], sched.a_scales[peer]
    rows[:m] = theirs.a  # as the peer's puts would have left them
    backend._scale_rows(scales, 0, m).copy_(theirs.a_scale.reshape(backend._scale_rows(scales, 0, m).shape))
    out = torch.full((WORLD * m, cfg.n), float("nan"), dtype=torch.bfloat16)
    a_all = torch.empty(WORLD * m, cfg.k, dtype=mine.a.dtype)
    s_all = torch.empty(WORLD * m, *mine.a_scale.shape[1:], dtype=mine.a_scale.dtype)
    if quant == "blockscale":  # column-major, as the op's _scale_like makes it
        s_all = torch.empty(cfg.k // 128, WORLD * m).t()
    backend.all_gather_gemm(mine.a, preshuffle_b(mine.b), mine.a_scale, mine.b_scale, out=out, plan=plan,
                            gathered=(a_all, s_all))
    assert torch.equal(sched.a_rows[RANK][:m].view(torch.uint8), mine.a.view(torch.uint8))
    ref = {RANK: mine.reference(),
           peer: Q.Problem(quant, theirs.a, mine.b, theirs.a_scale, mine.b_scale).reference()}
    for src in range(WORLD):
        assert Q.count_mismatches(out[src * m:(src + 1) * m], ref[src]) == 0, src
    assert torch.equal(a_all[peer * m:(peer + 1) * m].view(torch.uint8), theirs.a.view(torch.uint8))
    assert torch.equal(s_all[RANK * m:(RANK + 1) * m].contiguous().view(torch.uint8),
                       mine.a_scale.reshape(s_all[:m].shape).contiguous().view(torch.uint8))
    gemm_free = [op for op in log.ops if op[0] == "main" and op[1] in ("wait", "check_stamps")]
    assert gemm_free[-1][1] == "check_stamps"
    main = [op[1:] for op in log.ops if op[0] == "main"]
    gemms = [op for op in main if op[0] == "gemm"]
    if mode == "split":
        assert [g[1] for g in gemms] == ([WORLD * m] if m == cfg.slice_m_max else [m] * WORLD)
        return
    # the own rows' GEMM on its own stream, issued before the first wait on a peer (module note)
    own = [op[1:] for op in log.ops if op[0] == sched.produce_sides[0].name and op[1] == "gemm"]
    first_wait = next(i for i, op in enumerate(log.ops) if op[0] == "main" and op[1] in ("wait", "wait_block")
                      and op[3] == 1)  # (not the construction's warm-up of the block wait)
    assert log.ops.index((sched.produce_sides[0].name, *own[0])) < first_wait
    gemms = own + gemms
    groups = consumer_groups(plan.rows, AG_CONSUMER_ROWS[quant] if least is None else backend.consumer_rows)
    assert len(groups) == (1 if least is None else plan.chunks if least == 1 else len(groups))
    assert plan.chunks == 2 and (least != "chunk" or len(groups) == 2)  # the cases this test means to cover
    assert gemms == [("gemm", m, out[RANK * m:].data_ptr())] + [
        ("gemm", plan.rows[c1 - 1][1] - plan.rows[c0][0], out[peer * m + plan.rows[c0][0]:].data_ptr())
        for c0, c1 in groups]
    waits = [i for i, op in enumerate(main) if op[0] == "wait" and op[1] in
             [_addr(sched.scatter_flags, layout.counter_index(peer, c)) for c in range(plan.chunks)]]
    for (c0, c1), gemm in zip(groups, gemms[1:]):
        assert waits[c1 - 1] < main.index(gemm) and (c1 == plan.chunks or main.index(gemm) < waits[c1])


def _recorded_row_gemms(monkeypatch, backend, log):
    """The backend's row GEMM, each call logged on the stream it is issued on as (stream name,
    "gemm", rows, output address) before it runs."""
    inner = backend._rows_gemm

    def rows_gemm(b_pre, b_scale):
        gemm = inner(b_pre, b_scale)

        def recorded(a, a_scale, out):
            log.ops.append((log.current.name, "gemm", a.shape[0], out.data_ptr()))
            gemm(a, a_scale, out)
        return recorded

    monkeypatch.setattr(backend, "_rows_gemm", rows_gemm)


# (world, rank, the merged GEMMs' [s0, s1) source ranges): the peers' slots before and after the own one
MERGED = [(4, 0, [(1, 4)]), (4, 1, [(0, 1), (2, 4)]), (4, 3, [(0, 3)]), (2, 0, [(1, 2)]), (2, 1, [(0, 1)])]


@pytest.mark.parametrize("case", ["merged", "pad-rows", "groups", "forced-off"])
@pytest.mark.parametrize("world, rank, ranges", MERGED, ids=[f"W{w}-rank{r}" for w, r, _ in MERGED])
@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_all_gather_merges_the_peers_gemms_after_the_last_wait(monkeypatch, quant, world, rank, ranges, case):
    """The all-gather's fused consumer on the host, 2 chunks per peer. Where each peer's rows are one
    group (``AG_CONSUMER_ROWS`` > a peer's rows) and the call fills the slots (m == m_max_padded, no
    pad rows between them): the own rows' GEMM, then one wait for every peer's every chunk (a block
    wait: every flag of the call but the own row's), then one GEMM per run of peer slots on each side of the own one,
    covering every peer row exactly once. Otherwise (pad rows; two groups per peer;
    ``consumer_merge=False``) today's GEMM per group, after its last chunk's wait. ``out`` is every
    source's rows times the weight in each case (the merged block's scales: ptpc's rows,
    blockscale's ``[K/128, rows]`` slots joined, mxfp8's ``[rows, K/32]``)."""
    from cco import quant as Q
    from cco.backends.cuda import consumer_groups
    from cco.preshuffle import preshuffle_b

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern="all-gather", quant=quant, world=world, rank=rank,
                                   m_max=256 * world)
    cfg = backend.config
    _recorded_row_gemms(monkeypatch, backend, log)
    m = cfg.m_max_padded - (4 if case == "pad-rows" else 0)
    plan = layout.plan_call(cfg, m=m, seq=1, rank=rank, counter_base=layout.zero_counters(world))
    assert plan.chunks == 2 and cfg.m_max_padded == 256
    backend.consumer_rows = 128 if case == "groups" else None  # a group per chunk
    backend.consumer_merge = False if case == "forced-off" else None
    inputs = [Q.random_problem(m, cfg.n, cfg.k, quant, seed=10 + src) for src in range(world)]
    for src in range(world):  # the peers' rows where their puts would have left them
        if src != rank:
            rows, scales = sched.a_rows[src], sched.a_scales[src]
            rows[:m] = inputs[src].a
            into = backend._scale_rows(scales, 0, m)
            into.copy_(inputs[src].a_scale.reshape(into.shape))
    mine = inputs[rank]
    out = torch.full((world * m, cfg.n), float("nan"), dtype=torch.bfloat16)
    backend.all_gather_gemm(mine.a, preshuffle_b(mine.b), mine.a_scale, mine.b_scale, out=out, plan=plan)
    for src in range(world):
        want = Q.Problem(quant, inputs[src].a, mine.b, inputs[src].a_scale, mine.b_scale).reference()
        assert Q.count_mismatches(out[src * m:(src + 1) * m], want) == 0, src

    def at(row):  # a GEMM's output address -> its first row of out
        return out[row:].data_ptr()

    flags = {_addr(sched.scatter_flags, layout.counter_index(src, c)): (src, c)
             for src in range(world) for c in range(plan.chunks)}
    own = sched.produce_sides[0].name  # the own rows' GEMM's stream (module note), the rest on the call's
    assert [op[1:] for op in log.ops if op[0] == own and op[1] == "gemm"] == [("gemm", m, at(rank * m))]
    got = [op[1:] for op in log.ops if op[0] in ("main", own) and (
        op[1] == "gemm" or op[1] == "wait" and op[2] in flags or op[1] == "wait_block" and set(op[2]) <= set(flags))]
    order = [(src, c) for c in range(plan.chunks) for src in layout.input_order(rank, world)[1:]]
    want = [("gemm", m, at(rank * m))]
    groups = consumer_groups(plan.rows, 128 if case == "groups" else 10 ** 6)
    assert len(groups) == (2 if case == "groups" else 1)
    if case == "merged":  # one wait for every peer's every chunk, then the merged GEMMs
        want.append(("wait_block", tuple(sorted(a for a, (src, c) in flags.items() if src != rank)), 1))
        want += [("gemm", (s1 - s0) * m, at(s0 * m)) for s0, s1 in ranges]
    for src, c in order if case != "merged" else ():
        want.append(("wait", _addr(sched.scatter_flags, layout.counter_index(src, c)), 1))
        want += [("gemm", plan.rows[c1 - 1][1] - plan.rows[c0][0], at(src * m + plan.rows[c0][0]))
                 for c0, c1 in groups if c1 - 1 == c]
    got = [(op[0], tuple(sorted(op[1])), op[2]) if op[0] == "wait_block" else op for op in got]
    assert got == want
    covered = sorted(row for op in got[1:] if op[0] == "gemm"
                     for row in range((op[2] - out.data_ptr()) // out.stride(0) // 2,
                                      (op[2] - out.data_ptr()) // out.stride(0) // 2 + op[1]))
    assert covered == sorted(set(range(world * m)) - set(range(rank * m, (rank + 1) * m)))  # each peer row once
    if case == "merged":
        assert len(got) - 1 == 1 + (1 if rank in (0, world - 1) else 2)


def test_all_gather_merge_forced_on_needs_slots_without_pad_rows(monkeypatch):
    """``consumer_merge=True`` merges even two groups per peer (the benchmark's forced arm), and
    refuses a call whose slots hold pad rows (its peers' rows are no one block) before any work."""
    from cco import quant as Q
    from cco.preshuffle import preshuffle_b

    log = _Log()
    backend, sched = _host_backend(monkeypatch, log, pattern="all-gather", quant="ptpc", world=4, rank=1,
                                   m_max=1024)
    _recorded_row_gemms(monkeypatch, backend, log)
    cfg = backend.config
    backend.consumer_merge, backend.consumer_rows = True, 1  # a group per chunk, merged all the same
    for m, gemms in ((cfg.m_max_padded, [256, 256, 512]), (cfg.m_max_padded - 4, None)):
        plan = layout.plan_call(cfg, m=m, seq=1, rank=1, counter_base=layout.zero_counters(4))
        p = Q.random_problem(m, cfg.n, cfg.k, "ptpc", seed=3)
        out = torch.empty(4 * m, cfg.n, dtype=torch.bfloat16)
        log.ops.clear()
        if gemms is None:
            with pytest.raises(ValueError, match="m_max_padded"):
                backend.all_gather_gemm(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale, out=out, plan=plan)
            assert log.ops == []
        else:
            backend.all_gather_gemm(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale, out=out, plan=plan)
            assert [op[2] for op in log.ops if op[1] == "gemm"] == gemms


def _specialization(fn, args, kwargs) -> tuple:
    """Which compiled kernel Triton picks for these arguments of the JIT function ``fn``: the
    constexprs' values, each tensor's dtype and 16-byte alignment, each specialized int's "is 1" and
    "divisible by 16" (``do_not_specialize``: none), and the launch options."""
    import inspect

    params = list(inspect.signature(fn.fn).parameters.values())  # a JITFunction or the interpreter's
    names = [p.name for p in params]
    free = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize", ())
    key = []
    for param, value in zip(params, args + tuple(kwargs[name] for name in names[len(args):])):
        if "constexpr" in str(param.annotation):
            key.append((param.name, value))
        elif isinstance(value, torch.Tensor):
            key.append((param.name, value.dtype, value.data_ptr() % 16 == 0))
        elif param.name in free:
            key.append((param.name, "int"))
        else:
            key.append((param.name, value == 1, value % 16 == 0))
    return tuple(key) + tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))


@pytest.mark.parametrize("gather", ["bf16", "fp8"])
def test_side_kernels_are_loaded_before_any_call_launches_them(monkeypatch, gather):
    """A call's reduce and dequant kernels run behind waits on peers: each launch must pick a kernel
    ``load_kernels()`` loaded when the schedule was built, for every M, chunk, producer layout and
    programs setting (a launch that needs another one loads it mid-call: the ranks can deadlock)."""
    from cco.backends.base import row_major_readings
    from cco.cuda import dma, kernels

    log = _Log()
    sched, _, _ = _schedule(monkeypatch, log, gather=gather)
    monkeypatch.setattr(dma, "kernels", kernels)
    loaded, launched = set(), []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def warmup(self, *args, grid, **kwargs):
            loaded.add((self.fn.__name__, _specialization(self.fn, args, kwargs)))
            return types.SimpleNamespace(_init_handles=lambda: None)

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.fn.__name__, _specialization(self.fn, args, kwargs)))

    real = kernels._kernels()
    monkeypatch.setattr(kernels, "_kernels", lambda: tuple(Recorder(fn) for fn in real))
    by_rows = row_major_readings(sched.partial, sched.cfg)[1]
    sched.load_kernels((sched.partial, by_rows))
    assert {name for name, _ in loaded} == {"_reduce", "_dequant"}
    for programs in (None, 7):
        sched.side_programs = programs
        for m in (1, 17, 128, 300, M):
            plan = layout.plan_call(sched.cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
            for partial in (sched.partial, by_rows):
                sched.begin(plan)
                sched.run(plan, torch.zeros(m, sched.cfg.n, dtype=torch.bfloat16), after_gemm=False, partial=partial)
    assert {name for name, _ in launched} == {"_reduce", "_dequant"}  # bf16: dequant with programs set
    missing = [launch for launch in launched if launch not in loaded]
    assert not missing, f"{len(missing)} of {len(launched)} launches need a kernel not loaded: {missing[0]}"


# --------------------------------------------------------------------------------------------------
# the sequence-parallel patterns on the same schedule
# --------------------------------------------------------------------------------------------------
def _peer_words(sched, window, region, peer, index):
    return _addr(window.words(getattr(sched.cfg.window, region), rank=peer), index)


@pytest.mark.parametrize("scatters_first", [True, False], ids=["scatters-first", "interleaved"])
@pytest.mark.parametrize("pattern", ["reduce-scatter-cols", "reduce-scatter-rows"])
def test_reduce_scatter_runs_the_all_reduce_steps_without_the_gathers_data(monkeypatch, pattern, scatters_first):
    """The reduce-scatter on the copy engines: the all-reduce's scatter and reduce, its reduce
    writing ``out`` at column 0 and no ``gather`` region; no gather data, no assemble copy. Guards
    the end of the call: a rank tells each peer it finished (one flag into ``gather_flags[rank, 0]``)
    only after its last chunk is reduced, and waits for every peer's word (then zeroes it) before
    the call leaves; without that a rank whose own slice was complete returned while a peer failed
    the same call (its put lost), and the ranks' verdicts differed."""
    log = _Log()
    sched, plan, window = _schedule(monkeypatch, log, gather="bf16", pattern=pattern)
    sched.flag_by_copy = True
    peer = 1 - RANK
    out = torch.zeros(*layout.out_shape(sched.cfg, plan.m), dtype=torch.bfloat16)
    sched.begin(plan)
    sched.run(plan, out, after_gemm=False, scatters_first=scatters_first)
    assert plan.chunks == (4 if pattern.endswith("cols") else 2)
    reduce = [op[1:] for op in log.ops if op[0] == sched.reduce.name and op[1] == "reduce_kernel"]
    assert reduce == [("reduce_kernel", rows, sched.partial.data_ptr(), sched.partial.stride(), "no gather", 0)
                      for rows in plan.rows]
    assert not any(op[1] == "dequant_kernel" for op in log.ops)
    gather = sched.peer[peer]["gather"]
    assert gather.numel() == 0 and sched.gather.numel() == 0  # the layout gives the pattern no gather region
    put = [op[1:] for op in log.ops if op[0] == sched.put[peer][0].name]
    done = ("copy", _peer_words(sched, window, "gather_flags", peer, layout.counter_index(RANK, 0)),
            sched.flag_set.data_ptr(), 8)
    assert put.count(done) == 1
    last_reduced = ("wait_event", sched.reduced[plan.chunks - 1].name)
    assert put.index(last_reduced) < put.index(done)
    last_scatter_flag = max(i for i, op in enumerate(put) if op[0] == "copy" and op[3] == 8 and op != done)
    assert last_scatter_flag < put.index(done)
    assemble = [op[1:] for op in log.ops if op[0] == sched.assemble.name]
    flag = _addr(sched.gather_flags, layout.counter_index(peer, 0))
    assert [op for op in assemble if op[0] in ("wait", "write", "fill", "copy", "copy_2d")] == [("wait", flag, 1),
                                                                                                ("fill", flag, 0, 8)]
    # the reduce's own stream still consumes every scatter flag once
    for c in range(plan.chunks):
        word = _addr(sched.scatter_flags, layout.counter_index(peer, c))
        reduce_ops = [op[1:] for op in log.ops if op[0] == sched.reduce.name]
        assert reduce_ops.index(("wait", word, 1)) < reduce_ops.index(("fill", word, 0, 8))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_all_gather_puts_rows_before_any_wait_and_consumes_each_chunk_after_its_flag(monkeypatch, quant, fused):
    """The all-gather on the copy engines (``gather_inputs``). Guards: every put (data, then its flag;
    the stamp before the first flag) is submitted before the call's first wait, and each put stream
    starts only after the own rows are in the window (``inputs_ready``); a chunk's GEMM is enqueued
    after the wait for its flag (fused), or every GEMM after every wait (split); each source's flags
    of the call are zeroed by their one waiter with one memset after the call's last wait and
    before the peers are told (nothing else in the window zeroed); the call ends by telling every peer and waiting for each, and the stamp
    check runs after every wait. The scales go as a 2-D copy where the slot is column blocks
    (blockscale)."""
    log = _Log()
    sched, plan, window = _schedule(monkeypatch, log, gather="bf16", pattern="all-gather", quant=quant)
    sched.flag_by_copy = True
    peer, cfg = 1 - RANK, sched.cfg
    out = torch.zeros(*layout.out_shape(cfg, plan.m), dtype=torch.bfloat16)
    assert [op[1] for op in log.ops] == ["wait_block"]  # the construction's warm-up of the block wait
    del log.ops[:]
    sched.begin(plan)

    def consume(src, c):
        log.ops.append((log.current.name, "gemm", src, c))

    sched.gather_inputs(plan, out=out, consume_own=(lambda: consume(RANK, None)) if fused else None,
                        consume=consume if fused else None,
                        consume_all=None if fused else (lambda: consume(None, None)))
    assert plan.chunks == 2
    main = [op[1:] for op in log.ops if op[0] == "main"]
    put = [op[1:] for op in log.ops if op[0] == sched.put[peer][0].name]

    def waited(op):  # the words a wait of main waits for: a stream wait's one, a block wait's every one
        return {op[1]} if op[0] == "wait" else set(op[1]) if op[0] == "wait_block" else set()

    def wait_for(word):  # main's index of the wait for ``word`` (exactly one)
        (i,) = [i for i, op in enumerate(main) if word in waited(op) and op[-1] == 1]
        return i

    assert put[0] == ("wait_event", sched.inputs_ready.name)
    assert main.index(("record", sched.inputs_ready.name)) < wait_for(_addr(
        sched.scatter_flags, layout.counter_index(peer, 0)))
    first_wait = next(i for i, op in enumerate(log.ops) if op[0] == "main" and op[1] in ("wait", "wait_block"))
    last_put = max(i for i, op in enumerate(log.ops) if op[0] == sched.put[peer][0].name and op[1] != "record")
    assert last_put < first_wait  # submitted before any wait that (through the peer) depends on it
    rows_slot, scale_slot = sched.peer[peer]["a_rows"][RANK], sched.peer[peer]["a_scales"][RANK]
    stamp = ("copy", _peer_words(sched, window, "scatter_m", peer, RANK), sched.stamp.data_ptr(), 8)
    assert put.index(stamp) < min(i for i, op in enumerate(put) if op[0] == "copy" and op[3] == 8 and op != stamp)
    for c, (r0, r1) in enumerate(plan.rows):
        rows = ("copy", rows_slot.data_ptr() + r0 * cfg.k, sched.a_rows[RANK].data_ptr() + r0 * cfg.k,
                (r1 - r0) * cfg.k)
        if quant == "blockscale":
            pitch = scale_slot.stride(0) * 4
            scales = ("copy_2d", scale_slot.data_ptr() + r0 * 4, pitch, sched.a_scales[RANK].data_ptr() + r0 * 4,
                      pitch, (r1 - r0) * 4, cfg.k // 128)
        else:
            row = scale_slot[0].numel() * scale_slot.element_size()
            scales = ("copy", scale_slot.data_ptr() + r0 * row, sched.a_scales[RANK].data_ptr() + r0 * row,
                      (r1 - r0) * row)
        flag = ("copy", _peer_words(sched, window, "scatter_flags", peer, layout.counter_index(RANK, c)),
                sched.flag_set.data_ptr(), 8)
        assert put.index(rows) < put.index(flag) and put.index(scales) < put.index(flag)
        word = _addr(sched.scatter_flags, layout.counter_index(peer, c))
        wait = wait_for(word)
        if fused:
            assert main[wait][0] == "wait" and wait < main.index(("gemm", peer, c))  # a stream wait per chunk
            later = [i for i, op in enumerate(main) if op[0] == "wait" and i > wait]
            assert not later or main.index(("gemm", peer, c)) < later[0]  # consumed as it lands
    flag_words = {_addr(sched.scatter_flags, i) for i in range(sched.scatter_flags.numel())}
    if fused:  # the own rows' GEMM on a stream of its own, started after the own rows are in the
        # window (inputs_ready) and before any wait (so beside the puts and the peers' GEMMs), joined
        # into the call's stream before the stamp check writes out
        own = sched.produce_sides[0].name
        own_ops = [op[1:] for op in log.ops if op[0] == own]
        assert own_ops == [("wait_event", sched.inputs_ready.name), ("gemm", RANK, None),
                           ("record", sched.produced[0].name)]
        at = log.ops.index((own, "gemm", RANK, None))
        assert at < next(i for i, op in enumerate(log.ops) if op[0] == "main" and op[1] in ("wait", "wait_block"))
        assert ("gemm", RANK, None) not in main
        assert main.index(("wait_event", sched.produced[0].name)) < main.index(("check_stamps", out.data_ptr()))
    else:  # one wait for every chunk (nothing consumed before all are in), then the GEMM
        (block,) = [op for op in main if waited(op) & flag_words]
        assert block == ("wait_block", tuple(_addr(sched.scatter_flags, layout.counter_index(peer, c))
                                             for c in range(plan.chunks)), 1)
        assert main.index(("gemm", None, None)) > main.index(block)
    done = ("copy", _peer_words(sched, window, "gather_flags", peer, layout.counter_index(RANK, 0)),
            sched.flag_set.data_ptr(), 8)
    # the source's flags of the call: one memset, after its last wait (the call's last scatter-flag
    # wait) and before the peer is told this rank has its rows; no other scatter flag is touched
    zero = ("fill", _addr(sched.scatter_flags, layout.counter_index(peer, 0)), 0, plan.chunks * 8)
    assert [op for op in main if op[0] in ("fill", "write") and op[1] in flag_words] == [zero]
    last_flag_wait = max(i for i, op in enumerate(main) if waited(op) & flag_words)
    assert last_flag_wait < main.index(zero) < main.index(done)
    finish = _addr(sched.gather_flags, layout.counter_index(peer, 0))
    gemms = [i for i, op in enumerate(main) if op[0] == "gemm"]
    assert max(gemms) < main.index(done) < wait_for(finish) < main.index(("fill", finish, 0, 8))
    check = main.index(("check_stamps", out.data_ptr()))
    assert check > main.index(("fill", finish, 0, 8)) and check > main.index(("wait_event", sched.done[
        sched.put[peer][0]].name))


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_all_gather_zeroes_every_sources_flags_and_the_peers_finish_words_with_one_memset_each(monkeypatch, rank):
    """At four ranks the all-gather's main stream zeroes the call's scatter flags of all three
    sources with ONE memset spanning their rows (after the last wait, before any peer is told), and
    the three peers' finish words with one (after the end's block wait, before the stamp check):
    two memsets where six were issued. The span covers exactly the rows from the lowest source to
    the highest, its last row up to the call's chunks; no other word of the window is zeroed."""
    log = _Log()
    world = 4
    sched, plan, window = _schedule(monkeypatch, log, gather="bf16", pattern="all-gather", world=world, rank=rank)
    sched.flag_by_copy = True
    out = torch.zeros(*layout.out_shape(sched.cfg, plan.m), dtype=torch.bfloat16)
    del log.ops[:]
    sched.begin(plan)
    sched.gather_inputs(plan, out=out, consume_own=lambda: None, consume=None,
                        consume_all=lambda: log.ops.append((log.current.name, "gemm")))
    main = [op[1:] for op in log.ops if op[0] == "main"]
    sources = [s for s in range(world) if s != rank]
    lo, hi = min(sources), max(sources)
    fills = [op for op in main if op[0] == "fill"]
    scatter = ("fill", _addr(sched.scatter_flags, layout.counter_index(lo, 0)), 0,
               (layout.counter_index(hi, plan.chunks - 1) + 1 - layout.counter_index(lo, 0)) * 8)
    finish = ("fill", _addr(sched.gather_flags, layout.counter_index(lo, 0)), 0,
              (layout.counter_index(hi, 0) + 1 - layout.counter_index(lo, 0)) * 8)
    assert fills == [scatter, finish]
    blocks = [i for i, op in enumerate(main) if op[0] == "wait_block"]
    assert len(blocks) == 2  # every peer's rows, then every peer's finish word
    told = [i for i, op in enumerate(main) if op[0] == "copy" and op[3] == 8 and op[1] in {
        _peer_words(sched, window, "gather_flags", p, layout.counter_index(rank, 0)) for p in sources}]
    assert len(told) == 3
    assert blocks[0] < main.index(scatter) < min(told) and max(told) < blocks[1] < main.index(finish)
    assert main.index(finish) < main.index(("check_stamps", out.data_ptr()))


# --------------------------------------------------------------------------------------------------
# the sequence-parallel schedules run by two ranks on the host: streams, events and memory
# operations executed, not only recorded
# --------------------------------------------------------------------------------------------------
class _Sim:
    """Every rank's streams as in-order queues of host closures, run until each is empty: a wait
    (a stream wait-value, or an event's record as it was when the wait was enqueued) blocks its
    stream only; copies and writes act on the ranks' host windows at their addresses. Each step
    runs the head of one stream picked at random among those that can move (``seed``): a missing
    wait shows as a read of bytes not yet written under some interleaving. A state in which no
    stream can move is a deadlock (on a GPU: a call that hangs until its deadline)."""

    def __init__(self):
        self.queues: dict = {}  # stream -> [(ready, act)]
        self.mains: dict = {}
        self.seed = 0

    def enqueue(self, stream, act, ready=lambda: True):
        self.queues.setdefault(stream, []).append((ready, act))

    def run(self) -> None:
        import random

        pick = random.Random(self.seed)
        while any(self.queues.values()):
            ready = [q for q in self.queues.values() if q and q[0][0]()]
            if not ready:
                stuck = {s.name: len(q) for s, q in self.queues.items() if q}
                raise AssertionError(f"deadlock: streams {stuck} cannot move")
            pick.choice(ready).pop(0)[1]()

    def cuda(self):
        sim = self

        class Stream:
            def __init__(self, device=None, priority=0, name="side"):
                self.name, self.cuda_stream = f"{name}{id(self) % 9973}", self

            @staticmethod
            def priority_range():
                return 0, -1

            def wait_event(self, event):
                version = event.enqueued
                sim.enqueue(self, lambda: None, lambda: event.done >= version)

        class Event:
            def __init__(self):
                self.enqueued = self.done = 0

            def record(self, stream=None):
                stream = stream or sim.current
                self.enqueued += 1
                version = self.enqueued

                def act():
                    self.done = max(self.done, version)
                sim.enqueue(stream, act)

        @contextlib.contextmanager
        def stream(s):
            before, sim.current = sim.current, s
            try:
                yield
            finally:
                sim.current = before

        self.Stream = Stream
        return types.SimpleNamespace(Stream=Stream, Event=Event, stream=stream, current_stream=lambda: sim.current,
                                     device=lambda device: contextlib.nullcontext(),
                                     is_current_stream_capturing=lambda: False, synchronize=lambda device=None: None)

    def memops(self):
        import ctypes

        sim = self

        def word(addr):
            return ctypes.c_int64.from_address(addr)

        class Memops:
            def capture_supported(self, index):
                return True

            def wait_geq(self, stream, addr, value):
                sim.enqueue(stream, lambda: None, lambda: word(addr).value >= value)

            def write(self, stream, addr, value):
                sim.enqueue(stream, lambda: setattr(word(addr), "value", value))

            def fill(self, stream, dst, byte, nbytes):
                sim.enqueue(stream, lambda: ctypes.memset(dst, byte, nbytes))

            def wait_block_kernel(self, stream, words, row, rows, cols, skip, value):
                at = [s * row + c for s in range(*rows) if s != skip for c in range(*cols)]
                # a launch on the current stream; the tensor is read when the wait is tested (kept alive)
                sim.enqueue(sim.current, lambda: None,
                            lambda: all(word(words.data_ptr() + i * 8).value >= value for i in at))

            def copy(self, stream, dst, src, nbytes):
                sim.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

            def copy_2d(self, stream, *, dst, dst_pitch, src, src_pitch, width, height):
                def act():
                    for row in range(height):
                        ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
                sim.enqueue(stream, act)

        return Memops()


SIM_SEEDS = 12  # interleavings per case


def _sim_ranks(monkeypatch, *, pattern, quant="ptpc", world=WORLD, chunks=3):
    """Every rank's CopyEngineSchedule over shared host windows, driven by one :class:`_Sim`; the
    reduce and stamp-check kernels are torch closures enqueued on their streams."""
    from cco.cuda import dma
    from cco.window import Window

    sim = _Sim()
    cfg = layout.build_config(n=256 * world, k=256, m_max=M, world=world, quant=quant, transport="dma",
                              block_m=64, block_n=128, pattern=pattern, chunks=chunks)
    buffers = [torch.zeros(cfg.window.nbytes, dtype=torch.uint8) for _ in range(world)]

    class HostWindow(Window):
        def __init__(self, rank):
            super().__init__(comm=types.SimpleNamespace(rank=rank, world=world), layout=cfg.window)

        @property
        def device(self):
            return torch.device("cpu")

        def _raw(self, rank):
            return buffers[rank]

        def _release(self):
            pass

    def reduce_chunk(*, partial, recv, gather, out, scatter_m, status, rank, rows, stamp, out_col0=None, **_):
        r0, r1 = rows

        def act():
            bad = [s for s in range(world) if s != rank and int(scatter_m[s]) != int(stamp[0])]
            acc = partial[rank][r0:r1].float() + sum(recv[s][r0:r1].float() for s in range(world) if s != rank)
            if bad:
                acc.fill_(float("nan"))
                status[0], status[1] = 1 + bad[0], scatter_m[bad[0]]
            ns = recv.shape[2]
            col0 = rank * ns if out_col0 is None else out_col0
            out[r0:r1, col0:col0 + ns] = acc.to(torch.bfloat16)
            if gather is not None:
                gather[rank][r0:r1] = acc.to(torch.bfloat16)
        sim.enqueue(sim.current, act)

    def check_stamps(*, out, scatter_m, status, stamp, rank, world, **_):
        def act():
            bad = [s for s in range(world) if s != rank and int(scatter_m[s]) != int(stamp[0])]
            if bad:
                out.fill_(float("nan"))
                status[0], status[1] = 1 + bad[0], scatter_m[bad[0]]
        sim.enqueue(sim.current, act)

    cuda = sim.cuda()
    monkeypatch.setattr(dma, "torch", types.SimpleNamespace(zeros=torch.zeros, full=torch.full, empty=torch.empty,
                                                            int64=torch.int64, bfloat16=torch.bfloat16, cuda=cuda))
    monkeypatch.setattr(dma, "current_stream", cuda.current_stream)
    monkeypatch.setattr(dma, "kernels", types.SimpleNamespace(reduce_chunk=reduce_chunk, check_stamps=check_stamps,
                                                              dequant_chunk=lambda **kw: None))
    memops = sim.memops()
    scheds = []
    for rank in range(world):
        sim.current = sim.mains[rank] = cuda.Stream(name=f"main{rank}-")
        scheds.append(dma.CopyEngineSchedule(config=cfg, window=HostWindow(rank), device=torch.device("cpu"),
                                             memops=memops, flag_by_copy=True))
    return sim, cfg, scheds


def _on(sim, stream, act):
    sim.enqueue(stream, act)


@pytest.mark.parametrize("calls", [(M, M), (M - 70, 6, M - 70)], ids=["same-M", "alternating-M"])
@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("pattern", ["reduce-scatter-rows", "reduce-scatter-cols"])
def test_reduce_scatter_schedule_delivers_every_slice_on_two_host_ranks(monkeypatch, pattern, mode, calls):
    """Both ranks' reduce-scatter schedules executed together: every rank's output is the sum of
    every rank's slice (bits of the fp32 sum of the bf16 partials), call after call with other Ms and
    other data, every flag and counter consumed (zero) once the calls are done, no deadlock. The
    producer writes its rows when its stream runs them, so a put that read too early moves stale
    rows and the sum is wrong."""
    for seed in range(SIM_SEEDS):
        _reduce_scatter_calls(monkeypatch, pattern, mode, calls, seed)


def _reduce_scatter_calls(monkeypatch, pattern, mode, calls, seed):
    sim, cfg, scheds = _sim_ranks(monkeypatch, pattern=pattern)
    sim.seed = seed
    for seq, m in enumerate(calls, start=1):
        plans = [layout.plan_call(cfg, m=m, seq=seq, rank=r, counter_base=layout.zero_counters(WORLD))
                 for r in range(WORLD)]
        sm, ns = plans[0].slice_m, cfg.n_slice
        partials = [torch.randn(WORLD, sm, ns, generator=torch.Generator().manual_seed(10 * seq + r)).bfloat16()
                    for r in range(WORLD)]  # rank r's partial of each owner d's slice
        outs = [torch.full(layout.out_shape(cfg, m), float("nan"), dtype=torch.bfloat16) for _ in range(WORLD)]
        for r, (sched, plan) in enumerate(zip(scheds, plans)):
            sim.current = main = sim.mains[r]
            _on(sim, main, lambda s=sched: s.counters.zero_())
            sched.begin(plan)

            def unit(d, c, r=r, sched=sched, plan=plan):
                r0, r1 = plan.rows[c]
                return lambda: _on(sim, sim.current, lambda: sched.partial[d][r0:r1].copy_(partials[r][d][r0:r1]))

            sched.produce(plan, [(unit(d, c), [(d, c)]) for d in layout.dest_order(r, WORLD)
                                 for c in range(plan.chunks)])
            sched.run(plan, outs[r], after_gemm=mode == "split", scatters_first=True)
        sim.run()
        for r in range(WORLD):
            want = sum(partials[s][r].float() for s in range(WORLD)).to(torch.bfloat16)
            assert torch.equal(outs[r], want), (seed, seq, r)
            for name in ("scatter_flags", "gather_flags"):
                assert not getattr(scheds[r], name).any(), (seq, r, name)


@pytest.mark.parametrize("mode", ["fused", "split", "merged"])
@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_all_gather_schedule_delivers_every_rows_chunk_on_two_host_ranks(monkeypatch, quant, mode):
    """Both ranks' all-gather schedules executed together (the "GEMM" copies the slot's rows it
    consumes into ``out``): every rank ends with every rank's rows and scales bit-exact in rank
    order, call after call with other Ms, every flag consumed; a rank's rows copied into its slot
    after the puts were enqueued still reach the peers (the ``inputs_ready`` gate). ``merged``: the
    own rows consumed first, then every peer's after one block wait (the backend's merged consumer);
    at four ranks too, whose end waits for three peers with one block wait."""
    for seed in range(SIM_SEEDS):
        _all_gather_calls(monkeypatch, quant, mode, seed)
        if mode != "fused":
            _all_gather_calls(monkeypatch, quant, mode, seed, world=4)


def _all_gather_calls(monkeypatch, quant, mode, seed, world=WORLD):
    sim, cfg, scheds = _sim_ranks(monkeypatch, pattern="all-gather", quant=quant, world=world)
    sim.seed = seed
    k = cfg.k
    for seq, m in enumerate((cfg.slice_m_max, 70, 3), start=1):
        plans = [layout.plan_call(cfg, m=m, seq=seq, rank=r, counter_base=layout.zero_counters(world))
                 for r in range(world)]
        rows = [torch.randint(0, 120, (m, k), generator=torch.Generator().manual_seed(10 * seq + r), dtype=torch.uint8)
                for r in range(world)]
        outs = [torch.full((world * m, k), 255, dtype=torch.uint8) for _ in range(world)]
        for r, (sched, plan) in enumerate(zip(scheds, plans)):
            sim.current = main = sim.mains[r]
            sched.begin(plan)
            slot = sched.a_rows[r].view(torch.uint8)
            scales = sched.a_scales[r].view(torch.uint8)
            _on(sim, main, lambda slot=slot, r=r: slot[:m].copy_(rows[r]))
            _on(sim, main, lambda scales=scales, r=r, seq=seq: scales.fill_(seq * 16 + r))

            def consume(src, c, r=r, sched=sched, plan=plan):
                r0, r1 = plan.rows[c] if c is not None else (0, m)
                _on(sim, sim.current, lambda: outs[r][src * m + r0:src * m + r1].copy_(
                    sched.a_rows[src].view(torch.uint8)[r0:r1]))

            def every(r=r, peers_only=False):
                for src in range(world):
                    if not (peers_only and src == r):
                        consume(src, None, r=r)
            sched.gather_inputs(plan, out=torch.zeros(world * m, 4, dtype=torch.bfloat16),
                                consume_own=(lambda: consume(r, None)) if mode != "split" else None,
                                consume=consume if mode == "fused" else None,
                                consume_all={"fused": None, "split": every,
                                             "merged": lambda r=r: every(r, peers_only=True)}[mode])
        sim.run()
        for r in range(world):
            assert torch.equal(outs[r], torch.cat(rows)), (seed, seq, r)
            for src in range(world):
                got = scheds[r].a_scales[src].view(torch.uint8)
                got = got[:, :m] if quant == "blockscale" else got[:m]
                assert (got == seq * 16 + src).all(), (seq, r, src)
            for name in ("scatter_flags", "gather_flags"):
                assert not getattr(scheds[r], name).any(), (seq, r, name)
            assert int(scheds[r].status[0]) == 0
