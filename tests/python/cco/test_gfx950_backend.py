"""The gfx950 backend on a machine without gfx950: its launch arguments against ``cco.layout``, its
device checks, and that nothing is ever compiled or launched here.

Guards, per test:
- the fused launch's tile table is the op's plan (else the kernel bumps counters the transport never
  waits for and the call hangs), as the FlyDSL launcher itself builds it, with per-call chunk
  targets equal to the tiles each (dest, chunk) receives, over calls with alternating M;
- every tile lies inside the partial region and each (dest, m-tile, n-tile) is written once;
- the layout tile of the backend is a tile the kernel compiles, for N = 7168 on 1..8 ranks;
- a CPU or NVIDIA device is refused with the reason, before anything is compiled;
- the gemm-only and fused paths reach the launcher with arguments its validation accepts, and stop
  at its device check: no FlyDSL compile, no launch;
- the transport refuses clearly while the shared schedule cannot take ROCm memory operations, and
  HIP memory operations name the package when ``hip-python`` is missing;
- the ROCm memory-operation interface keeps the CUDA module's names and parameters (one schedule
  drives both).
"""

from __future__ import annotations

import collections
import importlib.util
import inspect
import subprocess
import sys
import types

import pytest
import torch

from cco import layout
from cco.preshuffle import preshuffle_b
from cco.quant import random_problem
from cco.transport.base import Drop, FaultPlan
from cco.window import Window
from kernels_fused.gfx950 import kernel as gemm_gfx950
from cco.backends import gfx950 as gb

N_MODEL = 7168


def _plans(cfg, ms, rank):
    base = layout.zero_counters(cfg.world)
    for seq, m in enumerate(ms, start=1):
        plan = layout.plan_call(cfg, m=m, seq=seq, rank=rank, counter_base=base)
        base = plan.counter_targets
        yield plan


def _config(world, quant="ptpc", n=N_MODEL, k=512, m_max=4096, chunks=None, mode="fused", **kw):
    return layout.build_config(n=n, k=k, m_max=m_max, world=world, quant=quant, mode=mode, chunks=chunks,
                               block_m=gb.Gfx950Backend.block_m, block_n=gb.Gfx950Backend.block_n, **kw)


# --------------------------------------------------------------------------------------------------
# launch arguments against cco.layout
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["all-reduce", "reduce-scatter-cols"])
@pytest.mark.parametrize("world,chunks", [(2, None), (4, 3), (8, 8)], ids=["w2", "w4c3", "w8c8"])
def test_fused_tile_table_is_the_plan_and_the_launchers(world, chunks, pattern):
    cfg = _config(world, chunks=chunks, pattern=pattern)
    for rank in (0, world - 1):
        launcher = gemm_gfx950.compile_fused_gemm_scatter(rank, world, K=cfg.k, BLOCK_M=cfg.block_m,
                                                          BLOCK_N=cfg.block_n, quant=cfg.quant, fuse=True,
                                                          chunks=cfg.chunks, pattern=pattern)
        for plan in _plans(cfg, (4096, 300, 1000, 4096), rank):
            args = gb.fused_launch_args(cfg, plan)
            assert [list(r) for r in args.tile_rows] == layout.tile_table_rows(plan.tiles)
            # the table the FlyDSL launcher builds for itself (no device: a CPU int32 tensor)
            own = launcher._tile_table(m=plan.m, n=cfg.n, c_rows=args.c_rows, device="cpu")
            assert own.tolist() == [list(r) for r in args.tile_rows]
            assert args.grid == len(plan.tiles)


def test_column_reduce_scatter_walks_the_all_reduces_tiles():
    """The column reduce-scatter is the all-reduce without its gather: the same slices, so the same
    tile walk, counters and planes, and so the same fused kernel (its gather is the transport's)."""
    for world in (2, 4, 8):
        ar, rs = _config(world, chunks=3), _config(world, chunks=3, pattern="reduce-scatter-cols")
        assert tuple(rs.window.partial.shape) == tuple(ar.window.partial.shape)
        for rank in (0, world - 1):
            for p_ar, p_rs in zip(_plans(ar, (4096, 300, 1), rank), _plans(rs, (4096, 300, 1), rank)):
                assert gb.fused_launch_args(rs, p_rs) == gb.fused_launch_args(ar, p_ar)


