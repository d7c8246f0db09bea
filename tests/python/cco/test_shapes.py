"""``cco.supports`` and a layer's padding against what each backend really accepts.

Guards: ``supports`` saying yes to a shape the backend then refuses (it said yes to
``(4096, 3584, 2432, 8)``, after which the CUDA and gfx950 backends raised "block_n=128 must divide
the per-rank slice N/world = 448"), a padding that a backend still refuses or that is larger than
needed, and a README table that no longer says what the code does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cco import layout, shapes
from cco.comm import check_outcomes, spawn
from scripts import shape_table

ROOT = Path(__file__).resolve().parents[3]
GPU_BACKENDS = ("cuda", "gfx950")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_qwen_hidden_size_at_tp8_is_refused_with_the_padding_that_fixes_it(backend):
    import cco

    why = cco.supports(4096, 3584, 2432, 8, backend=backend)
    assert why is not None and why.startswith(f"{backend}: ")
    assert "3584/8 = 448" in why and "n=4096" in why  # the slice, and the N to pad to
    assert cco.supports(4096, 4096, 2432, 8, backend=backend) is None
    k_why = cco.supports(4096, 4096, 2368, 8, backend=backend)
    assert "k=2368" in k_why and "k=2432" in k_why


def test_the_cpu_backend_takes_narrower_tiles():
    import cco

    assert cco.supports(4096, 3584, 2432, 8, backend="cpu") is None  # 448 columns: 64-wide tiles


def test_gfx950_plans_with_its_kernel_tile():
    """The gfx950 backend inherited CudaBackend.tile (the Triton tiles, 128x128 and 64x128), which its
    own __init__ then refused: every shape failed there. Its layout tile is the FlyDSL kernel's."""
    from cco.backends.gfx950 import GEMM_BLOCK_M, GEMM_BLOCK_N, Gfx950Backend, kernel_tile_reason

    for quant in layout.QUANTS:
        assert Gfx950Backend.tile(quant) == (GEMM_BLOCK_M, GEMM_BLOCK_N)
        cfg = shapes.build_for(Gfx950Backend, n=7168, k=2048, m_max=4096, world=8, quant=quant)
        assert kernel_tile_reason(block_m=cfg.block_m, block_n=cfg.block_n) is None


def test_backend_limits_beyond_the_tiles():
    assert "transport='dma'" in shapes.supports(256, 4096, 2048, 2, backend="cuda", mode="split", transport="lsa")
    assert "transport='dma'" in shapes.supports(256, 4096, 2048, 2, backend="gfx950", transport="lsa")
    assert "weight_layout='row-major'" in shapes.supports(256, 4096, 2048, 2, backend="gfx950",
                                                          weight_layout="row-major")
    assert shapes.supports(256, 4096, 2048, 2, backend="cuda", weight_layout="row-major") is None
    assert "backend='tpu'" in shapes.supports(256, 4096, 2048, 2, backend="tpu")


def test_cuda_split_lsa_verdict_is_the_backends_own():
    """The one CUDA rule ``cco.shapes`` states beside the backend: the backend's constructor raises it
    first, before touching a device, so both can be compared here."""
    from cco.backends.cuda import CudaBackend

    cfg = layout.build_config(n=4096, k=2048, m_max=256, world=2, mode="split", transport="lsa", block_m=128,
                              block_n=128)
    with pytest.raises(ValueError) as err:
        CudaBackend(config=cfg, comm=None, window=None, deadline_s=1.0)
    assert "pass transport='dma' for split" in str(err.value)
    assert "pass transport='dma' for split" in shapes.supports(256, 4096, 2048, 2, backend="cuda", mode="split",
                                                               transport="lsa")


@pytest.mark.parametrize("quant", layout.QUANTS)
@pytest.mark.parametrize("backend", shapes.BACKENDS)
def test_common_model_shapes_run_fused_with_the_least_padding(backend, quant):
    """Every row-parallel layer of the README's models at TP 2/4/8 runs fused once padded, and no
    smaller padding (the next smaller N in whole 16-column steps per rank, the next smaller 128-wide
    K) would do."""
    backend_cls = shapes.backend_class(backend=backend)
    for model, n, layers in shape_table.MODELS:
        for layer, k_total, heads in layers:
            for tp in shape_table.TPS:
                if heads is not None and heads % tp:  # no layout of that model (the table says so)
                    continue
                k = k_total // tp
                plan = shapes.layer_shape(n, k, tp, m_max=4096, backend=backend, quant=quant)
                assert plan.fused, (model, layer, tp, plan.reason)
                assert plan.n_padded >= n and plan.k_padded >= k and plan.k_padded - k < layout.K_ALIGN
                for smaller in range(plan.n_padded - 16 * tp, n - 1, -16 * tp):
                    with pytest.raises(ValueError):
                        shapes.build_for(backend_cls, n=smaller, k=plan.k_padded, m_max=4096, world=tp, quant=quant)


