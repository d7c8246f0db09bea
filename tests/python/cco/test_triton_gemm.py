"""The NVIDIA Triton kernels run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

What runs here is the kernels' indexing, scaling and epilogue protocol at small sizes; what the
interpreter cannot show (wgmma code generation, memory ordering between programs, speed) is covered
by ``test_cuda_op.py`` on the GPUs. The interpreter rounds fp32 -> bf16 and fp32 -> e4m3 by
truncation, not to nearest, so the relative-L2 bounds here are twice the GPU ones; the element-wise
mismatch count (5 %) is the same.
"""

from __future__ import annotations

import pytest
import torch

from cco import layout
from cco import quant as Q

# conftest.py turns the interpreter on (before anything imports triton) on machines without a GPU.
triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.standard.zeros, InterpretedFunction):
    pytest.skip("triton was imported without its interpreter before this module could enable it (or a GPU is "
                "present); run with TRITON_INTERPRET=1 in the environment", allow_module_level=True)

M, N, K = 96, 256, 256  # M is not a multiple of the 32-row interpreter tile
TRUNCATION = 2.0  # interpreter rounding: truncation instead of round-to-nearest


@pytest.fixture(autouse=True)
def interpreter():
    """The kernels are built lazily; make sure this module's runs get interpreted builds."""
    from cco.cuda import kernels
    from kernels_fused.hopper import gemm as triton_gemm

    triton_gemm._kernels.cache_clear()
    kernels._kernels.cache_clear()
    yield


def _assert_close(out, ref, quant, what):
    assert Q.count_mismatches(out, ref) == 0, what
    assert Q.rel_l2(out, ref) < TRUNCATION * Q.REL_L2_TOL[quant], what


@pytest.mark.parametrize("quant", Q.QUANTS)
def test_plain_gemm_matches_reference(quant):
    """fuse=False: every scale format applied per row / per 128-block / per 32-group correctly."""
    from kernels_fused.hopper.gemm import fp8_gemm

    p = Q.random_problem(M, N, K, quant, seed=7)
    out = fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant)
    _assert_close(out, p.reference(), quant, f"{quant} gemm-only")


def test_mxfp8_kernels_read_a_kept_bf16_weight_where_given():
    """``b_dense`` (the CUDA backend's kept bf16 copy of an mxfp8 weight) is what the plain, fused
    and lsa-walk launches multiply instead of dequantizing ``b`` again: the copy of the weight gives
    the reference, a copy of another weight gives that weight's product (so it is read, not ``b``),
    and a copy that is not [N, K] contiguous bf16, or one given for another quant, is refused."""
    from kernels_fused.hopper.gemm import GemmConfig, default_config, fp8_gemm, tile_table_tensor
    from kernels_fused.hopper.vendor import mx_to_bf16

    p, other = Q.random_problem(M, N, K, "mxfp8", seed=11), Q.random_problem(M, N, K, "mxfp8", seed=12)
    dense, other_dense = mx_to_bf16(p.b, p.b_scale), mx_to_bf16(other.b, other.b_scale)
    swapped = Q.dequantize_a(p.a, p.a_scale, "mxfp8").float() @ other_dense.float().t()
    walk = GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1, launch="ticket")
    for cfg in (None, walk):
        assert torch.equal(fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="mxfp8", config=cfg, b_dense=dense),
                           fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="mxfp8", config=cfg))
        _assert_close(fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="mxfp8", config=cfg, b_dense=other_dense),
                      swapped.to(torch.bfloat16), "mxfp8", f"b_dense read ({cfg})")
    world, gc = 2, default_config("mxfp8", interpret=True)
    cfg = layout.build_config(n=N, k=K, m_max=M, world=world, quant="mxfp8", chunks=2,
                              block_m=gc.block_m, block_n=gc.block_n)
    plan = layout.plan_call(cfg, m=M, seq=1, rank=0, counter_base=layout.zero_counters(world))
    partial = torch.zeros(world, cfg.m_max_padded, cfg.n_slice, dtype=torch.bfloat16)
    fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="mxfp8", out=partial, fuse=True,
             tile_table=tile_table_tensor(layout.tile_table_rows(plan.tiles), device="cpu"),
             counters=torch.zeros(world * layout.MAX_CHUNKS, dtype=torch.int64), config=gc, b_dense=other_dense)
    _assert_close(partial.permute(1, 0, 2).reshape(cfg.m_max_padded, N)[:M], swapped.to(torch.bfloat16), "mxfp8",
                  "fused b_dense")
    for bad in (dense.t().contiguous().t(), dense[:, :K // 2], dense.float()):
        with pytest.raises(ValueError, match="b_dense must be the contiguous bf16"):
            fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="mxfp8", b_dense=bad)
    q = Q.random_problem(M, N, K, "ptpc", seed=13)
    with pytest.raises(ValueError, match="b_dense is mxfp8's"):
        fp8_gemm(q.a, q.b, q.a_scale, q.b_scale, quant="ptpc", b_dense=dense)


@pytest.mark.parametrize("quant", Q.QUANTS)
def test_warp_specialized_launch_computes_what_the_grid_one_does(quant):
    """GemmConfig.launch="ws" (ptpc's own plain kernel on Hopper): persistent programs striding the
    grouped tile order and storing tiles through TMA in halves give the grid kernel's bits, also
    where M is not a whole number of tiles (rows past M must not be stored)."""
    from kernels_fused.hopper.gemm import TRITON_PLAIN, GemmConfig, default_config, fp8_gemm

    assert TRITON_PLAIN["ptpc"].launch == "ws" and default_config("ptpc").launch == "grid"
    for m in (1, M):
        p = Q.random_problem(m, N, K, quant, seed=3)
        cfg = GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=1)
        grid = fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant, config=cfg)
        buf = torch.full((m + 5, N), float("nan"), dtype=torch.bfloat16)  # poison past M too
        out = buf[:m]
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=out, config=GemmConfig(
            block_m=32, block_n=64, num_warps=4, num_stages=1, launch="ws"))
        assert torch.equal(out, grid), f"{quant} M={m}"
        assert torch.isnan(buf[m:].float()).all(), "a TMA store wrote rows past M"
        _assert_close(out, p.reference(), quant, f"{quant} ws M={m}")


