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

    def copy(self, stream, dst, src, nbytes):
        self.log.ops.append((stream, "copy", dst, src, nbytes))

    def copy_2d(self, stream, *, dst, dst_pitch, src, src_pitch, width, height):
        self.log.ops.append((stream, "copy_2d", dst, dst_pitch, src, src_pitch, width, height))


def _schedule(monkeypatch, log, *, gather, lanes=1, world=WORLD):
    from cco.cuda import dma
    from cco.window import Window

    cfg = layout.build_config(n=512 * world, k=256, m_max=M, world=world, quant="ptpc", transport="dma",
                              gather_dtype=gather, block_m=128, block_n=128)

    class HostWindow(Window):
        def __init__(self):
            super().__init__(comm=types.SimpleNamespace(rank=RANK, world=world), layout=cfg.window)
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
            log.ops.append((log.current.name, name, kw["rows"]) + planes)
        return launch

    monkeypatch.setattr(dma, "torch", types.SimpleNamespace(zeros=torch.zeros, full=torch.full, empty=torch.empty,
                                                            int64=torch.int64, bfloat16=torch.bfloat16,
                                                            cuda=_fake_cuda(log)))
    monkeypatch.setattr(dma, "kernels", types.SimpleNamespace(reduce_chunk=kernel("reduce_kernel"),
                                                              dequant_chunk=kernel("dequant_kernel")))
    window = HostWindow()
    sched = dma.CopyEngineSchedule(config=cfg, window=window, device=torch.device("cpu"), memops=_Memops(log),
                                   lanes=lanes)
    plan = layout.plan_call(cfg, m=M, seq=1, rank=RANK, counter_base=layout.zero_counters(world))
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
        flag_zero = ("write", _addr(sched.scatter_flags, layout.counter_index(peer, c)), 0)
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


@pytest.mark.parametrize("m, producer", [(128, "vendor"), (130, "kernel")])
def test_cuda_backend_takes_the_kernel_producer_where_cublas_refuses_the_rows(monkeypatch, m, producer):
    """blockscale: cuBLAS's blockwise recipe refuses row counts that are not a multiple of 4
    (``kernels_fused.hopper.vendor.takes_rows``); a call with such an M runs the fused Triton kernel
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
    cfg = layout.build_config(n=sched.cfg.n, k=256, m_max=M, world=WORLD, quant="blockscale", transport="dma",
                              block_m=64, block_n=128)
    backend = CudaBackend(config=cfg, comm=None, window=window, deadline_s=1.0)
    backend.producer = "vendor"
    backend.fused_config = dataclasses.replace(backend.fused_config, block_n=128, num_stages=1)  # interpreter-sized
    backend.tile_weight = 1
    plan = layout.plan_call(cfg, m=m, seq=1, rank=RANK, counter_base=layout.zero_counters(WORLD))
    assert vendor.takes_rows("blockscale", plan.rows) == (producer == "vendor")
    p = Q.random_problem(m, cfg.n, cfg.k, "blockscale", seed=5)
    backend.fused(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale, out=torch.zeros(m, cfg.n, dtype=torch.bfloat16),
                  plan=plan)
    planes = backend.partial_by_rows if producer == "vendor" else backend.partial
    got = torch.cat([planes[d][:m] for d in range(WORLD)], dim=1)
    assert Q.count_mismatches(got, p.reference()) == 0
    reduce = [op[2:] for op in log.ops if op[1] == "reduce_kernel"]
    assert reduce == [(rows, planes.data_ptr(), planes.stride()) for rows in plan.rows]


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
