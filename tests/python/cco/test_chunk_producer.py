"""The producer of whole chunks (the CUDA backend's vendor GEMM, one call per chunk of rows), modelled
on the CPU: its chunking, its counter releases and its partial layout.

Guards:
- ``kernels_fused.cpu.tiles.run_chunks``: chunk by chunk, every row of the chunk (all N columns) is
  stored before any counter of the chunk moves; each (dest, chunk) counter then goes to exactly its
  target in one step, peers' slots are handed to the copier in dest order, and nothing past M is
  written. A producer that released a slot before its rows were stored would let a copier move
  stale rows.
- ``cco.layout.partial_strides(by_rows=True)``: the planes of the row-major reading are the column
  blocks dest owns, so a (dest, chunk) slot holds the same values whichever producer wrote it.
- the op on CPU rank processes (``CpuBackend.chunk_producer``): fused and split calls over the dma
  transport match the reference on every rank, in every quant, with calls alternating between the
  two producers (the region's layout is per call) and the self test (dest-major) in between.
"""

from __future__ import annotations

import pytest
import torch

from cco import layout
from cco import quant as Q
from cco.comm import check_outcomes, spawn

DEADLINE_S = 20.0


def _planes(region: torch.Tensor, cfg, *, by_rows: bool) -> torch.Tensor:
    return torch.as_strided(region, region.shape, layout.partial_strides(cfg, by_rows=by_rows))


@pytest.mark.parametrize("chunks", [4, layout.TAPERED_CHUNKS, 1], ids=["4", "tapered", "1"])
@pytest.mark.parametrize("world, rank", [(2, 1), (3, 0), (4, 2)])
def test_run_chunks_releases_each_slot_after_its_rows_and_to_its_target(world, rank, chunks):
    from kernels_fused.cpu.tiles import run_chunks

    n, m, k = 128 * world, 300, 256  # M not a whole number of 64-row tiles
    cfg = layout.build_config(n=n, k=k, m_max=320, world=world, quant="ptpc", chunks=chunks)
    base = tuple(tuple(3 * d + c for c in range(layout.MAX_CHUNKS)) for d in range(world))  # an earlier call
    plan = layout.plan_call(cfg, m=m, seq=2, rank=rank, counter_base=base)
    torch.manual_seed(0)
    a, b = torch.randn(m, k), torch.randn(n, k)
    want = (a @ b.t()).to(torch.bfloat16)
    region = torch.full((world, cfg.m_max_padded, cfg.n_slice), float("nan"), dtype=torch.bfloat16)
    rows_view = region.view(cfg.m_max_padded, n)
    planes = _planes(region, cfg, by_rows=True)
    counters = torch.tensor([base[d][c] for d in range(world) for c in range(layout.MAX_CHUNKS)], dtype=torch.int64)
    handed = []

    def complete(dest, chunk):
        r0, r1 = plan.rows[chunk]
        handed.append((dest, chunk))
        # the slot's rows are stored (and only this chunk's and earlier ones), its counter at the target
        assert torch.equal(planes[dest][r0:r1], want[r0:r1, dest * cfg.n_slice:(dest + 1) * cfg.n_slice])
        assert torch.isnan(rows_view[r1:].float()).all()
        assert int(counters[layout.counter_index(dest, chunk)]) == plan.target(dest, chunk)

    run_chunks(a, b, config=cfg, plan=plan, partial_rows=rows_view, counters=counters, on_chunk_complete=complete)
    peers = [d for d in layout.dest_order(rank, world) if d != rank]
    assert handed == [(d, c) for c in range(plan.chunks) for d in peers]
    assert counters.view(world, layout.MAX_CHUNKS).tolist() == [list(t) for t in plan.counter_targets]
    assert torch.equal(rows_view[:m], want) and torch.isnan(rows_view[m:].float()).all()
    for d in range(world):  # every slot of the row-major planes holds its columns of the product
        assert torch.equal(planes[d][:m], want[:, d * cfg.n_slice:(d + 1) * cfg.n_slice])
    assert layout.partial_strides(cfg) == tuple(region.stride())


def _alternating_producers(comm, quant, m, n, k):
    from cco.op import GemmAllReduceOp
    from cco.preshuffle import preshuffle_b

    p = Q.random_problem(m, n, k, quant, seed=100 + comm.rank)
    b_pre = preshuffle_b(p.b)
    outs = {}
    for mode, gather in (("fused", "bf16"), ("split", "fp8")):
        with GemmAllReduceOp(comm, n=n, k=k, m_max=m + 64, quant=quant, mode=mode, transport="dma",
                             gather_dtype=gather, chunks=(1, 2, 1), deadline_s=DEADLINE_S) as op:
            for step, by_chunks in enumerate((True, False, True)):
                op._backend.chunk_producer = by_chunks
                outs[(mode, gather, step)] = op(p.a, b_pre, p.a_scale, p.b_scale)
                if step == 1:
                    op.self_test()
    return outs


@pytest.mark.multirank
@pytest.mark.parametrize("world, quant", [(2, "ptpc"), (2, "blockscale"), (2, "mxfp8"), (3, "ptpc")])
def test_op_with_the_chunk_producer_matches_the_reference_on_every_rank(world, quant):
    m, n, k = 130, 128 * world, 256
    per_rank = check_outcomes(spawn(_alternating_producers, world=world, args=(quant, m, n, k), timeout_s=240))
    ref = sum(Q.random_problem(m, n, k, quant, seed=100 + r).reference().float() for r in range(world))
    ref = ref.to(torch.bfloat16)
    for key, out in per_rank[0].items():
        for other in per_rank[1:]:
            assert torch.equal(other[key], out), key
        if key[1] == "fp8":
            assert Q.rel_l2(out, ref) < Q.REL_L2_TOL_FP8_GATHER, key
        else:
            assert Q.rel_l2(out, ref) < Q.REL_L2_TOL[quant] and Q.count_mismatches(out, ref) == 0, key
