"""Host tests of cco.layout: the arithmetic every kernel and transport reads."""

import itertools

import pytest

from cco import layout
from cco.transport.base import stamp_seq_m, unstamp, unstamp_seq_m

pytestmark = pytest.mark.host


def cfg(**kw):
    base = dict(n=512, k=256, m_max=256, world=4)
    base.update(kw)
    return layout.build_config(**base)


@pytest.mark.parametrize("kw, words", [
    (dict(n=500), ["n=500", "world=4"]),
    (dict(k=128), ["k=128", ">= 256"]),
    (dict(k=320), ["k=320", "multiple of 128"]),
    (dict(quant="blockscale", n=192, world=2), ["n=192", "blockscale", "128"]),
    (dict(quant="fp4"), ["quant='fp4'", "ptpc"]),
    (dict(mode="fast"), ["mode='fast'", "fused-lsa"]),
    (dict(transport="nvlink"), ["transport='nvlink'", "dma"]),
    (dict(mode="fused-lsa", transport="dma"), ["implies transport='lsa'"]),
    (dict(gather_dtype="fp16"), ["gather_dtype='fp16'", "fp8"]),
    (dict(chunks=9), ["chunks=9", "1..8"]),
    (dict(chunks=0), ["chunks=0"]),
    (dict(chunks=()), ["chunks=()", "positive ints"]),
    (dict(chunks=(1, 0, 1)), ["chunks=(1, 0, 1)", "positive ints"]),
    (dict(chunks=(1,) * 9), ["chunks=(1, 1", "1..8"]),
    (dict(chunks=True), ["chunks=True"]),
    (dict(block_n=48), ["block_n=48", "128"]),
    (dict(m_max=0), ["m_max=0"]),
], ids=lambda x: str(x)[:40])
def test_build_config_rejects_with_named_argument(kw, words):
    """Guards: a rejection that does not say which argument and what to pass instead."""
    with pytest.raises(ValueError) as err:
        cfg(**kw)
    for w in words:
        assert w in str(err.value)


def test_supports_uses_the_same_rules_as_build_config():
    assert layout.supports(128, 512, 256, 4) is None
    assert "k=128" in layout.supports(128, 512, 128, 4)
    assert "m=300 exceeds m_max=256" in layout.supports(300, 512, 256, 4, m_max=256)
    assert "n=512 is not divisible by world=3" in layout.supports(64, 512, 256, 3)
    assert layout.supports(1, 256, 256, 8, quant="mxfp8", gather_dtype="fp8", mode="split-lsa") is None


@pytest.mark.parametrize("alias, mode, transport", [
    ("gemm-only", "gemm-only", "dma"), ("split-sdma", "split", "dma"), ("fused-sdma", "fused", "dma"),
    ("split-lsa", "split", "lsa"), ("fused-lsa", "fused", "lsa"), ("fused", "fused", "dma"),
])
def test_mori_mode_names_are_aliases(alias, mode, transport):
    c = cfg(mode=alias)
    assert (c.mode, c.transport) == (mode, transport)