def test_warp_specialized_launch_refuses_what_it_cannot_do():
    """An explicit launch="ws" refuses what it cannot do; the default call (config=None) takes such
    an ``out`` through the grid kernel instead (``fp8_gemm``)."""
    from kernels_fused.hopper.gemm import GemmConfig, fp8_gemm, tma_storable

    p = Q.random_problem(M, N, K, "ptpc", seed=3)
    ws = GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=1, launch="ws")
    partial = torch.zeros(2, M, N // 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="launch='ws' is the plain GEMM's"):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=partial, fuse=True,
                 tile_table=torch.zeros(1, 4, dtype=torch.int32), counters=torch.zeros(16, dtype=torch.int64),
                 config=ws)
    with pytest.raises(ValueError, match="needs tma=True"):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc",
                 config=GemmConfig(block_m=32, block_n=64, launch="ws", tma=False))
    odd = torch.empty(M, N + 8, dtype=torch.bfloat16)[:, 2:N + 2]  # rows 16-byte aligned, base not
    assert not tma_storable(odd) and tma_storable(torch.empty(M, N + 8, dtype=torch.bfloat16)[:, 8:N + 8])
    assert not tma_storable(torch.empty(M, N + 4, dtype=torch.bfloat16)[:, :N])  # row stride of 8 + 4 bytes
    with pytest.raises(ValueError, match="16-byte aligned"):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=odd, config=ws)  # asked for ws: refused


def test_mxfp8_operands_dequantize_exactly_to_bf16():
    """Every mxfp8 launch on Hopper multiplies bf16 operands that ``mx_to_bf16`` made from e4m3 and
    e8m0 bytes: they must equal the reference dequantization bit for bit (a wrong group, scale byte
    or bias shows here as a changed value, not as an error within the GEMM's budget)."""
    from kernels_fused.hopper.gemm import mx_to_bf16

    p = Q.random_problem(M, N, K, "mxfp8", seed=5)
    for x, s, ref in ((p.a, p.a_scale, Q.dequantize_a(p.a, p.a_scale, "mxfp8")),
                      (p.b, p.b_scale, Q.dequantize_b(p.b, p.b_scale, "mxfp8"))):
        y = mx_to_bf16(x, s)
        assert y.dtype == torch.bfloat16 and torch.equal(y.float(), ref.float())
    with pytest.raises(ValueError, match=r"scale must be \[96, 8\]"):
        mx_to_bf16(p.a, p.a_scale[:, :4])


def _blockwise_scaled_mm(a, b_t, *, scale_a, scale_b, out_dtype, out=None, use_fast_accum=False):
    """torch._scaled_mm's blockwise recipe (A 1x128, B 128x128) as the CPU build lacks it: the
    layout torch checks on CUDA (A scale [M, K/128] with strides (1, M); B scale given as the
    [K/128, N/128] transpose of an [N/128, K/128] row-major tensor) and the row counts cuBLAS
    refused on H200 (``vendor.takes_rows``), then the blockwise product."""
    m, k = a.shape
    if m % 4:
        raise RuntimeError(f"CUBLAS_STATUS_NOT_SUPPORTED (stand-in): M={m}")
    n, kb = b_t.shape[1], k // 128
    assert scale_a.shape == (m, kb) and (m == 1 or scale_a.stride() == (1, m)), (scale_a.shape, scale_a.stride())
    assert scale_b.shape == (kb, n // 128) and scale_b.t().stride() == (kb, 1), (scale_b.shape, scale_b.stride())
    a_f = a.float() * scale_a.repeat_interleave(128, dim=1)
    b_f = b_t.t().float() * scale_b.t().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    product = (a_f @ b_f.t()).to(out_dtype)
    return product if out is None else out.copy_(product)


@pytest.mark.parametrize("quant", Q.QUANTS)
def test_vendor_gemm_whole_and_by_row_chunks(quant, monkeypatch):
    """``launch="cublas"`` (the vendor GEMM, kernels_fused.hopper.vendor) computes the reference for
    every quant, whole and one call per chunk of rows (the fused path's vendor producer): each
    chunk's call writes exactly its rows, every column (NaN poison elsewhere survives until its own
    chunk), through the arguments torch's recipes take (blockscale: the packed chunk scales). ptpc
    and mxfp8 run torch's CPU kernels; the CPU build has no blockwise recipe, so blockscale runs a
    stand-in that asserts the layout torch checks on CUDA and computes the blockwise product."""
    from cco import layout
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.gemm import VENDOR, fp8_gemm

    k = K
    if quant == "blockscale":
        monkeypatch.setattr(torch, "_scaled_mm", _blockwise_scaled_mm)
        k = 512  # a multiple of 4 scale columns: the K the vendor GEMM is trusted with (vendor.takes_rows)
    p = Q.random_problem(M, N, k, quant, seed=6)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    whole = fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=out, config=VENDOR)
    _assert_close(whole, p.reference(), quant, f"{quant} vendor")
    # the launch an eager plain call keeps (the weight bound once; the output allocated by the call)
    bound = vendor.bound_gemm(vendor.prepare_weight(p.b, p.b_scale, quant))(p.a, p.a_scale)
    assert torch.equal(bound, whole), quant
    cfg = layout.build_config(n=N, k=k, m_max=M, world=2, quant=quant, block_m=32, chunks=(1, 2))
    rows = layout.chunk_rows(cfg, M)
    assert len(rows) == 2 and rows[0][1] < M  # two calls, the second on rows that do not start at 0
    buf = torch.full((M + 7, N), float("nan"), dtype=torch.bfloat16)
    run = vendor.row_chunks(p.a, p.a_scale, vendor.prepare_weight(p.b, p.b_scale, quant), out=buf, rows=rows)
    for c, (r0, r1) in enumerate(rows):
        run(c)
        assert torch.isfinite(buf[:r1].float()).all() and torch.isnan(buf[r1:].float()).all(), (quant, c)
    assert torch.equal(buf[:M], whole), quant