@pytest.mark.parametrize("pattern", ["all-gather", "fan-out"])
def test_fused_launcher_refuses_patterns_without_tiles(pattern):
    """The all-gather publishes no tile (its transfers precede the GEMM): a fused launcher for it is
    refused when it is made, before any call, as is an unknown pattern."""
    with pytest.raises(ValueError, match="compile_fused_gemm_scatter: .*" + {
            "all-gather": "publishes no GEMM tile", "fan-out": "unknown"}[pattern]):
        gemm_gfx950.compile_fused_gemm_scatter(0, 2, K=512, BLOCK_M=256, BLOCK_N=128, fuse=True, pattern=pattern)
    if pattern in layout.PATTERNS:  # the plain GEMM makes any pattern's row blocks
        gemm_gfx950.compile_fused_gemm_scatter(0, 2, K=512, BLOCK_M=256, BLOCK_N=256, fuse=False, pattern=pattern)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_chunk_targets_are_the_tiles_each_slot_receives_per_call(world):
    """Counters are zeroed per call; each (dest, chunk) completes at the count of its tiles in the
    table, which must equal the plan's cumulative target minus its base, call after call."""
    cfg = _config(world, chunks=4)
    for plan in _plans(cfg, (4096, 256, 1000, 4096, 1), rank=1):
        args = gb.fused_launch_args(cfg, plan)
        bumps = collections.Counter(layout.counter_index(d, c) for c, d, _, _ in args.tile_rows)
        for d in range(world):
            for c in range(plan.chunks):
                assert args.chunk_targets[d][c] == bumps[layout.counter_index(d, c)] > 0
                assert plan.counter_targets[d][c] - plan.counter_base[d][c] == args.chunk_targets[d][c]
        assert sum(bumps.values()) == len(args.tile_rows)
        assert max(bumps) < args.counter_words


