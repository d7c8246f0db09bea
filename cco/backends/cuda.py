"""NVIDIA backend: the Triton fp8 GEMM (``kernels_fused.hopper.gemm``) and the copy-engine ``dma``
transport (``cco.cuda.dma``) over a torch symmetric-memory window (a CUDA IPC window where ranks share
a GPU: ``cco.window``).

What runs where, per call (details and the stream diagram in ``cco.cuda.dma``):

- ``gemm`` (and every call at world 1): the GEMM ``kernels_fused.hopper.gemm.PLAIN_RULE`` picks
  for the quant and M, own Triton kernel or vendor (cuBLAS through torch,
  ``kernels_fused.hopper.vendor``), writing ``out`` directly; ``gemm_config`` forces either.
- ``fused``: a producer fills the window's partial region and raises ``counters[dest, chunk]`` to its
  target as each slice is complete (``DMA_PRODUCER`` picks per quant and M; ``producer`` forces one):

  * ``"kernel"``: one Triton launch with the fused epilogue (peer tiles into ``partial[dest]``,
    every peer's tiles before the own ones: the layout's (dest, chunk, m, n) order,
    ``DMA_PEERS_FIRST``; one release add per tile; where the GEMM's best tile is two layout tiles
    wide, one program covers a pair and adds 2);
  * ``"vendor"``: one vendor GEMM call per row chunk, every column, into the partial region read
    row-major (``cco.layout.partial_strides``), each followed by stream write-values that release
    the chunk's counters (``cco.cuda.dma.CopyEngineSchedule.produce_by_chunks``); the puts are
    then 2-D copies of a pitched block per destination.

  Copy-engine puts start on each (dest, chunk) as soon as its counter completes, while the GEMM
  still runs; reduce, gather and assemble follow chunk by chunk on side streams (or, kernel producer
  with ``DMA_REDUCE_IN_GEMM``, an own tile waits for the peers' copies of its chunk and reduces
  them in the GEMM's epilogue).
- ``split``: the same producer, then the same transfers gated on the whole GEMM (the baseline).

The weight arrives in the gfx950 bpreshuffle layout; the Triton kernel reads row-major ``[N, K]``,
so the backend keeps the unshuffled copy of the last weights it saw (keyed by storage and version:
an in-place update of the weight is noticed).

Deviation from the protocol text of ``cco.backends.base``: every counter and flag has one waiter; the
counters are zeroed at each call's start (on the main stream, before the GEMM and every side stream)
and each flag by its waiter after its wait. A stream wait's target is baked into a captured CUDA
graph, so monotonic words would let a replayed wait pass at once; consumed words keep every replay
correct. A set flag is 1, not the call's seq; the call's
(seq, M) stamp travels through a device word, so the copy-engine side work of a call can be captured
once and replayed by later eager calls (``cco.cuda.dma``: host time, not device time, bounds an eager
call otherwise).

``transport="lsa"`` (fused mode, and the self test) replaces the GEMM, the puts, the reduce and the
assemble by one kernel (``kernels_fused.hopper.gemm.fp8_gemm_lsa``) and no side stream: its programs
claim the entries of a walk that stores every peer's tiles straight into the owner's ``recv``, then
reduces the own tiles as the peers' tiles land and stores them into every peer's ``gather``, then
copies the peers' gathered tiles into ``out`` as they land. split-lsa is not implemented on CUDA.
With ``DECODE_SPLIT`` (on by default; ``CCO_DECODE_SPLIT=0`` turns it off) a call of at most ``DECODE_SPLIT_ROWS``
rows computes its GEMM first with the decode MMA on every multiprocessor into an [M, N] partial, and
the same kernel then runs only its transfers on it (``_decode_lsa``).

Deadlines (``cco.cuda.watchdog``): every call marks its entry and its exit in host memory from the
device; a watchdog thread per op releases a call that stays in past ``deadline_s`` (NaN output, the
op failed, ``CommTimeoutError`` from the next call, ``check()`` and ``close()``'s successors), and
reads the reduce's status word so that a peer's mismatched M or rejected inputs are raised by the
next call (after it took part in the collective) as well as by ``check()``. A rank that rejects its
inputs runs the call all the same, on NaN data, with its peers' M and a rejected stamp
(:meth:`CudaBackend.reject`). Lost puts (``FaultPlan.drops``) are injected on the copy engines.

Patterns (``cco.layout.PATTERNS``; ``cco.cuda.dma``'s module note has the streams): the
reduce-scatter runs the all-reduce's dma schedule without the gather's data (fused and split; along
columns the same producers, along rows the kernel producer walking row slices (the tile table, or
the walk computed by persistent warp-specialized programs: ``RS_ROWS_KERNEL_LAUNCH``) or one GEMM per group of
a dest's consecutive chunks of A's rows, ``RS_PRODUCER_ROWS``; ``RS_ROWS_PRODUCER`` picks by the rows
of such a GEMM: ``_produce``);
the all-gather puts its rows and scales on the copy engines and runs the GEMM of each peer's chunks
as they land, its own rows' GEMM beside them on a stream of its own (fused: one GEMM per group of a
source's consecutive chunks, ``AG_CONSUMER_ROWS``, or where each source is one group and the slots
hold no pad rows one GEMM
over the peers' slots on each side of the own one after the last wait: ``CudaBackend.consumer_merges``),
or of every row once all landed (split). Both run on the
``dma`` transport only: ``transport="auto"`` takes it, ``"lsa"`` is refused at construction (the lsa
kernel's epilogue knows the all-reduce only), with the same verdict on every rank.

``transport="auto"`` (the CUDA default) runs the lsa kernel for small outputs, where it is the
fastest path measured (0.87x of ``_scaled_mm`` + NCCL at M=2048 where the copy engines take 1.27x),
and the copy engines for large ones (``LSA_AUTO_MAX_ELEMENTS``). Both paths share the window and
may alternate between calls: their words are disjoint, and neither path's next call can overwrite
what a peer still reads. Call s+1 writes a peer's ``recv`` only after this rank finished call s,
which needed that peer's gathers of call s, sent after it read ``recv``; and it writes a peer's
``gather`` only after reducing, which needs that peer's scatter of call s+1, so after the peer
finished call s (its assemble included).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from cco import layout
from cco.backends.base import Backend, WeightDerived, row_major_readings
from cco.preshuffle import unshuffle_b
from cco.quant import SCALE_BLOCK
from cco.transport.base import REJECTED_M, stamp_seq, unstamp_seq_m
from cco.transport.protocol import PeerMismatchError
from cco.transport.reasons import post_rejection
from kernels_fused.hopper import gemm as hopper_gemm
from kernels_fused.hopper import vendor
from kernels_fused.hopper.decode import MMA_ROWS_MAX, QUANTIZED_ROWS, RowsMma

GEMM_BLOCK_M = 128  # wgmma-friendly tile rows; also the layout's m-tile (chunk granularity), but
# blockscale's, whose fused kernel runs 64-row programs (CudaBackend.tile)
GEMM_BLOCK_N = 128  # divides N/world for N = 7168 up to 8 ranks; ptpc gemm-only uses 128x256
# fused dma: the GEMM computes every peer's tiles before its own, so the scatters run back to back
# from the first slice on and the own tiles are computed while they fly (docs/experiments.md compares
# it with the layout's chunk-major order)
DMA_PEERS_FIRST = True
# fused dma, an alternative: the GEMM's own tiles wait for the peers' chunks and reduce them in the
# epilogue (kernels_fused.hopper.gemm.ReduceEpilogue) instead of a reduce kernel per chunk on a side
# stream. Measured level with the reduce kernel at 16384x7168 (the link bounds both,
# docs/experiments.md); split mode and the self test always use the reduce kernel
DMA_REDUCE_IN_GEMM = False
# fused / split on the copy engines: who fills the partial region (module note), per quant as
# ((largest M, producer), ...), the last row taking every larger M. Measured on one H200 with the window
# local, N=7168, K=2048, the layout of 2 ranks (4 chunks; the vendor GEMMs dealt to PRODUCER_STREAMS=2
# streams), CUDA-graph replays, same run: the time until every (dest, chunk) counter of the call is
# released, kernel / vendor in us (scripts/bench_gemm.py --producer; docs/hopper_gemm.md,
# docs/results/2026-12-02_producer_streams2_h200.json; that run's vendor arm zeroed the counters
# and wrote the stamp on a stream beside the first GEMM, a variant measured 0-2% slower than on the
# call's stream and not kept):
#   M            2048          4096           8192           16384          32768
#   ptpc         61.7 / 65.2   107.3 / 105.7  206.7 / 183.0  492.1 / 368.9  1002.1 / 746.5
#   blockscale   86.4 / 83.0   161.2 / 139.6  319.9 / 244.3  678.1 / 481.9  1392.6 / 944.1
#   mxfp8        117.0 / 109.5 197.6 / 204.5  376.9 / 325.1  775.1 / 734.9  1547.8 / 1430.1
# ptpc at 4096 is a tie (1.5%); the kernel keeps it, since it releases every tile as it is stored
# and the puts start sooner. The vendor arm on one stream, an earlier run, lost at 2048 and 4096
# for every quant (docs/results/2026-12-02_producer_h200.json). Below 2048 rows nothing was
# measured and the kernel stays (transport="auto" runs the lsa kernel there).
DMA_PRODUCER = {
    "ptpc": ((4096, "kernel"), (None, "vendor")),
    "blockscale": ((1024, "kernel"), (None, "vendor")),
    "mxfp8": ((1024, "kernel"), (2048, "vendor"), (4096, "kernel"), (None, "vendor")),
}
# the reduce-scatter along rows (``_produce``), per quant as ((largest rows of one chunk's GEMM,
# producer), ...): the vendor producer issues W * C GEMMs of M / (W C) rows, which fill the GPU
# worse the fewer rows each has; the kernel producer is one tile-table launch whatever W and C, but
# its GEMM is the own Triton kernel (blockscale's runs ~1.6-1.7x of cuBLAS's whole GEMM here).
# Measured on one H200 (2026-12-03 11:35 UTC, scripts/bench_sp_parts.py --pattern rs-rows --tp 2,4,8
# -m 4096,16384, docs/results/2026-12-03_sp_rs_rows_producers_h200.json): time until every slice is
# released over the whole vendor GEMM, kernel / vendor, Llama-3-70B and DeepSeek-V3 down_proj:
#   rows of a chunk   128                    256                    512                      1024+
#   ptpc              1.25-1.32 / 2.01-2.51  1.15-1.20 / 1.28-1.35  1.08-1.29 / 1.14-1.26    1.09-1.20 / 1.01-1.11
#   blockscale        1.08-1.68 / 1.78-1.95  1.70 / 1.20-1.24       1.06-1.72 / 1.06-1.18    1.57-1.63 / 1.01-1.15
#   mxfp8             1.27-1.29 / 1.81-1.94  1.23-1.28 / 1.17-1.24  1.07-1.25 / 1.00-1.12    1.06-1.23 / 0.97-1.03
# (ptpc at 512 rows: the kernel wins three of the four cells, by up to 0.12; vendor the fourth by 0.08.)
# Since the vendor producer's GEMMs take groups of a slice's chunks (RS_PRODUCER_ROWS, below), the
# rule reads the rows of a group's GEMM (2026-12-04 16:40 UTC, the same command, raw
# docs/results/2026-12-04_late_session/sp_rs.json; rule / kernel / vendor in groups / a GEMM a chunk):
#   W 8, 4096 tokens (one group of 512 a slice): ptpc 1.26-1.31 / same / 1.26-1.47 / 2.04-2.56;
#   blockscale 1.18-1.22 / 1.09-1.68 / 1.18-1.20 / 1.85-1.94; mxfp8 1.10-1.20 / 1.18-1.22 / 1.11-1.21 / 1.87-1.92
#   W 4, 4096 (two groups of 512): ptpc 1.14-1.20 (kernel); blockscale 1.14-1.19, mxfp8 1.15-1.16 (vendor)
# so blockscale and mxfp8 take the vendor GEMM at every group of 512 rows and more, and the kernel
# where cuBLAS does not take the K (DeepSeek-V3 at TP 8, K 2304: 1.09 against 1.20).
RS_ROWS_PRODUCER = {
    "ptpc": ((512, "kernel"), (None, "vendor")),
    "blockscale": ((128, "kernel"), (None, "vendor")),
    "mxfp8": ((128, "kernel"), (None, "vendor")),
}
# the vendor producer of the reduce-scatter along rows, per quant: the fewest rows one GEMM over a
# dest's consecutive chunks takes (``consumer_groups`` over the slice's chunks); the group's counters
# are released together after its GEMM. The slices are produced one after another, peers first and
# the own one last, so a group's puts still overlap the later slices' GEMMs and the last peer's puts
# the own slice's: what a group gives up is the finer start of its own first chunks' puts, while
# W * C GEMMs of M / (W C) rows become fewer, fuller ones. 1: a GEMM per chunk.
RS_PRODUCER_ROWS = {"ptpc": 512, "blockscale": 512, "mxfp8": 512}
# the reduce-scatter along rows' kernel producer, per quant: "ws" the persistent warp-specialized
# walk with computed coordinates (``fp8_gemm_rows_ws``; the dest-major order only), else the grid
# launch over the tile table (``fp8_gemm(fuse=True, slice_rows=)``), by the two timed side by side
# (bench_sp_parts' ``kernel-grid`` and ``kernel-ws`` arms; docs/BENCHMARKS.md, "The reduce-scatter
# along rows: the warp-specialized walk"); ``rows_kernel_launch`` forces either. Timed on one H100
# (2026-12-07 02:51 UTC, the walk with the barrier Triton 3.6 needs; raw
# docs/results/2026-12-07b_rows_ws_mended_h100/): ptpc's walk is below the grid launch in all eight
# cells (Llama-3-70B and DeepSeek-V3 down_proj, W 4 and 8, 4096 and 16384 tokens; 0.91-0.97x of its
# time, median 0.937), hence "ws"; blockscale's ran 1.5-2.1x of grid's (the 00:10 run), grid stays.
# Where the installed Triton's compile of the walk may release a tile before its stores land
# (``hopper_gemm.check_releases``, before the launch), this rule's "ws" runs the grid launch and a
# forced one raises.
RS_ROWS_KERNEL_LAUNCH = {"ptpc": "ws", "blockscale": "grid", "mxfp8": "grid"}
# the walk's two forms: "ws" releases each tile once its writes are done; "ws-lag" one tile late,
# before the program's next tile's stores (``fp8_gemm_rows_ws(release_lag=True)``: on Triton 3.6
# the loop then need not wait for a tile's writes). Timed beside "ws" (one H100, 2026-12-07 05:11
# UTC, raw docs/results/2026-12-07c_rows_ws_lag_h100/): lower in 6 of the 8 cells, median 0.983x
# of its time, short of the 0.97x set before the run; so no rule takes it, a forced launch does
WALKS = ("ws", "ws-lag")
PRODUCERS = ("kernel", "vendor")
# the all-gather's consumer (``all_gather_gemm``), per quant: the fewest rows one GEMM over a peer's
# landed chunks takes. Consecutive chunks of one source go to one GEMM until they reach it
# (``consumer_groups``); the GEMM waits for the group's last chunk, so a larger group trades the
# overlap of its first chunks' GEMM with the later chunks' puts (which one GPU cannot time) for
# fewer, fuller GEMMs. Measured on one H200 (2026-12-03 13:09 UTC, scripts/bench_sp_parts.py
# --pattern ag --tp 2,4,8 -m 4096,16384; docs/results/2026-12-03_sp_ag_consumer_h200.json): the
# consumer's GEMMs over the whole GEMM, Llama-3-70B and DeepSeek-V3 gate_up, every quant:
#   least rows          W 8, 4096 tokens   W 8, 16384   W 4, 4096   W 4, 16384   W 2
#   1 (a GEMM a chunk)  2.03-4.06          1.10-1.96    1.12-1.81   1.02-1.23    1.00-1.14
#   1024                1.21-2.20          1.12-1.52    1.03-1.24   1.01-1.22    1.01-1.07
#   all a peer's rows   1.21-2.21          1.02-1.24    1.04-1.24   1.04-1.09    0.98-1.08
# 2048: a GEMM per peer wherever a peer has at most 2048 rows (every W 8 and W 4 / 4096 cell above),
# two chunks a GEMM at W 4 and 2 with 16384 tokens, keeping half a peer's rows overlapped there.
# Its arm, re-measured (13:24 UTC, docs/results/2026-12-03_sp_ag_consumer_rule_h200.json): W 8 4096
# 1.21-2.27, W 8 16384 1.04-1.26, W 4 4096 1.04-1.25, W 4 16384 1.05-1.12, W 2 1.01-1.08.
AG_CONSUMER_ROWS = {"ptpc": 2048, "blockscale": 2048, "mxfp8": 2048}
# Where that gives each source ONE group, every peer's GEMM waits for the peer's last chunk, and the
# puts are chunk-major (chunk 0 to every peer, then chunk 1, ...: gather_inputs), so the peers' last
# chunks all land at about the end of the gather: one GEMM over every peer's rows after the last wait
# (at most two: the rows before the own slot and after it) loses about no overlap with the link and
# replaces W-1 GEMMs of M/W rows, which fill the GPU badly (the table above, W 8 at 4096 tokens), by
# one or two large ones. It needs the peers' slots to be one block of rows, i.e. no pad rows between
# them: a call of ``m_max_padded`` rows per rank (``CudaBackend.consumer_merges``). Measured on one H200
# (2026-12-04 16:42 UTC, the same command, docs/results/2026-12-04_late_session/sp_ag.json): W 8 4096
# 1.13-1.55 (a GEMM per peer in the same run 1.21-2.20), W 8 16384 1.01-1.15, W 4 4096 1.02-1.17.
LSA_LAUNCH = "ticket"  # GemmConfig.launch of the lsa kernel (docs/experiments.md compares the choices)
# transport="auto": the lsa kernel while a rank's output has at most this many elements (M * N), the
# copy engines above. Measured on 2 H200 at N=7168, K=2048, ptpc (docs/BENCHMARKS.md, sweep): bf16
# gather lsa/dma 149/219 us at M=2048, 269/304 at 4096, 479/484 at 8192, 921/842 at 16384; fp8 gather
# 157/206 at 2048, 286/282 at 4096.
LSA_AUTO_MAX_ELEMENTS = {"bf16": 8192 * 7168, "fp8": 2048 * 7168}
# A fused lsa call of at most this many rows, per quant, where DECODE_SPLIT is on (or a backend's
# decode_split forces it): its GEMM as the decode MMA over the quantized rows
# (kernels_fused.hopper.decode.RowsMma: every multiprocessor, K split over programs) into an [M, N]
# partial, then the lsa kernel's transfers on it (from_partial), instead of the lsa kernel's own
# GEMM, whose programs are one per output tile: 16-64 of them reading the whole weight at decode
# sizes. The transfers are the same kernel's either way. Measured on one H100, cold weights, graph
# replay (scripts/probe_decode_world_gemm.py, docs/decode.md, "World >= 2: the decode MMA before the
# lsa kernel's transfers"): the lsa kernel's GEMM 0.88-2.25x of nn.Linear's device time at
# Llama-3-8B / 70B o_proj and down_proj at TP 2 and 8, 1..64 rows, against 0.57-1.57x for the decode
# MMA plus one more launch: 0.7-28.7 us less a call at every cell (median ratio 0.66). mxfp8 (no fp8
# MMA over its rows past one) keeps the lsa kernel's GEMM.
DECODE_SPLIT_ROWS = {"ptpc": 64, "blockscale": 64}
# On by default (CCO_DECODE_SPLIT=0 turns it off), eager and captured calls alike: taken under
# graph captures only, it made a captured greedy decode at world 2 pick other tokens than the eager
# steps (test_cuda_hf's static-cache check, 2026-12-07: the two GEMMs sum in other orders); taken by
# both, the whole GPU suite passed (one H100, 2026-12-07 09:13-09:31 UTC). Its eager cost: one launch
# more than the kept lsa call (docs/decode.md, "On by default").
DECODE_SPLIT = os.environ.get("CCO_DECODE_SPLIT", "1") != "0"


def _not_capturing() -> bool:
    return not torch.cuda.is_current_stream_capturing()


def dma_producer(quant: str, m: int, rule: dict = DMA_PRODUCER) -> str:
    """The producer ``rule`` (``DMA_PRODUCER``: by the call's M; ``RS_ROWS_PRODUCER``: by the rows
    of one chunk's GEMM) picks for ``m``: the first row whose largest covers m."""
    return next(producer for largest, producer in rule[quant] if largest is None or m <= largest)


def rows_producer(cfg: layout.OpConfig, m: int, least: int | None = None) -> str:
    """The producer ``RS_ROWS_PRODUCER`` picks for a reduce-scatter along rows of ``m`` rows: by
    the rows of the vendor producer's largest GEMM (its groups of a slice's chunks,
    ``cco.layout.chunk_rows``, at ``least`` rows, else ``RS_PRODUCER_ROWS``'s); the kernel where the
    vendor GEMM does not take those rows or that K (``vendor.takes_rows``: its GEMMs would be the own
    kernel's, one launch each, where one launch walks them all)."""
    rows = layout.chunk_rows(cfg, m)
    groups = [(rows[c0][0], rows[c1 - 1][1]) for c0, c1 in
              consumer_groups(rows, RS_PRODUCER_ROWS[cfg.quant] if least is None else least)]
    if not vendor.takes_rows(cfg.quant, groups, cfg.k):
        return "kernel"
    return dma_producer(cfg.quant, max(r1 - r0 for r0, r1 in groups), RS_ROWS_PRODUCER)


def consumer_groups(rows, least: int) -> tuple[tuple[int, int], ...]:
    """The all-gather consumer's GEMMs over one source's chunks (and the reduce-scatter's vendor
    producer's over one dest's slice): ``[c0, c1)`` ranges of consecutive
    chunks (``rows``: each chunk's ``(r0, r1)``, ``CallPlan.rows``), each closed once its rows reach
    ``least``; a last range short of it joins the one before (no GEMM smaller than ``least`` rows
    unless the source has fewer). ``least <= 1``: one GEMM per chunk."""
    groups, start, count = [], 0, 0
    for c, (r0, r1) in enumerate(rows):
        count += r1 - r0
        if count >= least:
            groups.append((start, c + 1))
            start, count = c + 1, 0
    if start < len(rows):
        if groups:
            groups[-1] = (groups[-1][0], len(rows))
        else:
            groups.append((start, len(rows)))
    return tuple(groups)


def lsa_max_elements(cfg: layout.OpConfig) -> int | None:
    """Largest output (M * N elements) a fused call runs through the lsa kernel: None for any, 0
    for none (transport dma, and split mode), else the ``auto`` threshold of the gather dtype."""
    if (cfg.mode == "split" or cfg.transport == "dma" or cfg.pattern != "all-reduce"
            or not cfg.publishes):  # (no planes for its window to bind)
        return 0
    return None if cfg.transport == "lsa" else LSA_AUTO_MAX_ELEMENTS[cfg.gather_dtype]


def fused_config(cfg: layout.OpConfig):
    """(GemmConfig, tile weight) of the fused dma launch: the quant's best tile, which may be two
    layout tiles wide (same order, and each program then counts for both)."""
    from kernels_fused.hopper.gemm import default_config

    base = default_config(cfg.quant)
    wide = base.block_n == 2 * cfg.block_n and cfg.n_tiles_per_dest % 2 == 0 and base.block_m == cfg.block_m
    weight = 2 if wide else 1
    return dataclasses.replace(base, block_m=cfg.block_m, block_n=cfg.block_n * weight), weight


def lsa_config(base, *, block_m: int, block_n: int, n_slice: int):
    """(GemmConfig, tile weight) of the lsa kernel: the quant's fused tile ``base`` over the layout's
    ``block_m`` x ``block_n`` tiles, two layout tiles wide where ``base`` is and a rank's ``n_slice``
    columns hold them in pairs, claimed by ticket (``LSA_LAUNCH``)."""
    width = 2 if n_slice % (2 * block_n) == 0 and base.block_n == 2 * block_n else 1
    return dataclasses.replace(base, block_m=block_m, block_n=block_n * width, launch=LSA_LAUNCH), width


def dense_block_scales(quant: str, a_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``a_scale`` of a block of ``rows`` rows as a GEMM of those rows reads it: blockscale's
    ``[rows, K/128]`` column-major with column stride ``rows`` (a copy where it is a view of a longer
    scale or of a window slot); other quants as they are. cuBLAS's blockwise recipe and the gfx950
    kernel both read it so."""
    if quant == "blockscale" and rows > 1 and a_scale.stride() != (1, rows):
        return a_scale.t().contiguous().t()
    return a_scale


def fused_table(cfg: layout.OpConfig, *, m: int, rank: int, dest_major: bool, tile_weight: int, device):
    """The fused dma launch's tile table for ``m`` rows on ``rank`` (``cco.layout.tile_table`` order,
    pairs merged for a tile two layout tiles wide)."""
    from kernels_fused.hopper.gemm import merge_tile_pairs, tile_table_tensor

    rows = layout.tile_table_rows(layout.tile_table(cfg, m=m, rank=rank, dest_major=dest_major))
    if tile_weight == 2:
        rows = merge_tile_pairs(rows, layout_block_n=cfg.block_n)
    return tile_table_tensor(rows, device=device)


class CudaBackend(Backend):
    name = "cuda"
    block_m = GEMM_BLOCK_M
    block_n = GEMM_BLOCK_N
    default_transport = "auto"
    lsa_max_elements: int | None = 0  # uses_lsa: None always, 0 never, else up to M * N elements
    # DECODE_SPLIT's pick per call (None); True: every lsa call of rows the decode MMA takes; False:
    # none (the GPU tests' arms)
    decode_split: bool | None = None
    dma_peers_first = DMA_PEERS_FIRST  # the fused dma launch's tile order (False: the layout's chunk-major)
    dma_reduce_in_gemm = DMA_REDUCE_IN_GEMM  # the fused dma launch reduces its own tiles (kernel producer)
    producer = "kernel"  # who fills the partial region on the dma path (PRODUCERS); None: DMA_PRODUCER per call
    weight_layouts = ("row-major", "bpreshuffle")  # the Triton kernels read row-major: taken as is
    consumer_rows: int | None = None  # the all-gather's least rows a GEMM: None AG_CONSUMER_ROWS, 1 one per chunk
    producer_rows: int | None = None  # the reduce-scatter's vendor producer's: None RS_PRODUCER_ROWS
    rows_kernel_launch: str | None = None  # its kernel producer's launch: None RS_ROWS_KERNEL_LAUNCH, "ws", "ws-lag", "grid"
    # the all-gather's peers' GEMMs merged into one over their slots after the last wait: None the rule
    # (one group per source and no pad rows: consumer_merges), True always (refused where the slots hold
    # pad rows), False never (a GEMM per group of each source's chunks)
    consumer_merge: bool | None = None
    # every pattern, on the copy engines; the lsa kernel runs the all-reduce only (config_error)
    patterns = tuple(layout.PATTERNS)
    # calls marked and watched (cco.cuda.watchdog); False only for the cost measurement's "before"
    # arm (tests/python/cco/test_cuda_faults.py --bench), whose waits have no deadline
    watched = True

    _gemm_config = None

    @property
    def gemm_config(self):
        """A GemmConfig forcing the plain GEMM (the own kernel, or ``launch="cublas"``); None:
        ``PLAIN_RULE`` per M. Setting it retires the op's kept plain launches (``plain_epoch``)."""
        return self._gemm_config

    @gemm_config.setter
    def gemm_config(self, cfg) -> None:
        self._gemm_config = cfg
        self.plain_epoch += 1

    @classmethod
    def tile(cls, quant: str) -> tuple[int, int]:
        """The layout's m-tile is the fused kernel's (``kernels_fused.hopper.gemm.default_config``):
        a kernel tile then covers one layout tile, or two side by side (``fused_config``)."""
        from kernels_fused.hopper.gemm import QUANT_ID, default_config

        return (default_config(quant).block_m if quant in QUANT_ID else cls.block_m), cls.block_n

    @classmethod
    def config_error(cls, cfg):
        err = super().config_error(cfg)
        if err is None and cfg.transport == "lsa" and cfg.pattern != "all-reduce":
            err = NotImplementedError(
                f"transport 'lsa' runs the all-reduce only on CUDA (the lsa kernel's epilogue stores, reduces and "
                f"gathers the all-reduce's tiles); the {cfg.pattern} pattern runs on the copy engines: pass "
                f"transport='dma' or 'auto'")
        if err is None and cfg.transport == "lsa" and cfg.mode == "split":
            err = ValueError("mode 'split' with transport 'lsa' is not implemented on CUDA (the lsa transport lives in "
                             "the fused kernel's epilogue); pass transport='dma' for split")
        return err

    @classmethod
    def supports_device(cls, device):
        device = torch.device(device)
        if device.type != "cuda" or getattr(torch.version, "hip", None):
            return f"CudaBackend runs on NVIDIA CUDA devices, not {device}"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "CudaBackend needs triton (pip install triton)"
        from cco.cuda.memops import supports_mem_ops

        try:
            return supports_mem_ops(device.index or 0)
        except ImportError as err:  # the CUDA driver's Python bindings (imported at their first use)
            return f"CudaBackend needs cuda-bindings (pip install cuda-bindings): {err}"

    def _take_window(self):
        """How both device backends' ``__init__`` start (gfx950's subclasses this one): refuse a
        config this backend cannot run, bind the window's device, rank, partial region and counters;
        returns the fault plan's lost puts (``_lost_puts``)."""
        self._refuse_config()
        drops = self._lost_puts()
        self.device = self.window.device
        self.rank, self.world = self.window.rank, self.window.world
        w = self.config.window
        self.partial = self.window.tensor(w.partial, rank=self.rank)
        self.counters = self.window.words(w.counters, rank=self.rank)
        return drops

    def _lost_puts(self):
        """``FaultPlan.dropped`` when lost puts are to be injected (on the copy engines), else None."""
        if self.faults is None or not self.faults.drops:
            return None
        if self.config.transport == "lsa":
            raise ValueError(f"{type(self).__name__}: lost-put faults (FaultPlan.drops) are injected on the copy "
                             f"engines; the lsa kernel stores its tiles itself: pass transport='dma'")
        return self.faults.dropped

    def _marks(self):
        """The call marks of an op whose calls wait on peers (None: nothing to watch)."""
        if not self.watched or self.config.mode == "gemm-only" or self.world == 1:
            return None
        from cco.cuda.watchdog import CallMarks

        return CallMarks()

    def _watch(self, memops) -> None:
        """Start the watchdog of the schedule's marked calls (``cco.cuda.watchdog``)."""
        self.watchdog = None
        self._deferred = None
        if self.schedule is not None and self.schedule.marks is not None:
            from cco.cuda.watchdog import Watchdog

            self.watchdog = Watchdog(marks=self.schedule.marks, window=self.window, config=self.config,
                                     schedule=self.schedule, memops=memops, deadline_s=self.deadline_s,
                                     notes=self.notes)

    def __init__(self, **kw):
        super().__init__(**kw)
        cfg = self.config
        drops = self._take_window()
        faults = self.faults
        from cco.cuda import memops
        from cco.cuda.dma import FLAG_BY_COPY, CopyEngineSchedule
        from kernels_fused.hopper.gemm import default_config

        self.schedule = CopyEngineSchedule(config=cfg, window=self.window, device=self.device,
                                           silent=bool(faults is not None and faults.silent), replay=drops is None,
                                           flag_by_copy=FLAG_BY_COPY, marks=self._marks(), drops=drops)
        base = default_config(cfg.quant)
        self.fused_config, self.tile_weight = fused_config(cfg)
        self.producer = None  # DMA_PRODUCER's pick per call; "kernel" / "vendor" force one
        # the vendor producer's reading of the partial region: whole rows of [M, N] where slices are
        # columns (the reduce-scatter along rows produces each slice's own rows: _produce_rows)
        self.partial_rows = self.partial_by_rows = None
        if cfg.pattern_spec.scatter and cfg.pattern_spec.owner_by == "cols":
            self.partial_rows, self.partial_by_rows = row_major_readings(self.partial, cfg)
        if cfg.publishes:  # (else no call launches them: the plain GEMM writes out)
            self.schedule.load_kernels(tuple(p for p in (self.partial, self.partial_by_rows) if p is not None))
        self._tables: dict[tuple, torch.Tensor] = {}  # _kept's
        # the rule's walk for the reduce-scatter along rows refused by this Triton's compile
        # (hopper_gemm.UnorderedReleases): the grid launch from then on
        self._walk_refused = False
        self._plain_configs: dict[int, object] = {}  # M -> PLAIN_RULE's config
        # the preshuffled weight unshuffled for the Triton kernels and the vendor GEMM, and the weight
        # as the vendor GEMM takes it (mxfp8's is a bf16 copy): per weight, since the layers of this
        # shape (one op) would otherwise derive them anew at every call of a model's decode step, and
        # a copy a CUDA graph read must outlive another weight's call
        self._weight = WeightDerived()
        self._vendor_weight = WeightDerived()
        self.lsa_max_elements = 0 if drops is not None else lsa_max_elements(cfg)
        if self.lsa_max_elements != 0:
            self._init_lsa(base)
        self._watch(memops)

    def uses_lsa(self, m: int) -> bool:
        """Whether a fused call (or self test) with ``m`` rows runs the lsa kernel."""
        limit = self.lsa_max_elements
        return limit is None or m * self.config.n <= limit

    def path_rows(self) -> list[int]:
        """``[m_max]``, plus under ``auto`` the most rows the lsa kernel takes when m_max does not."""
        rows = [self.config.m_max]
        lsa_rows = min(self.config.m_max, (self.lsa_max_elements or 0) // self.config.n)
        if lsa_rows >= 1 and not self.uses_lsa(rows[0]):
            rows.append(lsa_rows)
        return rows

    def _init_lsa(self, base) -> None:
        from kernels_fused.hopper.gemm import LsaWindow, peer_deltas

        cfg, w, r = self.config, self.config.window, self.rank
        self.lsa_config, self.lsa_weight = lsa_config(base, block_m=cfg.block_m, block_n=cfg.block_n,
                                                      n_slice=cfg.n_slice)
        deltas = peer_deltas([self.window.tensor(w.header, rank=p).data_ptr() for p in range(self.world)], r)
        fp8 = cfg.gather_dtype == "fp8"
        self.lsa_window = LsaWindow(
            partial=self.partial, recv=self.window.tensor(w.recv, rank=r), gather=self.window.tensor(w.gather, rank=r),
            gather_scale=self.window.tensor(w.gather_scale, rank=r) if fp8 else None,
            tile_flags=self.window.tensor(w.tile_flags, rank=r),
            deltas=torch.tensor(deltas, dtype=torch.int64, device=self.device), status=self.schedule.status,
            ticket=torch.zeros(1, dtype=torch.int64, device=self.device))

    # ---- helpers ------------------------------------------------------------------------------------
    def _unshuffled(self, b_pre: torch.Tensor) -> torch.Tensor:
        if self.config.weight_layout == "row-major":  # laid out once by its owner (cco.nn)
            return b_pre
        # (a copy made while capturing holds its bytes only once the graph replays: not kept; a weight
        # written in place is unshuffled into the same copy, which a graph captured before reads)
        return self._weight.get((b_pre,), lambda: unshuffle_b(b_pre), keep=_not_capturing,
                                refresh=lambda kept: unshuffle_b(b_pre, out=kept))

    def _vendor(self, b_pre: torch.Tensor, b_scale: torch.Tensor) -> "vendor.VendorWeight":
        """The weight as the vendor GEMM takes it (``kernels_fused.hopper.vendor.prepare_weight``:
        views, or mxfp8's bf16 copy), kept per weight while it and its scales are unchanged (the op
        checked their shapes: the same for every call)."""
        quant = self.config.quant
        return self._vendor_weight.get(
            (b_pre, b_scale), lambda: vendor.prepare_weight(self._unshuffled(b_pre), b_scale, quant),
            keep=_not_capturing,
            # mxfp8's bf16 copy: a weight written in place is dequantized into the same copy, which a
            # CUDA graph captured after an eager call reads (replacing it would free it under the graph)
            refresh=lambda kept: vendor.prepare_weight(self._unshuffled(b_pre), b_scale, quant, into=kept))

    def _dense_b(self, b_pre: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor | None:
        """mxfp8's kept bf16 copy of the weight (``_vendor``) for the own Triton kernels, which
        otherwise dequantize the whole weight on every call (they run bf16 MMAs for mxfp8: Hopper has
        no e8m0 one); None for the other quants, whose kernels read the fp8 weight."""
        return self._vendor(b_pre, b_scale).dense if self.config.quant == "mxfp8" else None

    def _plain_config(self, m: int):
        """The plain GEMM's config for ``m`` rows: ``gemm_config``, else ``PLAIN_RULE``'s (kept per M)."""
        cfg = self.gemm_config or self._plain_configs.get(m)
        if cfg is None:
            cfg = self._plain_configs[m] = hopper_gemm.default_config(self.config.quant, plain=True, m=m,
                                                                      k=self.config.k)
        return cfg

    def _kept(self, key: tuple, build):
        """The call shape's device tensor under ``key`` (a tile table, a chunk map; or what a decode
        call's path keeps per M, ``_decode_lsa``), ``build()`` once: kept for the backend's life (the
        window's m_max bounds the shapes)."""
        kept = self._tables.get(key)
        if kept is None:
            kept = self._tables[key] = build()
        return kept

    def _table(self, plan) -> torch.Tensor:
        return self._kept((plan.m, self.dma_peers_first), lambda: fused_table(
            self.config, m=plan.m, rank=self.rank, dest_major=self.dma_peers_first, tile_weight=self.tile_weight,
            device=self.device))

    def _chunk_map(self, plan) -> torch.Tensor:
        return self._kept(("rows chunks", plan.m), lambda: hopper_gemm.rows_chunk_map(
            layout.chunk_tiles(self.config, plan.m), device=self.device))

    def _lsa_table(self, m: int) -> torch.Tensor:
        def build():
            from kernels_fused.hopper.gemm import lsa_walk_rows, tile_table_tensor

            return tile_table_tensor(lsa_walk_rows(self.config, m=m, rank=self.rank, width=self.lsa_weight),
                                     device=self.device)
        return self._kept(("lsa", m), build)

    def _lsa(self, a, b_pre, a_scale, b_scale, out, plan, *, from_partial: bool) -> None:
        from kernels_fused.hopper.gemm import fp8_gemm_lsa

        silent = self.faults is not None and self.faults.silent
        self._lsa_call(plan, lambda stamp: fp8_gemm_lsa(
            None if from_partial else a, None if from_partial else self._unshuffled(b_pre), a_scale, b_scale,
            quant=self.config.quant, out=out, win=self.lsa_window, tile_table=self._lsa_table(plan.m), rank=self.rank,
            stamp=stamp, config=self.lsa_config, from_partial=from_partial, move_bytes=not silent, validated=True,
            b_dense=None if from_partial else self._dense_b(b_pre, b_scale)))

    def _lsa_call(self, plan, launch) -> None:
        """One lsa call's host side around ``launch(stamp)`` (the kernel's launch with the call's
        (seq, M) stamp): the stamp word and the begin event (``schedule.begin``), the watchdog's
        marks of the call in flight, and the rows whose tile flags its release must cover."""
        sch = self.schedule
        sch.begin(plan)
        sch.path = "lsa"
        if sch.lsa_rows < plan.m:
            sch.lsa_rows = plan.m
        marks = sch.marks
        if marks is not None:
            marks.enter(sch._write, sch.main)
        launch(sch.stamp_of(plan))
        if marks is not None:
            marks.leave(sch._write, sch.main)

    def splits_decode(self, a, a_scale, m: int) -> bool:
        """Whether a fused lsa call of ``m`` rows runs the decode MMA before the lsa kernel's transfers
        (``DECODE_SPLIT_ROWS``, ``decode_split``): rows the MMA takes (contiguous, their scales in the
        activation quantizer's layout), else the lsa kernel's own GEMM, which moves the same bytes."""
        force = self.decode_split
        if force is False or (force is None and not DECODE_SPLIT):  # (first: every kept eager call asks)
            return False
        quant = self.config.quant
        if quant not in QUANTIZED_ROWS or (force is None and m > DECODE_SPLIT_ROWS.get(quant, 0)):
            return False
        return (1 <= m <= MMA_ROWS_MAX and self.config.k % SCALE_BLOCK == 0 and a.is_contiguous()
                and (a_scale.is_contiguous() if quant == "ptpc" else a_scale.stride() == (1, m)))

    def _decode_lsa(self, a, w, a_scale, b_scale, out, plan) -> None:
        """A fused lsa call as the decode MMA over ``a`` and the row-major weight ``w`` (``_unshuffled``)
        into an [M, N] partial (the window's partial region read as rows: the dma path's producer,
        which also fills it, has finished with it by the end of its call), then the lsa kernel's
        transfers on that partial."""
        m = plan.m

        def build():  # per M: the MMA, its partial, and the transfers' launch with the partial bound (an
            # eager call's host time: the kept lsa call's reason, "The kept world-2 call" in docs/decode.md)
            cfg = self.config
            partial = self.partial.view(-1)[:m * cfg.n].view(m, cfg.n)
            return RowsMma(cfg.quant, m, cfg.k, cfg.n, self.device), partial, hopper_gemm.lsa_partial_launch(
                partial, quant=cfg.quant, out=out, win=self.lsa_window, tile_table=self._lsa_table(m), rank=self.rank,
                config=self.lsa_config, move_bytes=not (self.faults is not None and self.faults.silent))
        mma, partial, transfers = self._kept(("decode", m), build)
        mma(a, a_scale, w, b_scale, partial)
        self._lsa_call(plan, lambda stamp: transfers(partial, partial, out, stamp))

    def keeps_fused(self, m: int) -> bool:
        """Fused calls of ``m`` rows on the lsa kernel, with no fault plan in force (its silent
        transport changes the launch) and no graph being captured (the copies a launch binds are kept
        only outside a capture; a kept launch is captured like any other)."""
        return (self.faults is None and self.config.mode == "fused" and self.uses_lsa(m)
                and not torch.cuda.is_current_stream_capturing())

    def fused_launcher(self, a, b_pre, a_scale, b_scale, *, out):
        """The lsa call with the weight, the window and the tile table bound
        (``kernels_fused.hopper.gemm.LsaLaunch``): an eager decode-sized call at world >= 2 pays the
        kernel's launch, not its ~45 arguments rebuilt (docs/decode.md, "The kept world-2 call").
        None where :meth:`keeps_fused` is false (calls of these rows take the copy engines, a fault
        plan, a capture)."""
        m = a.shape[0]
        if not self.keeps_fused(m):
            return None
        from kernels_fused.hopper.gemm import lsa_launch

        w = self._unshuffled(b_pre)
        kept = lsa_launch(a, w, a_scale, b_scale, quant=self.config.quant, out=out,
                          win=self.lsa_window, tile_table=self._lsa_table(m), rank=self.rank, config=self.lsa_config,
                          b_dense=self._dense_b(b_pre, b_scale))
        w, w_scale = w.detach(), b_scale.detach()  # aliases of the bytes, as the kept launch binds them

        def run(a, a_scale, out, plan):
            if self.splits_decode(a, a_scale, plan.m):
                self._decode_lsa(a, w, a_scale, w_scale, out, plan)
                return
            self._lsa_call(plan, lambda stamp: kept(a, a_scale, out, stamp))
        return run

    def _produce(self, a, b_pre, a_scale, b_scale, plan, *, reduce_into=None) -> torch.Tensor:
        """The producer of a fused or split dma call (``self.producer``, else ``DMA_PRODUCER``'s for
        the call's M; module note) into the partial region; returns the [W, rows, n_slice] planes it
        wrote (the region itself: the kernel's). ``reduce_into``: the caller's ``out``, the own tiles
        reduced into it in the kernel producer's epilogue (which the rule then always takes)."""
        by_rows = self.config.pattern_spec.owner_by == "rows"
        if by_rows:
            producer = self.producer or rows_producer(self.config, plan.m, self.producer_rows)
        else:
            producer = self.producer or ("kernel" if reduce_into is not None else
                                         dma_producer(self.config.quant, plan.m))
        if producer not in PRODUCERS:
            raise ValueError(f"CudaBackend: producer={producer!r}; pick one of {', '.join(PRODUCERS)}")
        if producer == "kernel" or (not by_rows and not vendor.takes_rows(self.config.quant, plan.rows, self.config.k)):
            # (cuBLAS's blockwise recipe refuses some row counts, and some K: vendor.takes_rows; the
            # reduce-scatter along rows never reduces into the caller's out: reduce_into is None there)
            self._fused_gemm(a, b_pre, a_scale, b_scale, plan, reduce_into=reduce_into)
            return self.partial
        if by_rows:
            return self._produce_rows(a, b_pre, a_scale, b_scale, plan)
        if reduce_into is not None:
            raise ValueError("CudaBackend: dma_reduce_in_gemm reduces in the fused kernel's epilogue; it needs "
                             f"producer='kernel', not {producer!r}")
        self.counters.zero_()  # see the module note: consumed words, zero at the call's start
        self.schedule.begin(plan)
        self.schedule.produce_by_chunks(plan, vendor.row_chunks(
            a, a_scale, self._vendor(b_pre, b_scale), out=self.partial_rows, rows=plan.rows,
            fast_accum=not self.fused_config.precise_acc))
        return self.partial_by_rows

    def _produce_rows(self, a, b_pre, a_scale, b_scale, plan) -> torch.Tensor:
        """The vendor producer of the reduce-scatter along rows: slice d is rows ``d * M/W ..`` of
        the product, every column, so a group of its consecutive chunks (``RS_PRODUCER_ROWS``) is
        one GEMM of those rows of A into ``partial[d][rows]`` (the dest-major planes, which the
        puts and the reduce read as they are), then the group's counters released; every peer's
        slices before the own one, so the puts start on the first. (The kernel producer walks the
        same slices' tiles in one launch: ``fp8_gemm(slice_rows=)`` or ``fp8_gemm_rows_ws``.)"""
        self.counters.zero_()  # see the module note: consumed words, zero at the call's start
        self.schedule.begin(plan)
        gemm = self._rows_gemm(b_pre, b_scale)
        sm = plan.slice_m
        least = RS_PRODUCER_ROWS[self.config.quant] if self.producer_rows is None else self.producer_rows

        def unit(d, c0, c1):
            r0, r1 = plan.rows[c0][0], plan.rows[c1 - 1][1]
            lo, hi = d * sm + r0, d * sm + r1
            return lambda: gemm(a[lo:hi], a_scale[lo:hi], self.partial[d][r0:r1])

        self.schedule.produce(plan, [(unit(d, c0, c1), [(d, c) for c in range(c0, c1)])
                                     for d in layout.dest_order(self.rank, self.world)
                                     for c0, c1 in consumer_groups(plan.rows, least)])
        return self.partial

    def _rows_gemm(self, b_pre, b_scale):
        """``gemm(a, a_scale, out)``: ``out = a @ B.T`` for a block of rows (a view of A or of the
        window's gathered rows) on the current stream: the vendor GEMM with the kept weight where it
        takes the row count (blockscale's A scale repacked when its column stride is not the row
        count, as cuBLAS's blockwise recipe wants), else the own kernel."""
        quant, weight = self.config.quant, self._vendor(b_pre, b_scale)
        b, fast = self._unshuffled(b_pre), not self.fused_config.precise_acc

        def gemm(a, a_scale, out):
            rows = a.shape[0]
            if rows == 0:
                return
            if not vendor.takes_rows(quant, rows, self.config.k):
                hopper_gemm.fp8_gemm(a, b, a_scale, b_scale, quant=quant, out=out, validated=True, b_dense=weight.dense)
                return
            a_scale = dense_block_scales(quant, a_scale, rows)
            if quant == "ptpc" and a_scale.data_ptr() % vendor.SCALE_ALIGNMENT:
                a_scale = a_scale.clone()  # a slice's scales from a row not a multiple of 4: cuBLAS refuses them
            vendor.vendor_gemm(a, a_scale, weight, out=out, fast_accum=fast)

        return gemm

    def _fused_gemm(self, a, b_pre, a_scale, b_scale, plan, *, reduce_into=None) -> None:
        """The kernel producer: the tile-table GEMM into the window's dest-major planes (the
        reduce-scatter along rows: the walk computed, where ``RS_ROWS_KERNEL_LAUNCH`` takes "ws");
        ``reduce_into``: the caller's ``out``, the own tiles reduced into it in the epilogue."""
        self.counters.zero_()  # see the module note: consumed words, zero at the call's start
        self.schedule.begin(plan)
        reduce = None
        if reduce_into is not None:
            sch = self.schedule
            reduce = hopper_gemm.ReduceEpilogue(
                rank=self.rank, recv=sch.recv, gather=sch.gather, gather_scale=sch.gather_scale, out=reduce_into,
                scatter_flags=sch.scatter_flags, scatter_m=sch.scatter_m, stamp=sch.stamp, status=sch.status,
                ticket=sch.ticket)
        by_rows = self.config.pattern_spec.owner_by == "rows"  # slices of A's rows, every column
        walk = self.rows_kernel_launch or (None if self._walk_refused else RS_ROWS_KERNEL_LAUNCH[self.config.quant])
        if by_rows and self.dma_peers_first and walk in WALKS:
            try:
                hopper_gemm.fp8_gemm_rows_ws(a, self._unshuffled(b_pre), a_scale, b_scale, quant=self.config.quant,
                                             out=self.partial, counters=self.counters,
                                             chunk_map=self._chunk_map(plan), rank=self.rank,
                                             slice_rows=plan.slice_m, tile_weight=self.tile_weight,
                                             config=hopper_gemm.rows_ws_config(self.fused_config, self.config.quant),
                                             b_dense=self._dense_b(b_pre, b_scale), release_lag=walk == "ws-lag")
                return
            except hopper_gemm.UnorderedReleases:  # raised before the launch, alike on every rank
                if self.rows_kernel_launch in WALKS:  # forced: the caller asked for the walk itself
                    raise
                self._walk_refused = True  # the rule's pick: the grid launch below does the same work
        hopper_gemm.fp8_gemm(a, self._unshuffled(b_pre), a_scale, b_scale, quant=self.config.quant, out=self.partial,
                             fuse=True, tile_table=self._table(plan), counters=self.counters,
                             tile_weight=self.tile_weight, config=self.fused_config, reduce=reduce,
                             slice_rows=plan.slice_m if by_rows else None, validated=True,
                             b_dense=self._dense_b(b_pre, b_scale))

    # ---- modes --------------------------------------------------------------------------------------
    def gemm(self, a, b_pre, a_scale, b_scale, *, out, plan):
        cfg = self._plain_config(plan.m)
        if cfg.launch == "cublas":
            vendor.vendor_gemm(a, a_scale, self._vendor(b_pre, b_scale), out=out, fast_accum=not cfg.precise_acc)
            return
        hopper_gemm.fp8_gemm(a, self._unshuffled(b_pre), a_scale, b_scale, quant=self.config.quant, out=out,
                             config=cfg, validated=True, b_dense=self._dense_b(b_pre, b_scale))

    def vendor_weight(self, b_pre, b_scale):
        return self._vendor(b_pre, b_scale)

    def plain_launcher(self, b_pre, b_scale, m):
        """The eager plain call's path where ``PLAIN_RULE`` takes the vendor GEMM: cuBLAS with the
        prepared weight bound, allocating its output (in C++: a Python ``torch.empty`` cost an eager
        call ~4 us of host time on an H200 host)."""
        cfg = self._plain_config(m)
        if cfg.launch != "cublas":
            return None
        return vendor.bound_gemm(self._vendor(b_pre, b_scale), fast_accum=not cfg.precise_acc)

    def fused(self, a, b_pre, a_scale, b_scale, *, out, plan):
        if self.uses_lsa(plan.m):
            if self.splits_decode(a, a_scale, plan.m):
                self._decode_lsa(a, self._unshuffled(b_pre), a_scale, b_scale, out, plan)
            else:
                self._lsa(a, b_pre, a_scale, b_scale, out, plan, from_partial=False)
            return
        in_gemm = self.dma_reduce_in_gemm and self.config.pattern_spec.gather  # its epilogue writes gather
        partial = self._produce(a, b_pre, a_scale, b_scale, plan, reduce_into=out if in_gemm else None)
        # a kernel that computes every peer's tiles first scatters all chunks back to back; a producer
        # of whole chunks completes every dest of a chunk at once (cco.cuda.dma.submission_order)
        first = self.dma_peers_first and partial is self.partial
        self.schedule.run(plan, out, after_gemm=False, scatters_first=first, reduced_in_gemm=in_gemm,
                          partial=partial)

    def split(self, a, b_pre, a_scale, b_scale, *, out, plan):
        partial = self._produce(a, b_pre, a_scale, b_scale, plan)
        self.schedule.run(plan, out, after_gemm=True, partial=partial)

    # ---- all-gather ---------------------------------------------------------------------------------
    def _slots(self, src: int):
        """(rows, scales) slots of source ``src``'s input in this rank's window."""
        return self.schedule.a_rows[src], self.schedule.a_scales[src]

    def _sources_block(self, s0: int, s1: int):
        """(rows, scales) of sources ``s0 .. s1-1``'s slots as one block of rows, as a GEMM reads it.
        Only for a call of ``m_max_padded`` rows per rank: the slots are consecutive in the window,
        so without pad rows their rows are one ``[(s1 - s0) * m, K]`` view, and so are ptpc's and
        mxfp8's scales (``[rows]``, ``[rows, K/32]`` per slot). Blockscale's scale slots are
        ``[K/128, rows]`` each (``layout.input_scale_shape``): their block is copied to one
        ``[K/128, (s1 - s0) * m]`` and read transposed, column stride its row count, as cuBLAS's
        blockwise recipe and the gfx950 kernel want (``dense_block_scales`` then copies nothing)."""
        rows, scales = self.schedule.a_rows[s0:s1], self.schedule.a_scales[s0:s1]
        rows = rows.reshape(-1, self.config.k)
        if self.config.quant == "blockscale":
            return rows, scales.permute(1, 0, 2).reshape(scales.shape[1], -1).t()
        return rows, scales.reshape(-1, *scales.shape[2:])

    def consumer_merges(self, plan, groups) -> bool:
        """Whether the all-gather's fused consumer issues one GEMM over every peer's slots after the
        last wait instead of one per group of each source's chunks (``groups``: ``consumer_groups``
        of ``plan.rows``): ``consumer_merge``, or where None the rule (``AG_CONSUMER_ROWS``'s note):
        every source's chunks form one group and the slots hold no pad rows."""
        whole = plan.m == self.config.m_max_padded  # else pad rows between the slots: no one block
        if self.consumer_merge is None:
            return whole and len(groups) == 1
        if self.consumer_merge and not whole:
            raise ValueError(f"CudaBackend: consumer_merge=True needs a call of m_max_padded="
                             f"{self.config.m_max_padded} rows per rank (the slots then hold no pad rows); "
                             f"this one has {plan.m}")
        return bool(self.consumer_merge)

    def all_gather_gemm(self, a, b_pre, a_scale, b_scale, *, out, plan, gathered=None):
        """The all-gather + GEMM (``cco.cuda.dma.CopyEngineSchedule.gather_inputs``): the own rows
        into the window's own slot (the puts read them there, so the side work's addresses are the
        same every call), the own rows' GEMM while the puts fly (on a stream of its own, so that it also
        runs beside the peers' GEMMs), then each peer's chunks as they land, a
        GEMM per group of them (``consumer_groups``: at least ``AG_CONSUMER_ROWS`` rows each) once the
        group's last chunk is in; or, where each peer's rows are one group and the slots hold no pad
        rows (``consumer_merges``), one GEMM over the peers' slots before the own one and one over
        those after it, once every chunk is in (one wait for all of them: ``gather_inputs``)."""
        m, rank, sch = plan.m, self.rank, self.schedule
        least = AG_CONSUMER_ROWS[self.config.quant] if self.consumer_rows is None else self.consumer_rows
        groups = consumer_groups(plan.rows, least)
        fused = self.config.mode == "fused"
        merged = fused and self.consumer_merges(plan, groups)  # (a refusal before the call's first step)
        sch.begin(plan)
        rows, scales = self._slots(rank)
        rows[:m].copy_(a)
        own_scales = self._scale_rows(scales, 0, m)
        own_scales.copy_(a_scale.reshape(own_scales.shape))
        gemm = self._rows_gemm(b_pre, b_scale)

        def sources(s0, s1):  # one GEMM of sources s0 .. s1-1 (m == m_max_padded: one block of rows)
            if s0 < s1:
                gemm(*self._sources_block(s0, s1), out[s0 * m:s1 * m])

        def every_peer():  # merged: the GEMMs of every peer's rows, after one wait for all of them
            sources(0, rank)
            sources(rank + 1, self.world)

        if not merged:
            first_of = {c1 - 1: c0 for c0, c1 in groups}

            def chunk(src, c):  # after the wait for (src, c): the GEMM of src's group that c ends, if it ends one
                if c not in first_of:
                    return
                r0, r1 = plan.rows[first_of[c]][0], plan.rows[c][1]
                src_rows, src_scales = self._slots(src)
                gemm(src_rows[r0:r1], self._scale_rows(src_scales, r0, r1), out[src * m + r0:src * m + r1])

        def every_row():  # split: one GEMM of the whole region where the slots hold no pad rows
            if m == self.config.m_max_padded:
                sources(0, self.world)
                return
            for src in range(self.world):
                src_rows, src_scales = self._slots(src)
                gemm(src_rows[:m], self._scale_rows(src_scales, 0, m), out[src * m:(src + 1) * m])

        def assemble():
            a_all, scale_all = gathered
            for src in range(self.world):
                src_rows, src_scales = self._slots(src)
                a_all[src * m:(src + 1) * m] = src_rows[:m]
                into = scale_all[src * m:(src + 1) * m]  # (ptpc: [m] or [m, 1], as the caller's a_scale)
                into.copy_(self._scale_rows(src_scales, 0, m).reshape(into.shape))

        sch.gather_inputs(plan, out=out,
                          consume_own=(lambda: gemm(a, a_scale, out[rank * m:(rank + 1) * m])) if fused else None,
                          consume=chunk if fused and not merged else None,
                          consume_all=every_peer if merged else (None if fused else every_row),
                          assemble=assemble if gathered is not None else None)

    def gather_inputs_window(self, *, plan):
        """The self test's run: the puts of whatever the own slot holds, the waits, no GEMM."""
        self.schedule.begin(plan)
        self.schedule.gather_inputs(plan, out=None)

    def all_reduce_window(self, *, out, plan):
        if self.uses_lsa(plan.m):
            self._lsa(None, None, None, None, out, plan, from_partial=True)
            return
        self.counters.zero_()
        self.schedule.begin(plan)
        self.schedule.set_counters(plan)
        self.schedule.run(plan, out, after_gemm=True)

    def reject(self, *, seq, error, plan_for):
        """Protocol step 7 on the device: the peers' calls wait on this rank's flags of call ``seq``
        (scatter and gather, per chunk or per tile) and consume them, and a flag set but never
        consumed would satisfy a later call's wait. So this rank runs the call all the same, with
        a peer's M (read from the peer's stamp as it arrives), on operands whose product is NaN
        (:meth:`_null_operands`) and under the rejected stamp: every wait on either side is released
        once and consumed once, and the peers' reduces find the stamp (status: this rank and the
        stamp) and compute NaN; their hosts name this rank and its reason (``PeerRejectedError``)."""
        wd = self.watchdog
        if wd is None:
            return
        if torch.cuda.is_current_stream_capturing():  # host reads cannot run inside a capture
            error.add_note(f"rank {self.rank}: rejected while a CUDA graph was being captured: the peers' call seq "
                           f"{seq} is not released; they fail it when their deadline passes")
            return
        post_rejection(self.notes, seq=seq, rank=self.rank, error=error)
        m = self._peer_m(seq)
        if m == REJECTED_M:
            error.add_note(f"rank {self.rank}: every peer rejected call seq {seq} too: no rank ran it")
            return
        if m is None:
            error.add_note(f"rank {self.rank}: no peer's stamp of call seq {seq} arrived within deadline_s="
                           f"{self.deadline_s:g} s (a peer is not there, or every peer rejected too): a peer still "
                           f"to come fails the call when its deadline passes")
            return
        if self.config.pattern_spec.gathers_input:
            run = self.all_gather_gemm
        else:
            run = self.fused if self.config.mode == "fused" else self.split
        out = torch.empty(*layout.out_shape(self.config, m), dtype=torch.bfloat16, device=self.device)
        self.schedule.rejected_seq = seq
        try:
            run(*self._null_operands(m), out=out, plan=plan_for(m))
        finally:
            self.schedule.rejected_seq = None
        wd.clear_status()  # this rank's own reduce found the peers' stamps unlike its rejected one

    def _null_operands(self, m: int):
        """Operands of the op's shape, quant and ``m`` rows whose product is NaN everywhere: A all
        e4m3 NaN, B zero, unit scales in the quant's layouts. A call on them runs the kernels a real
        call of the peers runs (no kernel variant compiles while their deadline runs) and sends NaN."""
        from cco.quant import E8M0, FP8, MX_GROUP

        cfg, dev = self.config, self.device
        a = torch.full((m, cfg.k), 0x7F, dtype=torch.uint8, device=dev).view(FP8)  # 0x7F: e4m3fn NaN
        b = torch.zeros(cfg.n, cfg.k, dtype=torch.uint8, device=dev).view(FP8)
        if cfg.quant == "ptpc":
            return a, b, torch.ones(m, device=dev), torch.ones(cfg.n, device=dev)
        if cfg.quant == "blockscale":
            return (a, b, torch.ones(cfg.k // SCALE_BLOCK, m, device=dev).t(),
                    torch.ones(cfg.n // SCALE_BLOCK, cfg.k // SCALE_BLOCK, device=dev))
        one = 127  # e8m0 of 2**0

        def unit(rows):
            return torch.full((rows, cfg.k // MX_GROUP), one, dtype=torch.uint8, device=dev).view(E8M0)

        return a, b, unit(m), unit(cfg.n)

    def _peer_m(self, seq: int) -> int | None:
        """M of call ``seq`` on a peer that did not reject it, from the (seq, M) stamp the peer sends
        with its first chunk (``scatter_m``) or on every tile (lsa ``tile_flags``), read as it
        arrives; ``REJECTED_M`` if every peer rejected the call too (its stamp says so, or it posted
        the rejection, ``PeerNotes.posted``: a peer that rejects waits here as well and sends no
        stamp, so where every rank rejects a call, as one rank's bad input or an out-of-memory that
        strikes every rank alike, none would arrive and each rank waited out ``deadline_s``); None if
        no stamp arrives within ``deadline_s``."""
        w = self.config.window
        stamps = self.window.words(w.scatter_m, rank=self.rank)
        tiles = self.window.tensor(w.tile_flags, rank=self.rank)[0].reshape(self.world, -1)
        waiting, stamped = {p for p in range(self.world) if p != self.rank}, stamp_seq(seq)
        until, notes_at = time.monotonic() + self.deadline_s, 0.0
        while waiting and time.monotonic() < until:
            seen, tile_words = stamps.tolist(), tiles.cpu()
            for p in sorted(waiting):
                for word in [seen[p], *tile_words[p].unique().tolist()]:
                    p_seq, p_m = unstamp_seq_m(word)
                    if p_seq == stamped and p_m != REJECTED_M:
                        return p_m
                    if p_seq == stamped:
                        waiting.discard(p)
            if self.notes is not None and time.monotonic() >= notes_at:  # a store round trip: every 10 ms
                waiting = {p for p in waiting if not self.notes.posted(seq=seq, rank=p)}
                notes_at = time.monotonic() + 0.01
            time.sleep(0.001)
        return None if waiting else REJECTED_M

    def raise_failed(self) -> None:
        wd = self.watchdog
        if wd is None:
            return
        err = wd.failed_error()
        if err is not None:
            raise err
        self._deferred = wd.take_deferred()  # this call clears the status word; raised once it took part

    def raise_deferred(self) -> None:
        err, self._deferred = self._deferred, None
        if err is not None:
            raise err

    @property
    def retains_window(self) -> bool:
        """A failed op's window stays mapped after close(): a peer late for the failed call may still
        write into it."""
        return self.watchdog is not None and self.watchdog.error is not None

    def check(self) -> None:
        """Synchronize (a stuck call is released by the watchdog within its deadline) and raise what
        the calls recorded: the op's failure, a peer's failure, a peer's mismatched or rejected
        (seq, M) stamp (:class:`PeerMismatchError`, ``PeerRejectedError``)."""
        if self.watchdog is not None:
            self.watchdog.sync()
            self.watchdog.check()
            return
        status = self.schedule.check()
        if status:
            raise PeerMismatchError(
                f"rank {self.rank}: rank {status - 1} stamped another (seq, M) or layer than this rank for the same "
                f"call; every rank must call the same layers with the same M, in the same order")

    def close(self):
        if self.schedule is not None:
            if self.watchdog is not None:
                self.watchdog.sync()  # bounded: the watchdog releases a stuck call
                self.watchdog.close()
            else:
                torch.cuda.synchronize(self.device)
            self.schedule.close()
            self.schedule = None