def test_vendor_config_is_refused_where_it_cannot_run():
    from kernels_fused.hopper.gemm import VENDOR, fp8_gemm

    p = Q.random_problem(M, N, K, "mxfp8", seed=6)
    with pytest.raises(ValueError, match="launch='cublas' is the plain GEMM's"):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="mxfp8", out=torch.zeros(2, M, N // 2, dtype=torch.bfloat16),
                 fuse=True, tile_table=torch.zeros(1, 4, dtype=torch.int32),
                 counters=torch.zeros(16, dtype=torch.int64), config=VENDOR)


def test_plain_rule_picks_by_m_and_a_config_forces_either(monkeypatch):
    """``default_config(plain=True, m=...)`` reads ``PLAIN_RULE`` row by row (the first row whose
    largest M covers m; the last row takes every larger M), and an explicit GemmConfig overrides it
    both ways: the vendor GEMM and the own kernel compute the same reference."""
    from kernels_fused.hopper import gemm as G

    own = G.TRITON_PLAIN["ptpc"]
    monkeypatch.setattr(G, "PLAIN_RULE", {**G.PLAIN_RULE, "ptpc": ((128, own), (4096, G.VENDOR), (None, own))})
    assert [G.default_config("ptpc", plain=True, m=m, k=512) for m in (1, 128, 129, 4096, 4097, 10 ** 6)] == [
        own, own, G.VENDOR, G.VENDOR, own, own]
    assert G.default_config("ptpc", plain=True) == own  # no M: the last row
    with pytest.raises(ValueError, match="needs k"):  # a rule without K could pass cuBLAS a K it computes wrongly
        G.default_config("blockscale", plain=True, m=4096)
    # blockscale: the vendor GEMM where cuBLAS's blockwise recipe takes M, the own kernel elsewhere
    monkeypatch.setattr(G, "PLAIN_RULE", {**G.PLAIN_RULE, "blockscale": ((None, G.VENDOR),)})
    assert [G.default_config("blockscale", plain=True, m=m, k=512).launch for m in (1, 4, 129, 132)] == [
        G.TRITON_PLAIN["blockscale"].launch, "cublas", G.TRITON_PLAIN["blockscale"].launch, "cublas"]
    # ... and where the K's scale columns are not a multiple of 4 (18 at K = 2304, 17 at a padded 2176)
    own_block = G.TRITON_PLAIN["blockscale"].launch
    assert [G.default_config("blockscale", plain=True, m=4096, k=k).launch for k in (2048, 2176, 2304, 2560)] == [
        "cublas", own_block, own_block, "cublas"]
    q = Q.random_problem(130, N, K, "blockscale", seed=8)
    with pytest.raises(ValueError, match="M % 4 == 0"):
        G.fp8_gemm(q.a, q.b, q.a_scale, q.b_scale, quant="blockscale", config=G.VENDOR)
    q = Q.random_problem(4, N, 384, "blockscale", seed=8)  # 3 scale columns
    with pytest.raises(ValueError, match=r"ceil\(K/128\) % 4 == 0"):
        G.fp8_gemm(q.a, q.b, q.a_scale, q.b_scale, quant="blockscale", config=G.VENDOR)
    p = Q.random_problem(M, N, K, "ptpc", seed=8)
    small = G.GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=1)
    for cfg in (G.VENDOR, small):
        _assert_close(G.fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", config=cfg), p.reference(), "ptpc",
                      cfg.launch)


