"""The static ISA budget of the gfx950 kernel (``kernels_fused.gfx950.budget``), per variant.

Compile tier: each variant is compiled for gfx950 on this CPU and never launched. Every variant of
the conformance sweep (``isa.all_variants``, compiled once for both checks) and a few long-K ones
must stay within its budget: the schedule's MFMA / DMA / ds_read / barrier counts per K step, no
``vmcnt(0)`` inside a K step, the prologue size, 16-byte C stores (at most ``4 * CStage.stores`` per
wave), no wait on a C store but the fused publish's, no spill, the LDS of the tile. The full sweep
(K up to 8192, every tile, quant and mode): ``python -m kernels_fused.gfx950.budget``.
"""

import re

import pytest

from kernels_fused.gfx950 import budget
from kernels_fused.gfx950 import isa as isa_mod
from kernels_fused.gfx950.toolchain import flydsl_available

_WHY = flydsl_available()
needs_toolchain = pytest.mark.skipif(_WHY is not None, reason=f"no gfx950 CPU compile: {_WHY}")

# where the spills were (blockscale / mxfp8 256x256 from K=384..512) and the long main loop
LONG_K = [("ptpc", "256x256", 2048, True), ("blockscale", "256x256", 2048, False), ("mxfp8", "256x256", 2048, True),
          ("blockscale", "128x256", 2048, True), ("blockscale", "256x256", 8192, True)]
VARIANTS = list(isa_mod.all_variants()) + LONG_K


@pytest.mark.compile
@needs_toolchain
def test_precompiled_variants_are_the_in_process_compiles(monkeypatch):
    """The memo's ISA, compiled by worker processes (``isa.precompile``), is what this process
    compiles itself."""
    monkeypatch.setattr(isa_mod, "_COMPILED", {})
    variants = [("ptpc", "128x256", 256, True), ("mxfp8", "256x128", 256, False)]
    isa_mod.precompile(variants, workers=2)
    assert set(isa_mod._COMPILED) == {(*v, "shipped", True) for v in variants}
    for q, t, k, f in variants:
        assert isa_mod._COMPILED[(q, t, k, f, "shipped", True)] == isa_mod.compile_variant(quant=q, tile=t, K=k,
                                                                                           fuse=f)


def _over_budget(cfg, text):
    return budget.check(budget.profile(text, k_tiles=cfg.k_tiles), budget.limits(cfg))


@pytest.mark.compile
@needs_toolchain
@pytest.mark.parametrize("quant,tile,K,fuse", VARIANTS,
                         ids=[f"{q}-{t}-k{k}-{'fused' if f else 'gemm'}" for q, t, k, f in VARIANTS])
def test_variant_is_within_its_budget(quant, tile, K, fuse, gfx950_sweep):
    cfg, text = isa_mod.compiled(quant, tile, K, fuse)
    assert _over_budget(cfg, text) == []


def _epilogue_start(lines):
    return max(i for i, ln in enumerate(lines) if ln.strip().startswith("v_mfma"))


@pytest.mark.compile
@needs_toolchain
def test_budget_fails_on_the_direct_store_epilogue():
    """The epilogue this kernel replaced, written into the ISA: each 16-byte store becomes the eight
    ``buffer_store_short`` of one bf16 per lane, and every sub-tile's stores end in a full drain
    before the next one's scale loads (``s_waitcnt vmcnt(0)``). The budget names all three."""
    cfg, text = isa_mod.compiled("ptpc", "256x256", 512, False)
    lines = text.split("\n")
    start = _epilogue_start(lines)
    out = lines[:start]
    for ln in lines[start:]:
        m = re.match(r"(\s*)buffer_store_dwordx4 v\[(\d+):\d+\], (.*)", ln)
        if m is None:
            out.append(ln)
            continue
        pad, first, rest = m.group(1), int(m.group(2)), m.group(3)
        out += [f"{pad}buffer_store_short v{first + k // 2}, {rest}" for k in range(8)]
        out.append(f"{pad}s_waitcnt vmcnt(0)")
    bad = _over_budget(cfg, "\n".join(out))
    assert any(b.startswith("epilogue stores per wave: 128, limit 16") for b in bad), bad
    assert any(b.startswith("store bytes per lane: 2, must be 16") for b in bad), bad
    assert any(b.startswith("waits on C stores: 16, limit 0") for b in bad), bad
    assert _over_budget(cfg, text) == []


@pytest.mark.compile
@needs_toolchain
def test_budget_fails_on_a_drain_in_the_main_loop_and_on_spills():
    """A ``vmcnt(0)`` before a K step's LDS reads (what an LDS read the compiler cannot tell apart
    from the in-flight DMA gets: it waits for every load) and spilled registers are over budget."""
    cfg, text = isa_mod.compiled("ptpc", "256x256", 1024, False)
    prof = budget.profile(text, k_tiles=cfg.k_tiles)
    instrs = isa_mod.parse(text)  # the first LDS read of the K step the budget profiles
    bars = [x.line for x in instrs if x.kind == "barrier" and not x.conditional]
    step_start = bars[budget.PROLOGUE_WAIT_BARRIERS + budget.BARRIERS_PER_STEP * ((cfg.k_tiles - 2) // 2) - 1]
    read = next(x.line for x in instrs if x.kind == "ds_read" and x.line > step_start)
    lines = text.split("\n")
    drained = "\n".join(lines[:read - 1] + ["\ts_waitcnt vmcnt(0)"] + lines[read - 1:])
    assert any(b.startswith("s_waitcnt vmcnt(0) in a K step: 1") for b in _over_budget(cfg, drained))
    spilled = re.sub(r"(\.vgpr_spill_count:\s+)0", r"\g<1>3", text)
    assert "spilled VGPRs: 3, limit 0" in _over_budget(cfg, spilled)
    assert prof.iteration is not None and prof.iteration.full_drains == 0