@pytest.mark.parametrize("gather", ["bf16", "fp8"])
@pytest.mark.parametrize("world", [2, 8])
def test_window_regions_are_aligned_disjoint_and_sized(world, gather):
    c = cfg(world=world, n=256, m_max=130, gather_dtype=gather)
    regions = sorted(c.window.regions(), key=lambda r: r.offset)
    for a, b in zip(regions, regions[1:]):
        assert a.offset + a.nbytes <= b.offset, (a, b)
    assert all(r.offset % layout.REGION_ALIGN == 0 for r in regions)
    assert regions[-1].offset + regions[-1].nbytes <= c.window.nbytes
    assert c.m_max_padded == 192 and c.window.partial.shape == (world, 192, 256 // world)
    assert c.window.gather.dtype == ("float8_e4m3fn" if gather == "fp8" else "bfloat16")
    groups = -(-(256 // world) // layout.GATHER_GROUP)  # one scale per row and 128 columns, last one narrower
    assert c.window.gather_scale.nbytes == (world * 192 * groups * 4 if gather == "fp8" else 0)
    assert c.window.tile_flags.shape == (2, world, 192 // c.block_m, c.n_tiles_per_dest)


@pytest.mark.parametrize("mode, world, pattern", [  # (gemm-only is the all-reduce op's mode alone)
    ("gemm-only", 1, "all-reduce"), ("gemm-only", 2, "all-reduce"),
    *[(mode, 1, pattern) for mode in ("fused", "split") for pattern in layout.PATTERNS]])
def test_a_window_where_nothing_is_published_has_no_data_planes(mode, world, pattern):
    """gemm-only, or one rank: the plain GEMM writes the output, so the window keeps its words
    alone (an 8B model's down projection at m_max 4096 mapped 96 MiB of planes it never wrote)."""
    quiet = cfg(world=world, n=256 * world, m_max=4096, mode=mode, pattern=pattern)
    busy = cfg(world=2, n=512, m_max=4096, mode="fused", pattern=pattern)
    by_rows = layout.PATTERNS[pattern].owner_by == "rows"
    assert quiet.m_max_padded == 4096 // (world if by_rows else 1)  # the plans keep their rows
    for name in ("partial", "recv", "gather", "gather_scale", "a_rows", "a_scales"):
        assert getattr(quiet.window, name).nbytes == 0, name
    assert quiet.window.tile_flags.nbytes == 0
    assert quiet.window.nbytes < 64 << 10, quiet.window.nbytes
    assert busy.window.nbytes > 1 << 20  # (the rule, not the sizes, is what changed: an op that publishes maps them)
    assert layout.publishes(mode, world) is False and layout.publishes("fused", 2) is True


@pytest.mark.parametrize("world", [2, 3])
def test_dest_major_walk_puts_every_peer_before_the_own_slice(world):
    c = cfg(world=world, n=96 * world, m_max=200, chunks=3)
    for rank in range(world):
        walk = layout.tile_table(c, m=200, rank=rank, dest_major=True)
        assert len(set(walk)) == len(walk) and set(walk) == set(layout.tile_table(c, m=200, rank=rank))
        dests = [t.dest for t in walk]
        assert dests == sorted(dests, key=lambda d: layout.dest_order(rank, world).index(d))
        own = [t for t in walk if t.dest == rank]
        # a peer walks its tiles for this rank in the order this rank walks its own ones
        for peer in range(world):
            if peer != rank:
                theirs = [t for t in layout.tile_table(c, m=200, rank=peer, dest_major=True) if t.dest == rank]
                assert theirs == own


@pytest.mark.parametrize("m", [1, 5, 63, 64, 65, 130, 256])
@pytest.mark.parametrize("chunks", [1, 3, 8, (1, 2, 2, 1), (5, 1)])
def test_chunks_cover_rows_exactly(m, chunks):
    c = cfg(chunks=chunks)
    rows = layout.chunk_rows(c, m)
    assert rows[0][0] == 0 and rows[-1][1] == m
    assert all(r1 > r0 for r0, r1 in rows)  # no empty chunk, even for M=1
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert len(rows) == min(len(layout.chunk_weights(c)), layout.padded_m(m, c.block_m) // c.block_m)
    assert all(r0 % c.block_m == 0 for r0, _ in rows)  # chunks are whole m-tiles


def test_chunk_sizes_follow_their_weights():
    """Relative chunk sizes split the m-tiles in proportion (rounded down at each end, at least
    one tile each); equal weights give the even split of an int."""
    c = cfg(chunks=(1, 2, 2, 2, 2, 2, 2, 1), block_m=128, m_max=16384)
    assert [t1 - t0 for t0, t1 in layout.chunk_tiles(c, 16384)] == [9, 18, 18, 19, 18, 18, 18, 10]
    assert layout.chunk_tiles(cfg(chunks=(1, 1, 1)), 640) == layout.chunk_tiles(cfg(chunks=3), 640)
    assert [t1 - t0 for t0, t1 in layout.chunk_tiles(cfg(chunks=(8, 1, 1)), 192)] == [1, 1, 1]  # 3 tiles


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_tile_table_covers_every_tile_once_in_chunk_dest_order(world):
    c = cfg(world=world, n=256, chunks=3)
    m = 200
    for rank in range(world):
        table = layout.tile_table(c, m=m, rank=rank)
        keys = [(t.dest, t.m_tile, t.n_tile) for t in table]
        assert len(keys) == len(set(keys)) == world * (layout.padded_m(m, c.block_m) // c.block_m) * c.n_tiles_per_dest
        assert [t.chunk for t in table] == sorted(t.chunk for t in table)
        for chunk in range(layout.call_chunks(c, m)):
            dests = [t.dest for t in table if t.chunk == chunk]
            order = list(dict.fromkeys(dests))
            assert order == list(layout.dest_order(rank, world))
            assert order[-1] == rank  # own slice last: it needs no transfer
        per_slot = layout.tiles_per_slot(c, m)
        for (chunk, dest), group in itertools.groupby(table, key=lambda t: (t.chunk, t.dest)):
            assert len(list(group)) == per_slot[chunk]


def test_tile_table_is_built_once_per_config_m_and_rank():
    """Guards: an eager GPU call rebuilding the table in Python every call (~20 ms at M=16384).
    Equal configs built separately share the entry; another M, rank or config gets its own."""
    a, b = cfg(world=2, n=256, chunks=2), cfg(world=2, n=256, chunks=2)
    assert a is not b and a == b
    table = layout.tile_table(a, m=130, rank=1)
    assert layout.tile_table(b, m=130, rank=1) is table
    assert layout.plan_call(b, m=130, seq=3, rank=1, counter_base=layout.zero_counters(2)).tiles is table
    assert layout.tile_table(a, m=130, rank=0) != table
    assert layout.tile_table(a, m=64, rank=1) != table
    assert layout.tile_table(cfg(world=2, n=256, chunks=1), m=130, rank=1) != table


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ranks_start_on_different_peers(world):
    """Guards: every rank hitting the same peer at the same step of the walk."""
    for j in range(world):
        assert sorted(layout.dest_order(r, world)[j] for r in range(world)) == list(range(world))


def test_counter_targets_grow_by_tiles_per_call_over_alternating_m():
    c = cfg(chunks=4)
    base = layout.zero_counters(c.world)
    for seq, m in enumerate([64, 1, 256, 130, 17, 256], start=1):
        plan = layout.plan_call(c, m=m, seq=seq, rank=1, counter_base=base)
        per_slot = layout.tiles_per_slot(c, m)
        for dest in range(c.world):
            for chunk in range(layout.MAX_CHUNKS):
                grow = plan.target(dest, chunk) - base[dest][chunk]
                assert grow == (per_slot[chunk] if chunk < plan.chunks else 0)
        tiles_per_slot = {}
        for t in plan.tiles:
            tiles_per_slot[(t.dest, t.chunk)] = tiles_per_slot.get((t.dest, t.chunk), 0) + 1
        assert all(plan.target(d, ch) - base[d][ch] == n for (d, ch), n in tiles_per_slot.items())
        base = plan.counter_targets


def test_padded_m_and_counter_index():
    assert [layout.padded_m(m, 64) for m in (1, 64, 65, 128)] == [64, 64, 128, 128]
    seen = {layout.counter_index(d, ch) for d in range(8) for ch in range(layout.MAX_CHUNKS)}
    assert seen == set(range(8 * layout.MAX_CHUNKS))


def test_seq_tag_m_stamp_round_trips():
    """A call's stamp holds its seq, its caller's tag and its rows whole: a tag that spilled into M
    (or M into the tag) would pass two layers' calls as one, or fail calls of the same layer."""
    for seq, m, tag in [(1, 1, 0), (50, 16384, 1), (2**30, layout.MAX_M, layout.CALL_TAGS - 1), (7, 1, 255)]:
        word = stamp_seq_m(seq, m, tag)
        assert unstamp(word) == (seq, m, tag)
        assert unstamp_seq_m(word) == (seq, m)
    # the seq cycles through 1 .. 2**31 - 1 (never 0: a word no call wrote): a word past int64 from
    # call 2**31 on before (test_op_cpu: calls across it)
    for seq, held in ((2**31 - 1, 2**31 - 1), (2**31, 1), (2**31 + 5, 6), (2 * (2**31 - 1), 2**31 - 1)):
        word = stamp_seq_m(seq, layout.MAX_M, layout.CALL_TAGS - 1)
        assert 0 <= word < 2**63 and unstamp(word) == (held, layout.MAX_M, layout.CALL_TAGS - 1), seq
    # every field changes the word
    assert len({stamp_seq_m(5, 8, 1), stamp_seq_m(5, 8, 2), stamp_seq_m(5, 9, 1), stamp_seq_m(6, 8, 1)}) == 4
    with pytest.raises(ValueError, match=f"m_max={layout.MAX_M + 1} is more rows than a call's stamp holds"):
        layout.build_config(n=256, k=256, m_max=layout.MAX_M + 1, world=2)


def test_transport_auto_and_backend_defaults():
    assert layout.build_config(n=256, k=256, m_max=64, world=2, transport="auto").transport == "auto"
    assert layout.build_config(n=256, k=256, m_max=64, world=2).transport == "dma"
    assert layout.build_config(n=256, k=256, m_max=64, world=2, default_transport="auto").transport == "auto"
    # an explicit transport or a mori alias wins over the backend's default
    assert layout.build_config(n=256, k=256, m_max=64, world=2, mode="fused-lsa",
                               default_transport="auto").transport == "lsa"


# --------------------------------------------------------------------------------------------------
# patterns: the reduce-scatter (rows, columns) and the all-gather
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["reduce-scatter-rows", "reduce-scatter-cols", "all-gather"])
@pytest.mark.parametrize("world, m", [(2, 130), (4, 200), (3, 9)])
def test_pattern_tiles_cover_each_rank_slice_once(pattern, world, m):
    """Guards: a tile computed twice or never, a slice cut at the wrong rows or columns, the
    all-gather's GEMM not starting on the own rows (which need no wait)."""
    c = cfg(world=world, n=384, m_max=512 * world, pattern=pattern, chunks=3)
    m -= m % world if pattern == "reduce-scatter-rows" else 0
    out_rows, out_cols = layout.out_shape(c, m)
    for rank in range(world):
        plan = layout.plan_call(c, m=m, seq=1, rank=rank, counter_base=layout.zero_counters(world))
        covered = set()
        for t in plan.tiles:
            row, col = plan.origins[t.dest]
            for r in range(t.row0, min(t.row0 + c.block_m, plan.slice_m)):
                for j in (t.col0, t.col0 + c.block_n - 1):  # the tile's first and last column
                    key = (row + r, col + j)
                    assert key not in covered, (rank, t)
                    covered.add(key)
        rows = m * world if pattern == "all-gather" else m
        assert covered == {(r, j) for r in range(rows) for j in range(c.n)
                           for j in [j] if j % c.block_n in (0, c.block_n - 1)}
        if pattern == "all-gather":
            assert plan.tiles[0].dest == rank and plan.counter_targets == plan.counter_base  # publishes nothing
            assert (out_rows, out_cols) == (m * world, c.n)
        elif pattern == "reduce-scatter-rows":
            assert plan.origins[rank] == (rank * m // world, 0) and (out_rows, out_cols) == (m // world, c.n)
        else:
            assert plan.origins[rank] == (0, rank * c.n // world) and (out_rows, out_cols) == (m, c.n // world)


def test_pattern_windows_hold_only_the_regions_their_phases_use():
    """The all-reduce's window is unchanged by the patterns (same offsets, same size); the
    reduce-scatter has no gather region, the all-gather only its input slots."""
    ar = cfg(world=2)
    assert ar.window == layout.window_layout(world=2, m_max_padded=ar.m_max_padded, n_slice=ar.n_slice,
                                             gather_dtype="bf16", m_tiles=ar.m_max_padded // ar.block_m,
                                             n_tiles=ar.n_tiles_per_dest)
    assert ar.window.a_rows.nbytes == 0 and ar.window.a_scales.nbytes == 0
    rs = cfg(world=2, pattern="reduce-scatter-rows")
    assert rs.window.gather.nbytes == 0 and rs.window.partial.shape == (2, 128, 512)  # M/W rows, all N
    ag = cfg(world=2, pattern="all-gather", quant="blockscale")
    assert ag.window.partial.nbytes == ag.window.recv.nbytes == ag.window.gather.nbytes == 0
    assert ag.window.a_rows.shape == (2, 128, 256) and ag.window.a_scales.shape == (2, 2, 128)


@pytest.mark.parametrize("pattern, m, words", [
    ("reduce-scatter-rows", 63, ["M=63", "multiple of world=2", "M=64"]),
    ("reduce-scatter-rows", 300, ["M=300", "m_max=256"]),
    ("all-gather", 129, ["M=129", "m_max=256", "128 per rank"]),
])
def test_call_rows_errors_say_the_fix(pattern, m, words):
    msg = layout.call_rows_error(cfg(world=2, pattern=pattern), m)
    assert msg is not None and all(w in msg for w in words), msg
    assert layout.call_rows_error(cfg(world=2, pattern=pattern), 64) is None


def test_new_patterns_refuse_gemm_only_and_rows_patterns_need_m_max_of_the_world():
    with pytest.raises(ValueError, match="mode='gemm-only'"):
        cfg(pattern="all-gather", mode="gemm-only")
    with pytest.raises(ValueError, match="m_max=2 is smaller than world=4"):
        cfg(pattern="reduce-scatter-rows", m_max=2)
    with pytest.raises(ValueError, match="scatter_dim=2"):
        layout.reduce_scatter_pattern(2)