@pytest.mark.parametrize("launch", ["ticket", "persistent"])
def test_plain_gemm_through_the_lsa_walk(launch):
    """GemmConfig.launch "ticket" / "persistent" with fuse=False: the lsa kernel on a world of one
    computes the same GEMM, twice in a row (the ticket is reset by the last program)."""
    from kernels_fused.hopper.gemm import GemmConfig, fp8_gemm

    cfg = GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1, launch=launch)
    for seed in (3, 4):
        p = Q.random_problem(M, N, K, "ptpc", seed=seed)
        _assert_close(fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", config=cfg), p.reference(), "ptpc", launch)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("quant", Q.QUANTS)
def test_fused_epilogue_writes_partial_and_counts_tiles(quant, world):
    """fuse=True: tiles land in partial[dest] (dest-major column slices) and each (dest, chunk)
    counter ends at exactly the layout's per-call target: a tile written twice, skipped, or counted
    on the wrong slice breaks the copy engines' trigger."""
    from kernels_fused.hopper.gemm import default_config, fp8_gemm, tile_table_tensor

    n = 128 * world  # blockscale needs N % 128 == 0; the slice must be a multiple of the 64-wide tile
    p = Q.random_problem(M, n, K, quant, seed=world)
    ref = p.reference()
    gc = default_config(quant, interpret=True)
    cfg = layout.build_config(n=n, k=K, m_max=M, world=world, quant=quant, chunks=3,
                              block_m=gc.block_m, block_n=gc.block_n)
    for rank in range(world):
        plan = layout.plan_call(cfg, m=M, seq=1, rank=rank, counter_base=layout.zero_counters(world))
        partial = torch.full((world, cfg.m_max_padded, cfg.n_slice), float("nan"), dtype=torch.bfloat16)
        counters = torch.zeros(world * layout.MAX_CHUNKS, dtype=torch.int64)
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=partial, fuse=True,
                 tile_table=tile_table_tensor(layout.tile_table_rows(plan.tiles), device="cpu"),
                 counters=counters, config=gc)
        assert counters.view(world, layout.MAX_CHUNKS).tolist() == [list(t) for t in plan.counter_targets]
        full = partial.permute(1, 0, 2).reshape(cfg.m_max_padded, n)[:M]
        _assert_close(full, ref, quant, f"{quant} fused rank {rank}/{world}")


def _produce_row_slices(launch, p, quant, gc, plan, chunks, rank, partial, counters):
    """The reduce-scatter along rows' kernel producer for ``plan`` of ``rank`` as ``launch`` runs it
    (``CudaBackend.rows_kernel_launch``): "grid" the fused launch over the dest-major tile table,
    "ws" / "ws-lag" the computed walk, releasing each tile at once / one tile late."""
    from kernels_fused.hopper.gemm import fp8_gemm, fp8_gemm_rows_ws, rows_chunk_map, tile_table_tensor

    if launch == "grid":
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=partial, fuse=True,
                 tile_table=tile_table_tensor(layout.tile_table_rows(plan.tiles), device="cpu"),
                 counters=counters, config=gc, slice_rows=plan.slice_m)
    else:
        fp8_gemm_rows_ws(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=partial, counters=counters,
                         chunk_map=rows_chunk_map(chunks, device="cpu"), rank=rank, slice_rows=plan.slice_m,
                         config=gc, release_lag=launch == "ws-lag")


@pytest.mark.parametrize("launch", ["grid", "ws", "ws-lag"])
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("quant", Q.QUANTS)
def test_fused_row_slices_write_each_owners_rows(quant, world, launch):
    """The reduce-scatter along rows' kernel producer, ``fuse=True`` with ``slice_rows`` over the
    tile table (grid) and ``fp8_gemm_rows_ws`` (the walk computed; ws-lag: each tile released one
    tile late): a tile of dest d reads A's rows from ``d * M/W`` on and lands at its row within ``partial[d]``, every column; the slice's last
    m-tile stores none of the next slice's rows (M/W = 48 is not a multiple of the 32-row tile), and
    each (dest, chunk) counter ends at the layout's target."""
    from kernels_fused.hopper.gemm import default_config, fp8_gemm

    m = 48 * world
    p = Q.random_problem(m, N, K, quant, seed=10 + world)
    ref = p.reference()
    gc = default_config(quant, interpret=True)
    cfg = layout.build_config(n=N, k=K, m_max=m, world=world, quant=quant, chunks=2, block_m=gc.block_m,
                              block_n=gc.block_n, pattern="reduce-scatter-rows")
    for rank in range(world):
        plan = layout.plan_call(cfg, m=m, seq=1, rank=rank, counter_base=layout.zero_counters(world))
        partial = torch.full((world, cfg.m_max_padded, N), float("nan"), dtype=torch.bfloat16)
        counters = torch.zeros(world * layout.MAX_CHUNKS, dtype=torch.int64)
        _produce_row_slices(launch, p, quant, gc, plan, layout.chunk_tiles(cfg, m), rank, partial, counters)
        assert counters.view(world, layout.MAX_CHUNKS).tolist() == [list(t) for t in plan.counter_targets]
        for d in range(world):
            _assert_close(partial[d, :48], ref[d * 48:(d + 1) * 48], quant, f"{quant} rows of dest {d}, rank {rank}")
            assert partial[d, 48:].isnan().all(), "rows past the slice were stored"
    with pytest.raises(ValueError, match="W \\* slice_rows = M"):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant=quant, out=partial, fuse=True, slice_rows=47,
                 tile_table=torch.zeros(1, 4, dtype=torch.int32), counters=counters, config=gc)


