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
@pytest.mark.parametrize("world,chunks", [(2, None), (4, 3), (8, 8)], ids=["w2", "w4c3", "w8c8"])
def test_fused_tile_table_is_the_plan_and_the_launchers(world, chunks):
    cfg = _config(world, chunks=chunks)
    for rank in (0, world - 1):
        launcher = gemm_gfx950.compile_fused_gemm_scatter(rank, world, K=cfg.k, BLOCK_M=cfg.block_m,
                                                          BLOCK_N=cfg.block_n, quant=cfg.quant, fuse=True,
                                                          chunks=cfg.chunks)
        for plan in _plans(cfg, (4096, 300, 1000, 4096), rank):
            args = gb.fused_launch_args(cfg, plan)
            assert [list(r) for r in args.tile_rows] == layout.tile_table_rows(plan.tiles)
            # the table the FlyDSL launcher builds for itself (no device: a CPU int32 tensor)
            own = launcher._tile_table(m=plan.m, n=cfg.n, c_rows=args.c_rows, device="cpu")
            assert own.tolist() == [list(r) for r in args.tile_rows]
            assert args.grid == len(plan.tiles)


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
