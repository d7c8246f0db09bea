"""The compiled gfx950 ISA against the pipeline schedule (``kernels_fused.gfx950.isa``).

Compile tier: each variant is compiled for gfx950 on this CPU (flydsl + ld.lld >= 18) and never
launched. The checker must pass the shipped kernel, catch the racy original (``upstream``: the
tail's bare barrier and the missing S0 ``read_done_barrier``), and catch hand-made breakages of
the shipped ISA (a wait removed, an LDS read moved across its barrier).
"""

import re

import pytest

from kernels_fused.gfx950 import isa as isa_mod
from kernels_fused.gfx950.toolchain import flydsl_available
from kernels_fused.pipeline.schedule import build_schedule

_WHY = flydsl_available()
needs_toolchain = pytest.mark.skipif(_WHY is not None, reason=f"no gfx950 CPU compile: {_WHY}")


def compiled(quant, tile, K, fuse, variant):
    return isa_mod.compiled(quant, tile, K, fuse, variant)  # shared with the other compile-tier tests


def run_check(isa_text, cfg, reference="shipped"):
    ref = build_schedule(block_m=cfg.BLOCK_M, block_n=cfg.BLOCK_N, k=cfg.K, quant=cfg.quant, variant=reference,
                         mfma_barriers=cfg.mfma_barriers)
    return isa_mod.check(isa_text, cfg.schedule(), reference=ref, fused=cfg.fuse, name=cfg.name)


def test_a_variant_is_compiled_once_however_its_defaults_are_spelled(monkeypatch):
    """The compile tiers share one compile per variant (some pass the schedule variant, some leave
    it to its default); a compile takes 1-3 s, 70-odd variants each tier."""
    calls = []
    monkeypatch.setattr(isa_mod, "compile_variant", lambda **kw: calls.append(kw) or ("cfg", "isa"))
    # a memo of its own: the process's holds the other tiers' compiles (and must not keep the stub)
    monkeypatch.setattr(isa_mod, "_COMPILED", {})
    assert isa_mod.compiled("ptpc", "128x256", 384, True) == ("cfg", "isa")
    assert isa_mod.compiled("ptpc", "128x256", 384, True, "shipped") == ("cfg", "isa")
    assert isa_mod.compiled("ptpc", "128x256", 384, True, "shipped", True) == ("cfg", "isa")
    assert isa_mod.compiled("ptpc", "128x256", 384, True, "upstream") == ("cfg", "isa")
    assert [c["variant"] for c in calls] == ["shipped", "upstream"]


# every tile x quant x K in isa.CHECK_ALL_K x mode: what `python -m kernels_fused.gfx950.isa --check-all` sweeps
SHIPPED = list(isa_mod.all_variants())


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("quant,tile,K,fuse", SHIPPED,
                         ids=[f"{q}-{t}-k{k}-{'fused' if f else 'gemm'}" for q, t, k, f in SHIPPED])
def test_shipped_isa_conforms_to_its_schedule(quant, tile, K, fuse, gfx950_sweep):
    cfg, text = compiled(quant, tile, K, fuse, "shipped")
    report = run_check(text, cfg)
    assert report.ok, report.format()
    assert report.barriers == len([e for _, e in cfg.schedule().program() if e.is_barrier]) + (1 if fuse else 0)