def test_readme_table_is_the_one_the_code_prints():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- shape-table -->\n(.*?)\n<!-- /shape-table -->", readme, re.S)
    assert match, "README.md lost its <!-- shape-table --> block"
    assert match.group(1).strip() == shape_table.markdown().strip(), "regenerate: python -m scripts.shape_table"
    for quant in layout.QUANTS:  # the README says the other formats give the same table
        assert shape_table.markdown(quant=quant) == shape_table.markdown(), quant


def test_the_table_gives_no_verdict_for_a_tp_the_heads_do_not_split_over():
    """Qwen2.5-7B's 28 attention heads do not split over 8 ranks: no tensor-parallel job has that
    o_proj shard, so the table says so instead of a verdict on 448 columns of nothing."""
    row = next(r for r in shape_table.rows() if r[:3] == ["Qwen2.5-7B", "attn.o_proj", "8"])
    assert row[3] == "-" and all(cell == "no TP 8 layout: 28 heads" for cell in row[4:-1]), row


# --------------------------------------------------------------------------------------------------
# the CPU backend's verdict against the op itself (real ranks)
# --------------------------------------------------------------------------------------------------
CPU_CASES = [  # (n, k, options)
    (512, 256, {}), (3584, 2432, {}), (500, 256, {}), (512, 320, {}), (192, 256, {"quant": "blockscale"}),
    (448, 256, {"quant": "mxfp8"}), (512, 256, {"weight_layout": "row-major"}), (520, 256, {"chunks": 9}),
    (512, 256, {"mode": "split-lsa", "gather_dtype": "fp8"}),
]


def _verdicts_against_the_op(comm):
    from cco.op import GemmAllReduceOp

    out = []
    for n, k, options in CPU_CASES:
        said = shapes.supports(64, n, k, comm.world, device="cpu", **options)
        try:
            GemmAllReduceOp(comm, n=n, k=k, m_max=64, **options).close()
            built = None
        except ValueError as err:
            built = str(err)
        out.append((said, built))
    return out


@pytest.mark.multirank
def test_supports_answers_what_the_cpu_op_builds():
    (verdicts, _) = check_outcomes(spawn(_verdicts_against_the_op, world=2, timeout_s=120))
    for (n, k, options), (said, built) in zip(CPU_CASES, verdicts):
        assert (said is None) == (built is None), (n, k, options, said, built)
        if said is not None:
            assert said.removeprefix("cpu: ") in built, (said, built)


def test_supports_raises_for_an_option_it_does_not_know_and_takes_the_shapeless_ones():
    """Before, an option ``build_config`` does not take (the op's own ``deadline_s``, a misspelt
    one) came back as a reason ("build_config() got an unexpected keyword argument"): a caller
    testing ``supports(...) is None`` ran unfused over a programming error."""
    import cco

    assert cco.supports(64, 256, 256, 2, backend="cpu", deadline_s=5.0, faults=None) is None
    with pytest.raises(TypeError, match="unknown option.s. qaunt; it takes the op's"):
        cco.supports(64, 256, 256, 2, backend="cpu", qaunt="ptpc")


def test_supports_names_the_missing_cuda_bindings_instead_of_raising(monkeypatch):
    """Before, ``supports(..., device="cuda")`` on a machine without the CUDA driver's Python
    bindings raised ``ModuleNotFoundError: No module named 'cuda'`` from the stream-memory probe."""
    from cco.backends.cuda import CudaBackend
    from cco.cuda import memops

    import sys
    import types

    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or types.ModuleType("triton"))  # (checked first)

    def missing():
        raise ModuleNotFoundError("No module named 'cuda'")

    monkeypatch.setattr(memops, "_driver", missing)
    why = CudaBackend.supports_device("cuda:0")
    assert why.startswith("CudaBackend needs cuda-bindings (pip install cuda-bindings)"), why
