"""The gfx950 FlyDSL kernel: its data path (host) and its compilation to gfx950 ISA (compile).

The compile tier needs flydsl and an ld.lld >= 18 (``kernels_fused.gfx950.toolchain``), no GPU:
nothing compiled here is ever launched. CI compiles a representative set; the full sweep is
``python -m kernels_fused.gfx950.isa --check-all``.
"""

import functools
import os
import re

import pytest
import torch

from cco.preshuffle import preshuffle_b
from kernels_fused.gfx950 import byte_layout as L
from kernels_fused.gfx950.kernel import compile_fused_gemm_scatter


# --------------------------------------------------------------------------------------------------
# host: the byte mapping the kernel compiles, replayed on real data
# --------------------------------------------------------------------------------------------------
def _dma_half(flat_src: torch.Tensor, offsets_per_wave, k_base: int, half_bytes: int) -> torch.Tensor:
    """What the eight waves' LDS-DMA steps leave in one LDS half-tile."""
    lds = torch.full((half_bytes,), -1, dtype=torch.int16)
    for wave, per_lane in offsets_per_wave.items():
        for lane, offsets in enumerate(per_lane):
            for step, off in enumerate(offsets):
                dst = L.dma_lds_offset(wave, step, lane)
                lds[dst:dst + 16] = flat_src[k_base + off:k_base + off + 16].to(torch.int16)
    assert (lds >= 0).all(), "some LDS bytes of the half-tile were never written"
    return lds


@pytest.mark.parametrize("block_m,block_n", [(256, 256), (128, 256), (256, 128)], ids=lambda v: str(v))
def test_fragments_hold_the_rows_and_k_bytes_the_mfma_expects(block_m, block_n):
    """Guards the loader/reader arithmetic: every lane's 32-byte A and B fragments, read from the
    LDS image the DMA steps build (swizzled A, bpreshuffled B), are exactly A[row, 32g:32g+32] and
    B[col, 32g:32g+32] of the K tile, g = lane // 16 (the v_mfma_scale operand order)."""
    K, kt = 384, 1
    gen = torch.Generator().manual_seed(0)
    A = torch.randint(0, 256, (2 * block_m, K), dtype=torch.uint8, generator=gen)
    B = torch.randint(0, 256, (2 * block_n, K), dtype=torch.uint8, generator=gen)
    Bp = preshuffle_b(B).reshape(-1)
    row0, b_row0 = block_m, block_n  # the second tile in both directions
    half_m, half_n = block_m // 2, block_n // 2
    steps_a, steps_b = half_m // 64, half_n // 64
    n_a, n_b = block_m // 64, block_n // 128
    for h in (0, 1):
        lds_a = _dma_half(A.reshape(-1), {w: [L.a_dma_offsets(lane=l, wave=w, row0=row0 + h * half_m, K=K, steps=steps_a)
                                               for l in range(L.WAVE)] for w in range(L.N_WAVES)},
                          kt * L.BLOCK_K, half_m * L.BLOCK_K)
        lds_b = _dma_half(Bp, {w: [L.b_dma_offsets(lane=l, wave=w, group0=(b_row0 + h * half_n) // 16, K=K,
                                                   steps=steps_b) for l in range(L.WAVE)] for w in range(L.N_WAVES)},
                          kt * L.B_GROUP_BYTES, half_n * L.BLOCK_K)
        for wave in range(L.N_WAVES):
            wave_m, wave_n = wave // 4, wave % 4
            for lane in range(L.WAVE):
                g = lane // 16
                k_bytes = slice(kt * L.BLOCK_K + 32 * g, kt * L.BLOCK_K + 32 * g + 32)
                for i in range(n_a):
                    row = wave_m * n_a * 16 + i * 16 + lane % 16
                    lo, hi = L.a_read_offsets(lane=lane, row=row)
                    frag = torch.cat([lds_a[lo:lo + 16], lds_a[hi:hi + 16]])
                    assert torch.equal(frag, A[row0 + h * half_m + row, k_bytes].to(torch.int16)), (h, wave, lane, i)
                for j in range(n_b):
                    group = wave_n * n_b + j
                    lo, hi = L.b_read_offsets(lane=lane, group=group)
                    frag = torch.cat([lds_b[lo:lo + 16], lds_b[hi:hi + 16]])
                    col = b_row0 + h * half_n + group * 16 + lane % 16
                    assert torch.equal(frag, B[col, k_bytes].to(torch.int16)), (h, wave, lane, j)