@pytest.mark.compile
@needs_toolchain
def test_four_barrier_structure_compiles_and_conforms():
    """mfma_barriers=False (the MFMA calls carry no barrier: four per K step) is the other structure
    the schedule models; its kernel is emitted and checked the same way, and upstream still fails."""
    cfg, text = isa_mod.compile_variant(quant="ptpc", tile="256x256", K=512, fuse=False, mfma_barriers=False)
    report = run_check(text, cfg)
    assert report.ok, report.format()
    assert report.barriers == len([e for _, e in cfg.schedule().program() if e.is_barrier])
    assert report.barriers < run_check(*reversed(compiled("ptpc", "256x256", 512, False, "shipped"))).barriers
    ucfg, utext = isa_mod.compile_variant(quant="ptpc", tile="256x256", K=512, fuse=False, variant="upstream",
                                          mfma_barriers=False)
    assert any(m.startswith("K-2 S1") for m in run_check(utext, ucfg).completion)


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("K", [256, 512], ids=["4096x7168x256-shape-K", "16384x7168x512-shape-K"])
def test_upstream_tail_fails_where_the_drain_is_missing(K):
    """The bug of the source text: K-2's bare barrier leaves the final tiles' DMA undrained before
    the pre-reads of the final B0 and A0. At K=256 (no main-loop iteration) nothing else covers it."""
    cfg, text = compiled("ptpc", "256x256", K, False, "upstream")
    report = run_check(text, cfg)
    assert not report.ok
    tail = [m for m in report.completion if m.startswith("K-2 S1 barrier 0")]
    assert tail and "DMA loads drained" in tail[0], report.format()
    if K > 256:  # with a main loop, the missing read_done_barrier at S0 shows too
        assert any(m.startswith("k=1 S0") and "lgkmcnt" in m for m in report.completion), report.format()
    assert not report.structure, report.format()  # upstream is faithfully compiled; only its waits are short


@pytest.mark.compile
@needs_toolchain
def test_count_only_workaround_still_fails_at_k256():
    """A+B-1 changes the loop count only; at K=256 the loop never runs and the bare tail remains."""
    cfg, text = compiled("ptpc", "256x256", 256, False, "a+b-1")
    report = run_check(text, cfg)
    assert any(m.startswith("K-2 S1 barrier 0") for m in report.completion), report.format()


def _without_compiler_vm_waits(text):
    """The ISA with every compiler-inserted ``s_waitcnt vmcnt`` removed (the schedule's asm waits stay)."""
    out, in_asm = [], False
    for ln in text.split("\n"):
        in_asm = (in_asm or ln.strip() == ";;#ASMSTART") and ln.strip() != ";;#ASMEND"
        if not in_asm and re.match(r"\s*s_waitcnt\s.*vmcnt\(", ln):
            continue
        out.append(ln)
    return "\n".join(out)


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("quant,tile", [("mxfp8", "256x128"), ("blockscale", "256x256")], ids=["mxfp8", "blockscale"])
def test_scaled_upstream_tail_is_covered_by_the_compilers_scale_wait(quant, tile):
    """The source text saw no mxfp8 failure before the fix: K-2's first MFMA consumes scales loaded
    after the final tiles' DMA, so the compiler waits (vmcnt) ahead of the final B0/A0 pre-reads.
    The ISA shows that wait (the schedule models it as WaitVm), and without it the tail fails."""
    cfg, text = compiled(quant, tile, 256, False, "upstream")
    report = run_check(text, cfg)
    assert report.ok, report.format()
    broken = run_check(_without_compiler_vm_waits(text), cfg)  # the drain is missing from K-2 S0 on
    assert any(m.startswith("K-2 S0 barrier 1") and "DMA loads drained" in m for m in broken.completion), \
        broken.format()
    ptpc_cfg, ptpc_text = compiled("ptpc", tile, 256, False, "upstream")
    assert not run_check(ptpc_text, ptpc_cfg).ok


# --------------------------------------------------------------------------------------------------
# the checker catches breakage of the shipped ISA (so a PASS means something)
# --------------------------------------------------------------------------------------------------
def _asm_blocks(text):
    """(start, end) line indices of the kernel's own inline-asm blocks (waits and barriers)."""
    lines = text.split("\n")
    starts = [i for i, ln in enumerate(lines) if ln.strip() == ";;#ASMSTART"]
    return lines, [(s, next(j for j in range(s, len(lines)) if lines[j].strip() == ";;#ASMEND")) for s in starts]