@pytest.mark.parametrize("launch", ["grid", "ws", "ws-lag"])
def test_a_chunk_is_released_only_once_its_rows_are_written(monkeypatch, launch):
    """Guards the order of the reduce-scatter along rows' releases: when a (dest, chunk) counter
    reaches its target (the copy engine may put the chunk then), every row of that chunk is in
    ``partial[dest]``. The interpreter runs each add in program order and its stores at once, so
    this checks which tile an add releases, which the PTX check (every add after a full wait for
    the stores issued before it) cannot; it fails on a walk that releases a tile before its stores,
    with and without the lag (docs/experiments.md, 2026-12-07)."""
    from triton.runtime import interpreter

    from kernels_fused.hopper.gemm import default_config

    world, quant = 3, "ptpc"
    m = 48 * world  # 48-row slices: two 32-row m-tiles each, the second clipped
    p = Q.random_problem(m, N, K, quant, seed=31)
    gc = default_config(quant, interpret=True)
    cfg = layout.build_config(n=N, k=K, m_max=m, world=world, quant=quant, chunks=2, block_m=gc.block_m,
                              block_n=gc.block_n, pattern="reduce-scatter-rows")
    rank = 1
    plan = layout.plan_call(cfg, m=m, seq=1, rank=rank, counter_base=layout.zero_counters(world))
    chunks = layout.chunk_tiles(cfg, m)
    partial = torch.full((world, cfg.m_max_padded, N), float("nan"), dtype=torch.bfloat16)
    counters = torch.zeros(world * layout.MAX_CHUNKS, dtype=torch.int64)
    targets = [list(t) for t in plan.counter_targets]
    complete, early = set(), []
    real = interpreter.InterpreterBuilder.create_atomic_rmw

    def watched(self, *args, **kwargs):  # after each add: the chunks it completed must be written
        result = real(self, *args, **kwargs)
        counted = counters.view(world, layout.MAX_CHUNKS)
        for d in range(world):
            for c, (t0, t1) in enumerate(chunks):
                if (d, c) not in complete and targets[d][c] and counted[d, c].item() == targets[d][c]:
                    complete.add((d, c))
                    rows = partial[d, t0 * gc.block_m:min(t1 * gc.block_m, plan.slice_m)]
                    if rows.isnan().any():
                        early.append((d, c, int(rows.isnan().any(dim=1).sum())))
        return result

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", watched)
    _produce_row_slices(launch, p, quant, gc, plan, chunks, rank, partial, counters)
    assert len(complete) == world * len(chunks), "a chunk's counter never reached its target"
    assert not early, f"chunks released before all their rows were written (dest, chunk, rows missing): {early}"