def test_a_swizzle_is_an_involution_within_a_row():
    for row in range(32):
        cols = [L.swizzle_col(row, c) for c in range(0, 128, 16)]
        assert sorted(cols) == list(range(0, 128, 16))
        assert all(L.swizzle_col(row, L.swizzle_col(row, c)) == c for c in range(0, 128, 16))


@pytest.mark.parametrize("bad,match", [
    (dict(K=128), "K=128"), (dict(K=640 + 64), "K=704"), (dict(K=512, quant="fp8"), "quant='fp8'"),
    (dict(K=512, BLOCK_M=64), "64x256"), (dict(K=512, variant="fast"), "variant='fast'"),
], ids=["k128", "k-unaligned", "quant", "tile", "variant"])
def test_factory_rejects_what_it_cannot_build(bad, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        compile_fused_gemm_scatter(0, 2, **bad)


def test_launch_without_gfx950_raises_before_touching_a_device():
    """Calling a FlyDSL kernel without its device aborts the process; the launcher must refuse first."""
    from kernels_fused.gfx950.kernel import gfx950_device_reason

    if gfx950_device_reason() is None:
        pytest.skip("this machine has a gfx950 device; the refusal path is for machines without one")
    from cco.quant import quantize_a, quantize_b

    launch = compile_fused_gemm_scatter(0, 1, K=256, fuse=False)
    a, sa = quantize_a(torch.randn(256, 256), "ptpc")
    b, sb = quantize_b(torch.randn(256, 256), "ptpc")
    c = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs a gfx950 device"):
        launch(a, preshuffle_b(b), c, sa, sb, 256, 256)


# --------------------------------------------------------------------------------------------------
# compile: FlyDSL -> gfx950 ISA on this CPU
# --------------------------------------------------------------------------------------------------
def _toolchain_reason():
    from kernels_fused.gfx950.toolchain import flydsl_available

    return flydsl_available()


needs_toolchain = pytest.mark.skipif(_toolchain_reason() is not None, reason=f"no gfx950 CPU compile: {_toolchain_reason()}")

# (quant, tile, K, fuse): every quant, every tile, both modes, K from the zero-iteration main loop up
REPRESENTATIVE = [
    ("ptpc", "256x256", 256, False),
    ("ptpc", "256x256", 512, True),
    ("ptpc", "128x256", 384, False),
    ("blockscale", "128x256", 512, True),
    ("blockscale", "256x128", 256, False),
    ("mxfp8", "256x128", 512, True),
    ("mxfp8", "256x256", 256, False),
]


@functools.lru_cache(maxsize=None)
def compiled(quant, tile, K, fuse, variant="shipped"):
    from kernels_fused.gfx950.isa import compile_variant

    cfg, isa = compile_variant(quant=quant, tile=tile, K=K, fuse=fuse, variant=variant)
    return cfg, isa


def _ids(p):
    quant, tile, K, fuse = p
    return f"{quant}-{tile}-k{K}-{'fused' if fuse else 'gemm'}"


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("variant", REPRESENTATIVE, ids=[_ids(p) for p in REPRESENTATIVE])
def test_variant_compiles_for_gfx950_without_spills(variant):
    from kernels_fused.gfx950.isa import parse, resources

    cfg, isa = compiled(*variant)
    assert re.search(r"\.amdgcn_target \"amdgcn-amd-amdhsa-[a-z]*-gfx950\"", isa), "not a gfx950 code object"
    res = resources(isa)
    assert res.lds_bytes == cfg.lds_bytes
    assert (res.vgpr_spills, res.sgpr_spills, res.scratch_bytes) == (0, 0, 0), res.line()
    ops = [i.op for i in parse(isa)]
    mfma = "v_mfma_scale_f32_16x16x128_f8f6f4" if cfg.quant == "mxfp8" else "v_mfma_f32_16x16x128_f8f6f4"
    per_quarter = (cfg.BLOCK_M // 64) * (cfg.BLOCK_N // 128)
    assert ops.count(mfma) == cfg.k_tiles * 4 * per_quarter  # every K tile, four quarters
    assert not [o for o in ops if o.startswith("v_mfma") and o != mfma]
    assert ops.count("buffer_load_dwordx4") >= cfg.k_tiles * 2 * (cfg.steps_a + cfg.steps_b)


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("variant", [p for p in REPRESENTATIVE if p[3]], ids=[_ids(p) for p in REPRESENTATIVE if p[3]])
def test_fused_epilogue_publishes_once_with_release_ordering(variant):
    """fuse=True: one 64-bit atomic add per workgroup, system-scope release (L2 written back
    first) and acquire (invalidate after), after the stores drain; fuse=False has no atomic."""
    from kernels_fused.gfx950.isa import parse

    cfg, isa = compiled(*variant)
    instrs = parse(isa)
    atomics = [i for i in instrs if "atomic" in i.op]
    assert [a.op for a in atomics] == ["global_atomic_add_x2"] and atomics[0].conditional
    after = [i.op for i in instrs if i.line > atomics[0].line]
    before = [i.op for i in instrs if i.line < atomics[0].line]
    assert "buffer_wbl2" in before[-4:], before[-4:]
    assert "buffer_inv" in after
    _, plain = compiled(variant[0], variant[1], variant[2], False)
    assert not [i for i in parse(plain) if "atomic" in i.op]


@pytest.mark.compile
@needs_toolchain
def test_compile_env_targets_gfx950_and_restores_the_environment(tmp_path, monkeypatch):
    from kernels_fused.gfx950.toolchain import compile_env

    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx942")
    with compile_env(tmp_path) as d:
        assert os.environ["FLYDSL_GPU_ARCH"] == "gfx950" and os.environ["COMPILE_ONLY"] == "1"
        lld = os.path.join(os.environ["ROCM_PATH"], "llvm", "bin", "ld.lld")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert os.path.islink(lld) and not os.path.abspath(os.environ["ROCM_PATH"]).startswith(repo)
        assert d == tmp_path
    assert os.environ["FLYDSL_GPU_ARCH"] == "gfx942"



# --------------------------------------------------------------------------------------------------
# host: the emitter is a walker of the schedule, nothing more
# --------------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for the FlyDSL stages; records what the emitter asks them to emit."""

    def __init__(self, trace, n_a=2, n_b=2):
        self.trace, self.n_a, self.n_b, self.steps = trace, n_a, n_b, None

    # parts
    def wait_barrier(self, n):
        self.trace.append(("wait_barrier", n))

    def read_done_barrier(self):
        self.trace.append(("read_done_barrier",))

    def bare_barrier(self):
        self.trace.append(("barrier",))

    def set_priority(self, level):
        self.trace.append(("prio", level))

    def zero_acc(self):
        return 0.0

    def pin(self, value):
        return value


def _emit_trace(schedule, quant):
    from kernels_fused.gfx950.kernel import PipelineEmitter, kernel_config, split_by_group

    g = schedule.geometry
    cfg = kernel_config(K=g.k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, quant=quant, fuse=False)
    trace = []
    P = _Recorder(trace)

    class Dma:
        def __init__(self, half):
            self.half, self.steps = half, g.a_steps if half[0] == "a" else g.b_steps

        def load(self, lds, ktile):
            trace.append(("load", self.half, ktile, lds))

    class Reader:
        def __init__(self, op):
            self.op = op

        def load(self, lds):
            trace.append(("read", lds))
            return [lds]

    class Mfma:
        n_a, n_b = 1, 1

        def run(self, a, b, acc, **scales):
            trace.append(("mfma", a[0], b[0], bool(scales)))
            return acc

        def run_folded(self, a, b, acc, fold):
            trace.append(("mfma", a[0], b[0], "folded"))
            return acc

    class Scales:
        def for_tile(self, tile, k):
            trace.append(("scales", tile, k))
            return [None]

    lds = {h: (f"{h}.slot0", f"{h}.slot1") for h in ("a0", "a1", "b0", "b1")}
    emitter = PipelineEmitter(cfg=cfg, parts=P, lds=lds, dma={h: Dma(h) for h in lds},
                              readers={"a": Reader("a"), "b": Reader("b")}, mfma=Mfma(), scales=Scales(),
                              stage=lambda name, acc, a, b, scales: trace.append(("stage", name)),
                              store=lambda name, a, b: trace.append(("store", name)),
                              flush=lambda: trace.append(("flush",)))
    segments, groups = split_by_group([ev for _, ev in schedule.program()])
    for i, seg in enumerate(segments):
        emitter.run(seg)
        if i < len(groups):
            trace.append(("group_barrier", groups[i]))
    return trace


@pytest.mark.parametrize("variant", ["shipped", "upstream", "a+b-1"])
@pytest.mark.parametrize("quant,tile", [("ptpc", (256, 256)), ("blockscale", (128, 256)), ("mxfp8", (256, 128))],
                         ids=["ptpc", "blockscale", "mxfp8"])
@pytest.mark.parametrize("K", [256, 640])
def test_emitter_emits_exactly_the_schedule(variant, quant, tile, K):
    """Every schedule event becomes its code in program order (waits/barriers as asm, loads into
    slot ktile % 2, MFMAs on the fragments of the K tile they name, the C stage written before one
    flush and the read-back stores); nothing else is emitted."""
    from kernels_fused.pipeline import schedule as S

    sched = S.build_schedule(block_m=tile[0], block_n=tile[1], k=K, quant=quant, variant=variant)
    want, in_call, staged = [], False, False  # an MFMA call: s_setprio(1) ... s_setprio(0); s_barrier
    for _, ev in sched.program():
        if isinstance(ev, S.LoadTile):
            want.append(("load", ev.half.lower(), ev.ktile, f"{ev.half.lower()}.slot{ev.ktile % 2}"))
        elif isinstance(ev, S.LdsRead):
            want.append(("read", f"{ev.half.lower()}.slot{ev.ktile % 2}"))
        elif isinstance(ev, S.ScaleLoad):
            want.append(("scales", ev.half.lower(), ev.ktile))
        elif isinstance(ev, S.WaitBarrier):
            want.append(("wait_barrier", ev.vmcnt))
        elif isinstance(ev, S.ReadDoneBarrier):
            want.append(("read_done_barrier",))
        elif isinstance(ev, S.Barrier) and ev.group is not None:
            want.append(("group_barrier", ev.group))
        elif isinstance(ev, S.Barrier):
            if ev.kind == "mfma":
                want.append(("prio", 0))
                in_call = False
            want.append(("barrier",))
        elif isinstance(ev, S.Mfma):
            if not in_call:
                want.append(("prio", 1))
                in_call = True
            kind = {"ptpc": False, "mxfp8": True, "blockscale": "folded"}[quant]
            want.append(("mfma", f"{ev.a}.slot{ev.ktile % 2}", f"{ev.b}.slot{ev.ktile % 2}", kind))
        elif isinstance(ev, S.StageC):
            want.append(("stage", ev.acc))
            staged = True
        elif isinstance(ev, S.StoreC):
            if staged:  # the wave's stage writes land before its first read-back
                want.append(("flush",))
                staged = False
            want.append(("store", ev.acc))
        else:
            assert isinstance(ev, S.WaitVm), ev
    assert _emit_trace(sched, quant) == want