@pytest.mark.compile
@needs_toolchain
def test_removing_the_tail_drain_is_caught():
    cfg, text = compiled("ptpc", "256x256", 512, False, "shipped")
    lines, blocks = _asm_blocks(text)
    drains = [s for s, e in blocks if any("vmcnt(0)" in ln for ln in lines[s:e])]
    first = drains[0]  # K-2 S1: the drain the fix added
    mutated = [ln for i, ln in enumerate(lines) if not (first < i < first + 3 and "vmcnt(0)" in ln)]
    assert len(mutated) == len(lines) - 1
    report = run_check("\n".join(mutated), cfg)
    assert any(m.startswith("K-2 S1 barrier 0") for m in report.completion), report.format()


@pytest.mark.compile
@needs_toolchain
def test_removing_a_read_done_wait_is_caught():
    cfg, text = compiled("ptpc", "256x256", 512, False, "shipped")
    lines, blocks = _asm_blocks(text)
    # the last read_done_barrier (k=1 S0): at k=0 a compiler lgkmcnt(0) for the kernel arguments'
    # scalar loads precedes it and would cover the mutation
    target = [s for s, e in blocks if any("lgkmcnt(0)" in ln for ln in lines[s:e])
              and any("s_barrier" in ln for ln in lines[s:e])][-1]
    mutated = [ln for i, ln in enumerate(lines) if not (target < i < target + 3 and "lgkmcnt(0)" in ln)]
    report = run_check("\n".join(mutated), cfg)
    assert any("lgkmcnt" in m for m in report.completion), report.format()


@pytest.mark.compile
@needs_toolchain
def test_an_lds_read_moved_across_its_barrier_is_caught():
    cfg, text = compiled("ptpc", "256x256", 256, False, "shipped")
    lines, blocks = _asm_blocks(text)
    # the first LDS read that follows one of the schedule's barriers: hoist it above that barrier
    for s, e in blocks:
        nxt = next((j for j in range(e + 1, len(lines))
                    if lines[j].strip().startswith(("ds_read", ";;#ASMSTART", "s_barrier"))), None)
        if nxt is not None and lines[nxt].strip().startswith("ds_read"):
            break
    else:
        pytest.fail("no barrier followed by an LDS read in the shipped ISA")
    mutated = lines[:s] + [lines[nxt]] + lines[s:nxt] + lines[nxt + 1:]
    assert run_check(text, cfg).ok
    report = run_check("\n".join(mutated), cfg)
    assert any("ds_reads" in m for m in report.structure), report.format()


# --------------------------------------------------------------------------------------------------
# host: the parser on a hand-written kernel body
# --------------------------------------------------------------------------------------------------
_TOY = """
\t.text
toy_kernel:
\tbuffer_load_dwordx4 v4, s[8:11], 0 offen lds
\tbuffer_load_dwordx4 v[0:3], s[8:11], 0 offen
\ts_cbranch_vccnz .LBB0_2
\ts_barrier
.LBB0_2:
\ts_waitcnt vmcnt(1) lgkmcnt(0)
\ts_barrier
\tds_read_b128 v[8:11], v1
\tv_mfma_f32_16x16x128_f8f6f4 v[0:3], v[8:15], v[8:15], 0
\ts_barrier
\ts_endpgm
"""


def test_parser_splits_intervals_and_tracks_what_each_wait_guarantees():
    ivs = isa_mod.isa_intervals(isa_mod.parse(_TOY))
    assert [iv.conditional for iv in ivs[:-1]] == [True, False, False]
    assert (ivs[0].dma, ivs[1].dma_done, ivs[1].vm_drained) == (1, 1, False)  # vmcnt(1): the DMA (older) landed
    assert (ivs[2].ds_reads, ivs[2].mfmas, ivs[2].reads_retired) == (1, 1, False)
    assert re.match(r"line \d+: s_barrier", ivs[2].barrier)