@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_tiles_cover_the_partial_region_once(quant):
    world = 4
    cfg = _config(world, quant=quant, m_max=1000)
    w = cfg.window
    for plan in _plans(cfg, (1000, 513), rank=2):
        args = gb.fused_launch_args(cfg, plan)
        assert args.partial_shape == tuple(w.partial.shape) == (world, cfg.m_max_padded, cfg.n // world)
        assert (args.partial_offset, args.counters_offset) == (w.partial.offset, w.counters.offset)
        assert args.counter_words == world * layout.MAX_CHUNKS
        seen = set()
        for chunk, dest, row0, col0 in args.tile_rows:
            assert row0 % cfg.block_m == 0 and row0 + cfg.block_m <= args.c_rows
            assert col0 % cfg.block_n == 0 and col0 + cfg.block_n <= args.c_ld
            r0, r1 = plan.rows[chunk]
            assert r0 <= row0 < max(r1, r0 + 1)  # the tile's first row lies in its chunk
            seen.add((dest, row0, col0))
        expect = {(d, mt * cfg.block_m, nt * cfg.block_n) for d in range(world)
                  for mt in range(plan.padded_m // cfg.block_m) for nt in range(cfg.n_tiles_per_dest)}
        assert seen == expect and len(args.tile_rows) == len(expect)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_layout_tile_is_a_kernel_tile(world, quant):
    cfg = _config(world, quant=quant)
    assert (cfg.block_m, cfg.block_n) == (gb.GEMM_BLOCK_M, gb.GEMM_BLOCK_N)
    assert gb.kernel_tile_reason(block_m=cfg.block_m, block_n=cfg.block_n) is None


def test_other_tiles_are_refused_with_the_kernel_tiles():
    why = gb.kernel_tile_reason(block_m=128, block_n=128)
    assert "128x128" in why and "256x128" in why and "256x256" in why


def test_plain_gemm_tile_and_grid():
    for quant in ("ptpc", "blockscale", "mxfp8"):  # no quant spills at 256x256 (test_gfx950_budget)
        assert gb.gemm_tile(n=N_MODEL, quant=quant) == (256, 256)
        assert gb.gemm_tile(n=N_MODEL + 128, quant=quant) == (256, 128)
    with pytest.raises(ValueError, match="quant='fp4'"):
        gb.gemm_tile(n=N_MODEL, quant="fp4")
    assert gb.gemm_grid(m=300, n=N_MODEL, block_m=256, block_n=256) == 2 * 28
    assert gb.gemm_grid(m=256, n=N_MODEL, block_m=256, block_n=128) == 56
    for quant in ("ptpc", "blockscale", "mxfp8"):
        bm, bn = gb.gemm_tile(n=N_MODEL, quant=quant)
        assert gb.kernel_tile_reason(block_m=bm, block_n=bn) is None


# --------------------------------------------------------------------------------------------------
# devices
# --------------------------------------------------------------------------------------------------
def test_module_imports_without_flydsl_hip_or_triton():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('flydsl', 'hip', 'triton'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import cco.backends.gfx950 as gb\n"
        "print(gb.Gfx950Backend.supports_device('cpu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not cpu" in out.stdout


def test_supports_device_refuses_cpu_and_nvidia(monkeypatch):
    assert "not cpu" in gb.Gfx950Backend.supports_device(torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", None)
    why = gb.Gfx950Backend.supports_device(torch.device("cuda:0"))
    assert "NVIDIA" in why and "CudaBackend" in why


@pytest.mark.parametrize("arch,ok", [("gfx942:sramecc+:xnack-", False), ("gfx950:sramecc+:xnack-", True)])
def test_rocm_arch_decides(monkeypatch, arch, ok):
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(gcnArchName=arch))
    why = gb.gfx950_reason(torch.device("cuda:0"))
    assert (why is None) == ok
    if not ok:
        assert "gfx942" in why


# --------------------------------------------------------------------------------------------------
# nothing compiles or launches without gfx950
# --------------------------------------------------------------------------------------------------
class _LocalWindow(Window):
    """Every rank's window in this process (CPU memory): enough for the backend's views."""

    def __init__(self, *, rank, world, layout_):
        super().__init__(comm=types.SimpleNamespace(rank=rank, world=world), layout=layout_)
        self._bufs = [torch.zeros(layout_.nbytes, dtype=torch.uint8) for _ in range(world)]

    def _raw(self, rank):
        return self._bufs[rank]

    @property
    def device(self):
        return torch.device("cpu")

    def _release(self):
        self._bufs = []


@pytest.fixture
def no_compile(monkeypatch):
    """Record every FlyDSL build; the tests assert none happens."""
    built = []

    def build_kernel(cfg):
        built.append(cfg.name)
        raise AssertionError(f"build_kernel({cfg.name}) called without a gfx950 device")

    monkeypatch.setattr(gemm_gfx950, "build_kernel", build_kernel)
    return built


def _backend(cfg, *, rank=0, faults=None):
    window = _LocalWindow(rank=rank, world=cfg.world, layout_=cfg.window)
    return gb.Gfx950Backend(config=cfg, comm=None, window=window, deadline_s=5.0, faults=faults)


def _operands(cfg, m, seed=0):
    p = random_problem(m, cfg.n, cfg.k, cfg.quant, seed=seed)
    return p.a, preshuffle_b(p.b), p.a_scale, p.b_scale


def test_construction_on_cpu_refuses_before_compiling(no_compile):
    cfg = _config(2, n=512, k=256, m_max=512)
    with pytest.raises(RuntimeError, match="gfx950.*nothing was compiled or launched"):
        _backend(cfg)
    assert no_compile == []


@pytest.fixture
def pretend_device(monkeypatch):
    """Let construction pass the device check (the launcher's own check still sees no gfx950)."""
    monkeypatch.setattr(gb.Gfx950Backend, "supports_device", classmethod(lambda cls, device: None))


@pytest.mark.parametrize("quant", ["ptpc", "blockscale", "mxfp8"])
def test_gemm_only_reaches_the_launchers_device_check(no_compile, pretend_device, quant):
    cfg = _config(2, quant=quant, n=512, k=256, m_max=512, mode="gemm-only")
    backend = _backend(cfg)
    assert backend.schedule is None  # gemm-only builds no transport (and needs no hip-python)
    m = 300
    plan = layout.plan_call(cfg, m=m, seq=1, rank=0, counter_base=layout.zero_counters(2))
    out = torch.empty(m, cfg.n, dtype=torch.bfloat16)
    # operands and sizes pass the launcher's validation; only its device check stops it
    with pytest.raises(RuntimeError, match="needs a gfx950 device"):
        backend.gemm(*_operands(cfg, m), out=out, plan=plan)
    (launcher,) = backend._launchers.values()
    assert (launcher.cfg.fuse, launcher.cfg.K, launcher.cfg.quant) == (False, cfg.k, quant)
    assert (launcher.cfg.BLOCK_M, launcher.cfg.BLOCK_N) == gb.gemm_tile(n=cfg.n, quant=quant)
    assert no_compile == []
    with pytest.raises(RuntimeError, match="no transport"):
        backend.all_reduce_window(out=out, plan=plan)
    backend.close()


class _RecordingSchedule:
    """Stands in for CopyEngineSchedule (which needs streams): records what the backend asks of it."""

    def __init__(self, *, config, window, device, silent, memops, marks=None, drops=None):
        self.kw = dict(config=config, device=device, silent=silent, memops=memops, drops=drops)
        self.marks = marks
        self.begun = []
        self.loaded = []

    def load_kernels(self, partials):
        self.loaded.append(tuple(p.data_ptr() for p in partials))

    def _tiles(self, plan, dest, chunk):
        return plan.counter_targets[dest][chunk] - plan.counter_base[dest][chunk]

    def begin(self, plan):
        self.begun.append(plan.seq)


@pytest.fixture
def recorded_watchdog(monkeypatch):
    """The CUDA watchdog's pieces as recorders (the real ones need pinned memory and streams)."""
    from cco.cuda import watchdog

    class Marks:
        pass

    class Watchdog:
        def __init__(self, **kw):
            self.kw = kw

    monkeypatch.setattr(watchdog, "CallMarks", Marks)
    monkeypatch.setattr(watchdog, "Watchdog", Watchdog)
    return Marks, Watchdog


def test_fused_reaches_the_launchers_device_check(no_compile, pretend_device, recorded_watchdog, monkeypatch):
    monkeypatch.setattr(gb, "copy_engine_schedule", lambda: _RecordingSchedule)
    monkeypatch.setattr(gb.HipMemOps, "supported", lambda self, index: None)
    cfg = _config(2, n=512, k=256, m_max=512, chunks=2)
    backend = _backend(cfg, rank=1, faults=FaultPlan(silent=True))
    schedule = backend.schedule
    assert isinstance(schedule.kw["memops"], gb.HipMemOps) and schedule.kw["silent"]
    assert schedule.loaded == [(backend.partial.data_ptr(),)]  # the side kernels, before any call
    backend.counters.fill_(7)  # stale counts from an earlier call
    m = 300
    plan = layout.plan_call(cfg, m=m, seq=1, rank=1, counter_base=layout.zero_counters(2))
    with pytest.raises(RuntimeError, match="needs a gfx950 device"):
        backend.fused(*_operands(cfg, m), out=torch.empty(m, cfg.n, dtype=torch.bfloat16), plan=plan)
    assert schedule.begun == [1] and int(backend.counters.abs().sum()) == 0  # zeroed before the launch
    (launcher,) = backend._launchers.values()
    assert (launcher.cfg.fuse, launcher.cfg.BLOCK_M, launcher.cfg.BLOCK_N) == (True, cfg.block_m, cfg.block_n)
    assert (launcher.rank, launcher.world, launcher.chunks) == (1, 2, cfg.chunks)
    assert no_compile == []


def test_lsa_is_refused(pretend_device):
    with pytest.raises(NotImplementedError, match="transport='lsa'.*pass transport='dma'"):
        _backend(_config(2, n=512, k=256, m_max=512, transport="lsa"))


def test_calls_are_watched_and_lost_puts_reach_the_schedule(no_compile, pretend_device, recorded_watchdog,
                                                            monkeypatch):
    """The gfx950 backend gets the CUDA backend's safety through the same schedule: its calls are
    marked, one watchdog (with the HIP memory operations) watches them, and lost puts are injected
    on the SDMA puts. A gemm-only op waits on nothing and is not watched."""
    marks_cls, watchdog_cls = recorded_watchdog
    monkeypatch.setattr(gb, "copy_engine_schedule", lambda: _RecordingSchedule)
    monkeypatch.setattr(gb.HipMemOps, "supported", lambda self, index: None)
    faults = FaultPlan(drops=(Drop(seq=2),))
    backend = _backend(_config(2, n=512, k=256, m_max=512), faults=faults)
    assert isinstance(backend.schedule.marks, marks_cls)
    assert isinstance(backend.watchdog, watchdog_cls) and backend.watchdog.kw["schedule"] is backend.schedule
    assert isinstance(backend.watchdog.kw["memops"], gb.HipMemOps)
    assert backend.schedule.kw["drops"] == faults.dropped
    assert _backend(_config(2, n=512, k=256, m_max=512, mode="gemm-only")).watchdog is None


# --------------------------------------------------------------------------------------------------
# the transport's memory operations
# --------------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("hip") is not None, reason="hip-python is installed here")
def test_hip_memops_name_the_missing_package():
    gb._hip.cache_clear()
    ops = gb.HipMemOps()  # constructing imports nothing
    for call in (lambda: ops.write(0, 0, 1), lambda: ops.wait_geq(0, 0, 1), lambda: ops.copy(0, 0, 0, 16),
                 lambda: ops.supported(0)):
        with pytest.raises(ImportError, match="hip-python"):
            call()


def test_memops_interface_is_the_cuda_modules():
    """The schedule calls ``memops.<name>(...)``: the ROCm object must answer the same calls."""
    from cco.cuda import memops as cuda_memops

    names = [n for n, v in vars(gb.MemOps).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"wait_geq", "write", "copy", "copy_2d", "capture_supported"} <= set(names)
    for name in names:
        proto = list(inspect.signature(getattr(gb.MemOps, name)).parameters)[1:]
        assert list(inspect.signature(getattr(cuda_memops, name)).parameters) == proto, name
        assert list(inspect.signature(getattr(gb.HipMemOps, name)).parameters)[1:] == proto, name


def test_fused_op_construction_says_what_is_missing(pretend_device):
    """Without hip-python a fused or split op is refused at construction, naming the package (never
    a silent fallback to another transport)."""
    if importlib.util.find_spec("hip") is None:
        gb._hip.cache_clear()
        error, match = ImportError, "hip-python"
    else:
        pytest.skip("hip-python is installed: construction would reach the HIP runtime without a ROCm device")
    for mode in ("fused", "split"):
        with pytest.raises(error, match=match):
            _backend(_config(2, n=512, k=256, m_max=512, mode=mode))


# --------------------------------------------------------------------------------------------------
# the sequence-parallel patterns: the backend's FlyDSL launches replayed on the host
# --------------------------------------------------------------------------------------------------
class _KernelModel:
    """What a compiled launch does with the flat arguments ``GemmScatterLauncher`` hands the kernel,
    computed on the CPU (``cco.quant.reference_gemm``): A ``[m, K]`` e4m3 bytes, B preshuffled;
    the A scales ptpc ``[m]``, blockscale ``[K/128, m]`` (dense: the launcher flattens the
    column-major tensor), mxfp8 ``[m, K/32]``; C ``[m, n]`` (fuse=False) or the partial planes
    ``[W, c_rows, c_ld]`` with one tile per table row (its A and B rows offset by ``dest * a_step``
    and ``dest * b_step``, the slice's origin) and ``counters[dest, chunk] += 1`` after it.
    It reads every operand through the pointer-and-size the kernel gets, so a launch on a view
    that the launcher copied, or a scale block it cannot read dense, shows as wrong bytes."""

    def __init__(self):
        self.launches = []  # (cfg name, m, stream) per launch
        self.plain_args = set()  # (tiles, counters) addresses of the fuse=False launches: never read

    def build(self, cfg):
        def kernel(A, B, C, a_s, b_s, tiles, counters, m, n, c_ld, c_rows, a_step, b_step, n_tiles, stream):
            from cco.preshuffle import unshuffle_b
            from cco.quant import E8M0, FP8, reference_gemm

            self.launches.append((cfg.name, m, stream))
            K, q = cfg.K, cfg.quant
            a, b = A.view(FP8).view(m, K), unshuffle_b(B.view(FP8).view(n, K))
            if q == "ptpc":
                sa, sb = a_s.view(m), b_s.view(n)
            elif q == "blockscale":
                sa, sb = a_s.view(K // 128, m).t(), b_s.view(n // 128, K // 128)
            else:
                sa, sb = a_s.view(E8M0).view(m, K // 32), b_s.view(E8M0).view(n, K // 32)
            prod = reference_gemm(a, b, sa, sb, q)
            if not cfg.fuse:
                self.plain_args.add((tiles.data_ptr(), counters.data_ptr()))
                C.view(m, n).copy_(prod)  # (C is the launcher's reshape(-1): a view of the caller's out)
                return
            planes = C.view(-1, c_rows, c_ld)
            padded = torch.cat([prod, prod.new_zeros(cfg.BLOCK_M, n)])  # A rows past m read zeros
            for chunk, dest, row0, col0 in tiles.tolist():
                a0, b0, _, _ = gemm_gfx950.slice_tile_origin(dest, row0, col0, a_step=a_step, b_step=b_step)
                planes[dest, row0:row0 + cfg.BLOCK_M, col0:col0 + cfg.BLOCK_N] = \
                    padded[a0:a0 + cfg.BLOCK_M, b0:b0 + cfg.BLOCK_N]
                counters[dest * layout.MAX_CHUNKS + chunk] += 1

        return kernel


class _HostSchedule(_RecordingSchedule):
    """``CopyEngineSchedule``'s all-gather steps as its contract states them, on the host:
    ``gather_inputs`` finds the peers' rows landed (the test puts them in the slots), runs the own
    rows' GEMM, then each (chunk, source) in ``layout.input_order``, or every row at once (split).
    ``run`` (puts, reduce: the shared transport) is recorded. ``current`` is the stream the backend's
    launches go to (its ``_stream``)."""

    def __init__(self, *, config, window, **kw):
        super().__init__(config=config, window=window, **kw)
        w, r = config.window, window.rank
        self.cfg = config
        self.a_rows, self.a_scales = window.tensor(w.a_rows, rank=r), window.tensor(w.a_scales, rank=r)
        self.current = "main"
        self.ran = []

    def run(self, plan, out, **kw):
        self.ran.append(kw)

    def gather_inputs(self, plan, *, out, consume_own=None, consume=None, consume_all=None, assemble=None):
        if consume_own is not None:
            consume_own()
        for c in range(plan.chunks):
            for src in layout.input_order(plan.rank, self.cfg.world)[1:]:
                if consume is not None:
                    consume(src, c)
        if consume_all is not None:
            consume_all()
        self.ran.append({"gather_inputs": True})


@pytest.fixture
def host_launches(no_compile, pretend_device, recorded_watchdog, monkeypatch):
    """A backend whose FlyDSL launches run :class:`_KernelModel` behind the real launcher's host side
    (validation, scale flattening, tile table), with :class:`_HostSchedule` as its transport."""
    model = _KernelModel()
    monkeypatch.setattr(gemm_gfx950, "build_kernel", model.build)
    monkeypatch.setattr(gemm_gfx950, "gfx950_device_reason", lambda: None)
    monkeypatch.setattr(gb, "copy_engine_schedule", lambda: _HostSchedule)
    monkeypatch.setattr(gb.HipMemOps, "supported", lambda self, index: None)
    monkeypatch.setattr(gb.Gfx950Backend, "_stream",
                        lambda self: "main" if self.schedule is None else self.schedule.current)
    return model


def _sweep_kinds():
    from kernels_fused.gfx950 import isa

    return {(q, tile, fuse) for q, tile, _, fuse in isa.all_variants()}


def _assert_conformance_checked(backend):
    """Every variant a pattern launches is one the ISA conformance and budget sweeps compile (shipped
    schedule, eight barriers per K step): a pattern adds no unchecked kernel."""
    for launcher in backend._launchers.values():
        c = launcher.cfg
        assert (c.variant, c.loop_count, c.mfma_barriers) == ("shipped", None, True)
        assert (c.quant, f"{c.BLOCK_M}x{c.BLOCK_N}", c.fuse) in _sweep_kinds()


SP_QUANTS = ["ptpc", "blockscale", "mxfp8"]


@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("quant", SP_QUANTS)
@pytest.mark.parametrize("pattern,world,rank", [("reduce-scatter-cols", 2, 1), ("reduce-scatter-rows", 2, 1),
                                                ("reduce-scatter-rows", 4, 2)], ids=["cols-w2", "rows-w2", "rows-w4"])
def test_reduce_scatter_fills_each_owners_slice(host_launches, pattern, world, rank, quant, mode):
    """What the gfx950 producer leaves for the shared transport (``cco.cuda.dma``: it moves
    ``partial[d]``'s chunk to owner d once ``counters[d, c]`` reaches its target): every owner's slice
    of this rank's product, columns d*N/W.. or rows d*M/W.. of every column, from one fused launch
    (the all-reduce's kernel; the slice origin is the launcher's), with every counter at its
    per-call target, call after call with changing M. Poisoned planes show a slice not written; a
    slice origin off by a row or a column, wrong bytes."""
    cfg = _config(world, quant=quant, n=512, k=256, m_max=1024, chunks=2, mode=mode, pattern=pattern)
    backend = _backend(cfg, rank=rank)
    sch = backend.schedule
    by_rows = pattern == "reduce-scatter-rows"
    for seq, plan in enumerate(_plans(cfg, (600, 1024, 8 * world), rank), start=1):
        a, b_pre, a_scale, b_scale = _operands(cfg, plan.m, seed=seq)
        backend.partial.fill_(float("nan"))
        backend.counters.fill_(-1)
        out = torch.empty(*layout.out_shape(cfg, plan.m), dtype=torch.bfloat16)
        backend.fused(a, b_pre, a_scale, b_scale, out=out, plan=plan) if mode == "fused" else \
            backend.split(a, b_pre, a_scale, b_scale, out=out, plan=plan)
        from cco.preshuffle import unshuffle_b
        from cco.quant import count_mismatches, reference_gemm

        want = reference_gemm(a, unshuffle_b(b_pre), a_scale, b_scale, quant)
        sm = plan.slice_m
        for d in range(world):
            r0, c0 = layout.slice_origin(cfg, d, sm)
            expect = want[r0:r0 + sm, c0:c0 + cfg.n_slice]
            got = backend.partial[d][:sm]
            assert count_mismatches(got, expect) == 0, f"seq {seq}: slice {d}"
            for c in range(plan.chunks):
                assert int(backend.counters[layout.counter_index(d, c)]) == plan.slot_tiles(d, c)
        assert sch.ran[-1]["after_gemm"] == (mode == "split")
        assert sch.ran[-1].get("scatters_first", False) is False  # the walk is chunk-major, as the all-reduce's
        assert host_launches.launches[-1][1] == plan.m  # one launch over A's rows
    assert [launcher.cfg.fuse for launcher in backend._launchers.values()] == [True]
    assert cfg.n_slice == (cfg.n if by_rows else cfg.n // world)
    _assert_conformance_checked(backend)


def test_row_gemm_launches_on_the_stream_current_at_the_call(host_launches):
    """``_rows_gemm``'s launch goes to the stream current when it is called (the shared producer deals
    row blocks to several streams), not the one current when the closure was made."""
    cfg = _config(2, n=512, k=256, m_max=1024, mode="fused", pattern="all-gather")
    backend = _backend(cfg)
    a, b_pre, a_scale, b_scale = _operands(cfg, 300)
    gemm = backend._rows_gemm(b_pre, b_scale)
    for stream in ("side", "main", "side"):
        backend.schedule.current = stream
        gemm(a[:100], a_scale[:100], torch.empty(100, cfg.n, dtype=torch.bfloat16))
    assert [s for _, _, s in host_launches.launches] == ["side", "main", "side"]


@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("quant", SP_QUANTS)
def test_all_gather_computes_every_ranks_rows(host_launches, quant, mode):
    """The all-gather's GEMM on gfx950: the plain FlyDSL launch on the own rows (fused: before any
    peer's chunk lands), then on each source's chunk in the window slot it landed in (or, at M =
    m_max_padded, where each peer's rows are one group, on the peers' slots before the own one and
    after it: CudaBackend.consumer_merges), or on every row at once (split; one launch over the
    whole region when the slots hold no pad rows), into ``out``'s rows of that source, for changing
    M. Checked against the GEMM of the gathered rows."""
    world, rank = 4, 1
    cfg = _config(world, quant=quant, n=512, k=256, m_max=world * 512, chunks=2, mode=mode, pattern="all-gather")
    backend = _backend(cfg, rank=rank)
    from cco.backends.cuda import AG_CONSUMER_ROWS, consumer_groups
    from cco.preshuffle import unshuffle_b
    from cco.quant import count_mismatches, reference_gemm

    for seq, plan in enumerate(_plans(cfg, (300, 512, 5), rank), start=1):
        m = plan.m
        inputs = [_operands(cfg, m, seed=10 * seq + src) for src in range(world)]
        _, b_pre, _, b_scale = inputs[rank]
        for src in range(world):  # the peers' puts have landed; the own rows the backend copies itself
            rows, scales = backend.schedule.a_rows[src], backend.schedule.a_scales[src]
            rows.view(torch.uint8).fill_(0x7F)  # e4m3 NaN: a row read from the wrong slot or past m
            if src != rank:
                rows[:m].copy_(inputs[src][0])
                into = backend._scale_rows(scales, 0, m)
                into.copy_(inputs[src][2].reshape(into.shape))
        out = torch.full((world * m, cfg.n), float("nan"), dtype=torch.bfloat16)
        before = len(host_launches.launches)
        a, _, a_scale, _ = inputs[rank]
        backend.all_gather_gemm(a, b_pre, a_scale, b_scale, out=out, plan=plan)
        a_all = torch.cat([x[0] for x in inputs])
        s_all = torch.cat([x[2] for x in inputs])
        want = reference_gemm(a_all, unshuffle_b(b_pre), s_all, b_scale, quant)
        assert count_mismatches(out, want) == 0, f"seq {seq}"
        rows_launched = [lm for _, lm, _ in host_launches.launches[before:]]
        groups = consumer_groups(plan.rows, AG_CONSUMER_ROWS[quant])
        if mode == "fused" and m == cfg.m_max_padded:  # one group a peer, no pad rows: the peers' slots
            assert len(groups) == 1  # before the own one and after it, each one launch (consumer_merges)
            assert rows_launched == [m, rank * m, (world - 1 - rank) * m]
        elif mode == "fused":  # own rows whole, then each (group of chunks, source) block
            assert rows_launched == [m] + [plan.rows[c1 - 1][1] - plan.rows[c0][0] for c0, c1 in groups
                                           for _ in range(world - 1)]
        else:
            assert rows_launched == ([world * m] if m == cfg.m_max_padded else [m] * world)
    assert {launcher.cfg.fuse for launcher in backend._launchers.values()} == {False}
    # the arguments a plain launch never reads are made once, not per row block (two fills each)
    assert len(host_launches.plain_args) == 1
    _assert_conformance_checked(backend)


@pytest.mark.parametrize("pattern,mode", [("all-reduce", "gemm-only"), ("reduce-scatter-rows", "fused"),
                                          ("reduce-scatter-cols", "split"), ("all-gather", "fused")])
def test_plain_calls_run_the_flydsl_gemm(host_launches, pattern, mode):
    """The op's plain calls (mode gemm-only, and every pattern at one rank, where the collective is
    the identity) ask ``plain_launcher`` first: it must send them to ``gemm_out`` and the FlyDSL
    launch. (The CUDA backend's, inherited, raised AttributeError: its cuBLAS configs are not built.)"""
    from cco.preshuffle import unshuffle_b
    from cco.quant import count_mismatches, reference_gemm

    world = 2 if mode == "gemm-only" else 1
    cfg = _config(world, quant="blockscale", n=512, k=256, m_max=512, mode=mode, pattern=pattern)
    backend = _backend(cfg)
    a, b_pre, a_scale, b_scale = _operands(cfg, 300)
    assert backend.plain_launcher(b_pre, b_scale, 300) is None
    plan = layout.plan_call(cfg, m=300, seq=1, rank=0, counter_base=layout.zero_counters(world))
    out = backend.gemm_out(a, b_pre, a_scale, b_scale, plan=plan)
    assert count_mismatches(out, reference_gemm(a, unshuffle_b(b_pre), a_scale, b_scale, "blockscale")) == 0
    assert [launcher.cfg.fuse for launcher in backend._launchers.values()] == [False]