def test_fused_requires_table_and_counters():
    from kernels_fused.hopper.gemm import fp8_gemm

    p = Q.random_problem(M, N, K, "ptpc", seed=1)
    partial = torch.zeros(2, M, N // 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fuse=True needs"):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=partial, fuse=True)
    with pytest.raises(ValueError, match="out must be a bf16"):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=torch.zeros(M, N))
    table, counters = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(16, dtype=torch.int64)
    # column slices: the region's planes must tile N (W * N/W = N), hold M rows, and be contiguous
    for bad in (torch.zeros(2, M, N, dtype=torch.bfloat16), torch.zeros(2, M - 1, N // 2, dtype=torch.bfloat16),
                torch.zeros(2, M, N, dtype=torch.bfloat16)[:, :, ::2], torch.zeros(2, M, N // 2)):
        with pytest.raises(ValueError, match=r"with fuse=True, out must be the contiguous bf16 partial region \[W, rows"):
            fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=bad, fuse=True, tile_table=table,
                     counters=counters)
    # row slices: every column per plane, slice_rows rows at least, contiguous
    for bad in (torch.zeros(2, M // 2, N // 2, dtype=torch.bfloat16), torch.zeros(2, M // 2 - 1, N, dtype=torch.bfloat16),
                torch.zeros(2, M, N, dtype=torch.bfloat16)[:, ::2]):
        with pytest.raises(ValueError, match=f"slice_rows={M // 2}, out must be the contiguous bf16 partial"):
            fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=bad, fuse=True, tile_table=table,
                     counters=counters, slice_rows=M // 2)


@pytest.mark.parametrize("programs", [None, 3], ids=lambda p: f"programs{p}")
@pytest.mark.parametrize("gather", ["bf16", "fp8"])
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
def test_reduce_chunk_sums_sources_and_flags_stamp_mismatch(world, gather, programs):
    """The CUDA reduce kernel: own partial + every peer's recv slot, in fp32, into gather[rank] and
    the own columns of out; a peer stamp for another (seq, m) is reported in status and makes the
    chunk NaN (out and gather: nothing that looks like a result). With fewer
    programs than rows each program strides the rows; the assemble (a dequant for the fp8 gather,
    a copy for the bf16 one) fills every peer's columns."""
    from cco.cuda.kernels import STATUS_PEER_M_MISMATCH, STATUS_WORDS, dequant_chunk, reduce_chunk

    rows_max, ns, m = 40, 96, 37
    g = torch.Generator().manual_seed(world)
    fp8 = gather == "fp8"
    for rank in range(world):
        partial = (torch.randn(world, rows_max, ns, generator=g) * 4).bfloat16()
        recv = (torch.randn(world, rows_max, ns, generator=g) * 4).bfloat16()
        gbuf = torch.zeros(world, rows_max, ns, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        gscale = torch.ones(world, rows_max, layout.gather_scale_cols(ns)) if fp8 else None
        out = torch.full((m, world * ns), float("nan"), dtype=torch.bfloat16)
        stamp = 12345
        scatter_m = torch.full((world,), stamp, dtype=torch.int64)
        bad_src = (rank + 1) % world
        status = torch.zeros(STATUS_WORDS, dtype=torch.int64)
        for rows in ((0, 20), (20, m)):
            reduce_chunk(partial=partial, recv=recv, gather=gbuf, gather_scale=gscale, out=out,
                         scatter_m=scatter_m, status=status, rank=rank, rows=rows, stamp=torch.tensor([stamp]),
                         programs=programs)
        ref = partial[rank, :m].float() + sum(recv[s, :m].float() for s in range(world) if s != rank)
        own = out[:, rank * ns:(rank + 1) * ns].float()
        tol = TRUNCATION * (Q.REL_L2_TOL_FP8_GATHER if fp8 else Q.REL_L2_TOL["ptpc"])
        assert Q.rel_l2(own, ref) < tol
        stored = Q.dequantize_gather(gbuf[rank, :m], gscale[rank, :m], layout.GATHER_GROUP) if fp8 else gbuf[rank, :m].float()
        assert Q.rel_l2(stored, ref) < tol  # what peers receive is the same reduced value
        assert status[0].item() == 0
        poisoned_out, poisoned_gather = out.clone(), gbuf.clone()
        poisoned_scale = gscale.clone() if fp8 else None
        scatter_m[bad_src] = stamp + 1  # that peer called with another (seq, M)
        for rows in ((0, 20), (20, m)):
            reduce_chunk(partial=partial, recv=recv, gather=poisoned_gather, gather_scale=poisoned_scale,
                         out=poisoned_out, scatter_m=scatter_m, status=status, rank=rank, rows=rows,
                         stamp=torch.tensor([stamp]), programs=programs)
        assert status.tolist() == [STATUS_PEER_M_MISMATCH + bad_src, stamp + 1]  # the source and its stamp
        assert torch.isnan(poisoned_out[:, rank * ns:(rank + 1) * ns].float()).all()
        sent = Q.dequantize_gather(poisoned_gather[rank, :m], poisoned_scale[rank, :m], layout.GATHER_GROUP) \
            if fp8 else poisoned_gather[rank, :m].float()
        assert torch.isnan(sent).all()  # what the peers assemble
        for o in range(world):  # the peers' gathered slices, as their reduces left them
            if o != rank:
                gbuf[o] = (torch.randn(rows_max, ns, generator=g) * 4).to(gbuf.dtype)
        for rows in ((0, 20), (20, m)):
            dequant_chunk(gather=gbuf, gather_scale=gscale, out=out, rank=rank, rows=rows, programs=programs)
        assert torch.isfinite(out.float()).all()
        for o in range(world):
            got = out[:, o * ns:(o + 1) * ns].float()
            if fp8:
                expect = Q.dequantize_gather(gbuf[o, :m], gscale[o, :m], layout.GATHER_GROUP)
                assert Q.rel_l2(got, expect) < 1e-2
            elif o != rank:
                assert torch.equal(got, gbuf[o, :m].float())  # the bf16 assemble is a copy


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
def test_reduce_chunk_of_a_reduce_scatter_writes_out_only(world):
    """The reduce-scatter's reduce (``gather=None``): the own slice summed into ``out`` from column 0,
    the window's regions beyond ``recv`` untouched (the pattern has no gather region: a store there
    would land in the next region), NaN and the source in ``status`` on another stamp."""
    from cco.cuda.kernels import STATUS_PEER_M_MISMATCH, STATUS_WORDS, reduce_chunk

    rows_max, ns, m = 40, 96, 37
    g = torch.Generator().manual_seed(world)
    for rank in range(world):
        partial = (torch.randn(world, rows_max, ns, generator=g) * 4).bfloat16()
        region = (torch.randn(2 * world, rows_max, ns, generator=g) * 4).bfloat16()
        recv, beyond = region[:world], region[world:].clone()
        out = torch.full((m, ns), float("nan"), dtype=torch.bfloat16)
        stamp, status = 4321, torch.zeros(STATUS_WORDS, dtype=torch.int64)
        scatter_m = torch.full((world,), stamp, dtype=torch.int64)
        for rows in ((0, 20), (20, m)):
            reduce_chunk(partial=partial, recv=recv, gather=None, gather_scale=None, out=out, scatter_m=scatter_m,
                         status=status, rank=rank, rows=rows, stamp=torch.tensor([stamp]), out_col0=0)
        ref = partial[rank, :m].float() + sum(recv[s, :m].float() for s in range(world) if s != rank)
        assert Q.rel_l2(out.float(), ref) < TRUNCATION * Q.REL_L2_TOL["ptpc"] and status[0].item() == 0
        assert torch.equal(region[world:], beyond)
        bad_src = (rank + 1) % world
        scatter_m[bad_src] = stamp + 1
        reduce_chunk(partial=partial, recv=recv, gather=None, gather_scale=None, out=out, scatter_m=scatter_m,
                     status=status, rank=rank, rows=(0, m), stamp=torch.tensor([stamp]), out_col0=0)
        assert torch.isnan(out.float()).all()
        assert status.tolist() == [STATUS_PEER_M_MISMATCH + bad_src, stamp + 1]


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
def test_check_stamps_leaves_a_good_output_and_nans_a_mismatched_one(world):
    """The all-gather's end-of-call check: every source's stamp equal to the call's leaves ``out``
    as the GEMMs wrote it; another stamp from any source (another M, a rejected call, a released
    wait) makes all of ``out`` NaN (rows beyond the check kernel's programs too) and records the
    source and its stamp in ``status``."""
    from cco.cuda.kernels import CHECK_PROGRAMS, STATUS_PEER_M_MISMATCH, STATUS_WORDS, check_stamps

    n = 300  # not a power of two: the column loop's mask
    for rank in range(world):
        for rows in (3, CHECK_PROGRAMS + 5):
            out = torch.randn(rows, n).bfloat16()
            before = out.clone()
            stamp, status = 99, torch.zeros(STATUS_WORDS, dtype=torch.int64)
            scatter_m = torch.full((world,), stamp, dtype=torch.int64)
            scatter_m[rank] = 0  # the own word is never read
            check_stamps(out=out, scatter_m=scatter_m, status=status, stamp=torch.tensor([stamp]), rank=rank,
                         world=world)
            assert torch.equal(out, before) and status[0].item() == 0
            bad_src = (rank + world - 1) % world
            scatter_m[bad_src] = stamp + 7
            check_stamps(out=out, scatter_m=scatter_m, status=status, stamp=torch.tensor([stamp]), rank=rank,
                         world=world)
            assert torch.isnan(out.float()).all()
            assert status.tolist() == [STATUS_PEER_M_MISMATCH + bad_src, stamp + 7]


def _epilogue_reduce_case(world, gather, rank, *, dest_major, bad_src=None, seed=0, block_n=128):
    """One rank's fused launch with the own tiles reduced in the epilogue, beside the same launch
    storing them into partial[rank] followed by the reduce kernel on every chunk; the peers' chunks
    are already in ``recv`` and flagged, as their copy engines would leave them."""
    from kernels_fused.hopper.gemm import GemmConfig, ReduceEpilogue, fp8_gemm, tile_table_tensor
    from cco.cuda.kernels import STATUS_WORDS, reduce_chunk

    n, fp8 = block_n * world, gather == "fp8"
    p = Q.random_problem(M, n, K, "ptpc", seed=seed)
    gc = GemmConfig(block_m=32, block_n=block_n, num_warps=4, num_stages=1)  # >= 128: whole fp8 scale groups
    cfg = layout.build_config(n=n, k=K, m_max=M, world=world, chunks=3, block_m=32, block_n=block_n)
    plan = layout.plan_call(cfg, m=M, seq=1, rank=rank, counter_base=layout.zero_counters(world))
    table = tile_table_tensor(layout.tile_table_rows(layout.tile_table(cfg, m=M, rank=rank, dest_major=dest_major)),
                              device="cpu")
    shape = (world, cfg.m_max_padded, cfg.n_slice)
    g = torch.Generator().manual_seed(seed)
    recv = (torch.randn(*shape, generator=g) * 4).bfloat16()
    stamp = 777
    scatter_m = torch.full((world,), stamp, dtype=torch.int64)
    if bad_src is not None:
        scatter_m[bad_src] = stamp + 1
    flags = torch.zeros(world * layout.MAX_CHUNKS, dtype=torch.int64)
    for src in layout.reduce_order(rank, world):
        flags[layout.counter_index(src, 0):layout.counter_index(src, plan.chunks)] = 1
    runs = {}
    for in_gemm in (False, True):
        partial = torch.full(shape, float("nan"), dtype=torch.bfloat16)
        gbuf = torch.full(shape, float("nan"), dtype=torch.bfloat16).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        gscale = torch.zeros(world, cfg.m_max_padded, layout.gather_scale_cols(cfg.n_slice)) if fp8 else None
        out = torch.full((M, n), float("nan"), dtype=torch.bfloat16)
        counters = torch.zeros(world * layout.MAX_CHUNKS, dtype=torch.int64)
        status, ticket = torch.zeros(STATUS_WORDS, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        reduce = ReduceEpilogue(rank=rank, recv=recv, gather=gbuf, gather_scale=gscale, out=out, scatter_flags=flags,
                                scatter_m=scatter_m, stamp=torch.tensor([stamp]), status=status, ticket=ticket)
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=partial, fuse=True, tile_table=table,
                 counters=counters, config=gc, reduce=reduce if in_gemm else None)
        if not in_gemm:
            for rows in plan.rows:
                reduce_chunk(partial=partial, recv=recv, gather=gbuf, gather_scale=gscale, out=out, scatter_m=scatter_m,
                             status=status, rank=rank, rows=rows, stamp=torch.tensor([stamp]))
        runs[in_gemm] = dict(partial=partial, gather=gbuf, gscale=gscale, out=out, counters=counters, status=status,
                             ticket=ticket)
    return plan, cfg, flags, runs


@pytest.mark.parametrize("gather", ["bf16", "fp8"])
@pytest.mark.parametrize("world,dest_major,block_n", [(2, True, 256), (3, True, 128), (3, False, 128)],
                         ids=["world2-halves", "world3", "world3-chunk-major"])
def test_epilogue_reduce_gives_the_reduce_kernels_bits(world, gather, dest_major, block_n):
    """fuse=True with ``reduce``: the own tiles come out of the epilogue with exactly the bits the
    split path's reduce kernel gives (out's own columns, gather[rank], its fp8 scales), peer tiles
    still land in partial[dest], partial[rank] is never written, every counter reaches its target,
    the ticket is back at 0 for the next launch and the scatter flags are left for the side stream
    to reset (every own tile of a chunk reads them). A 256-wide tile is reduced in two column
    halves of one fp8 scale group each, a 128-wide one in 64-wide halves (bf16) or whole (fp8)."""
    rank = world - 1
    plan, cfg, flags, runs = _epilogue_reduce_case(world, gather, rank, dest_major=dest_major, seed=world,
                                                   block_n=block_n)
    split, fused = runs[False], runs[True]
    own = slice(rank * cfg.n_slice, (rank + 1) * cfg.n_slice)
    assert torch.isfinite(fused["out"][:, own].float()).all()
    assert torch.equal(fused["out"][:, own], split["out"][:, own])
    assert torch.equal(fused["gather"][rank, :M].view(torch.uint8), split["gather"][rank, :M].view(torch.uint8))
    if gather == "fp8":
        assert torch.equal(fused["gscale"][rank, :M], split["gscale"][rank, :M])
    for d in range(world):
        if d != rank:
            assert torch.equal(fused["partial"][d, :M], split["partial"][d, :M])
    assert torch.isnan(fused["partial"][rank].float()).all()
    assert fused["counters"].view(world, layout.MAX_CHUNKS).tolist() == [list(t) for t in plan.counter_targets]
    assert fused["ticket"].item() == 0 and fused["status"][0].item() == 0
    assert int(flags.sum()) == (world - 1) * plan.chunks


def test_epilogue_reduce_reports_a_peer_stamp_mismatch():
    """... and makes the own columns NaN, in the epilogue as in the reduce kernel."""
    from cco.cuda.kernels import STATUS_PEER_M_MISMATCH

    _, _, _, runs = _epilogue_reduce_case(2, "bf16", 0, dest_major=True, bad_src=1)
    assert runs[True]["status"].tolist() == runs[False]["status"].tolist() == [STATUS_PEER_M_MISMATCH + 1, 777 + 1]
    for run in runs.values():
        assert torch.isnan(run["out"][:, :run["out"].shape[1] // 2].float()).all()


def test_epilogue_reduce_refuses_what_it_cannot_do():
    from kernels_fused.hopper.gemm import GemmConfig, ReduceEpilogue, fp8_gemm, tile_table_tensor

    p = Q.random_problem(M, N, K, "ptpc", seed=3)
    words = torch.zeros(2 * layout.MAX_CHUNKS, dtype=torch.int64)
    partial = torch.zeros(2, M, N // 2, dtype=torch.bfloat16)
    table = tile_table_tensor([[0, 0, 0, 0]], device="cpu")

    def epilogue(**kw):
        args = dict(rank=0, recv=partial.clone(), gather=partial.clone(), gather_scale=None,
                    out=torch.zeros(M, N, dtype=torch.bfloat16), scatter_flags=words, scatter_m=words, stamp=words,
                    status=words, ticket=words)
        return ReduceEpilogue(**{**args, **kw})

    def call(reduce, *, fuse=True, config=GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1)):
        fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=partial if fuse else None, fuse=fuse,
                 tile_table=table, counters=words, config=config, reduce=reduce)

    with pytest.raises(ValueError, match="needs fuse=True"):
        call(epilogue(), fuse=False)
    with pytest.raises(ValueError, match="needs fuse=True"):  # also where fuse=False takes another launch
        call(epilogue(), fuse=False, config=GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1, launch="ws"))
    with pytest.raises(ValueError, match="shaped like the partial region"):
        call(epilogue(recv=torch.zeros(2, M, N, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"reduce.out must be bf16 \[96, 256\]"):
        call(epilogue(out=torch.zeros(M + 1, N, dtype=torch.bfloat16)))
    fp8 = dict(gather=partial.to(torch.float8_e4m3fn), gather_scale=torch.ones(2, M, 1))
    with pytest.raises(ValueError, match="multiple of 128"):
        call(epilogue(**fp8), config=GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=1))


def test_wide_kernel_tile_counts_for_both_layout_tiles():
    """A kernel tile two layout tiles wide (the NVIDIA fused launch at N/W = 3584) keeps the layout's
    order and counter targets: it adds 2 per program."""
    from kernels_fused.hopper.gemm import GemmConfig, fp8_gemm, merge_tile_pairs, tile_table_tensor

    world, n = 2, 512
    p = Q.random_problem(M, n, K, "ptpc", seed=11)
    cfg = layout.build_config(n=n, k=K, m_max=M, world=world, chunks=2, block_m=32, block_n=64)
    plan = layout.plan_call(cfg, m=M, seq=1, rank=1, counter_base=layout.zero_counters(world))
    rows = merge_tile_pairs(layout.tile_table_rows(plan.tiles), layout_block_n=cfg.block_n)
    assert len(rows) * 2 == len(plan.tiles)
    partial = torch.full((world, cfg.m_max_padded, cfg.n_slice), float("nan"), dtype=torch.bfloat16)
    counters = torch.zeros(world * layout.MAX_CHUNKS, dtype=torch.int64)
    fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="ptpc", out=partial, fuse=True, tile_weight=2,
             tile_table=tile_table_tensor(rows, device="cpu"), counters=counters,
             config=GemmConfig(block_m=32, block_n=128, num_warps=4, num_stages=1))
    assert counters.view(world, layout.MAX_CHUNKS).tolist() == [list(t) for t in plan.counter_targets]
    _assert_close(partial.permute(1, 0, 2).reshape(cfg.m_max_padded, n)[:M], p.reference(), "ptpc", "wide tiles")
