"""Window layout, chunking and the tile walk of GemmAllReduceOp: pure arithmetic, no torch.

Every kernel (the CPU tile kernel, the Triton kernel, the FlyDSL kernel) and every transport reads
its offsets, chunk rows, counter indices, counter targets and tile order from here; nothing else
restates them.

The all-reduce of an ``[M, N]`` partial over ``W`` ranks, as laid out here::

    N is split into W column slices of n_slice = N / W; rank d owns slice d.
    M (padded to block_m) is split into C row chunks of whole m-tiles.

    partial[dest][m, j]  = this rank's GEMM output for column dest*n_slice + j   (dest-major, so one
                           (dest, chunk) slice is a contiguous block of rows: one DMA put)
    recv[src][m, j]      = rank src's partial of my slice, put there by src's transport
    gather[owner][m, j]  = the reduced slice of owner (bf16, or e4m3 + gather_scale[owner][m, j // 128])

Window regions (one symmetric window per rank, same offsets on every rank)::

    header        int64 [HEADER_WORDS]             [HEADER_SEQ, HEADER_M]: seq and M of the last call this
                                                   rank started; [HEADER_LEFT]: seq of the last call it
                                                   left (it reads nothing more of that call); CPU
                                                   backend only (GPU peers check a (seq, M) stamp)
    counters      int64 [W, MAX_CHUNKS]            tiles written per (dest, chunk), cumulative
    scatter_flags int64 [W(src), MAX_CHUNKS]       = seq once src's chunk has landed in recv[src]
    scatter_m     int64 [W(src)]                   M of src's call seq (checked before reducing)
    gather_flags  int64 [W(owner), MAX_CHUNKS]     = seq once owner's reduced chunk landed in gather
    tile_flags    int64 [2, W, m_tiles, n_tiles]   per-tile arrival flags of the CUDA ``lsa`` transport,
                                                   whose producers store tile by tile: [0][src] scatter,
                                                   [1][owner] gather
    partial       bf16  [W, m_max_padded, n_slice]   (a producer of whole rows reads the same bytes as
                                                   [m_max_padded, N]: partial_strides)
    recv          bf16  [W, m_max_padded, n_slice]
    gather        bf16 | e4m3 [W, m_max_padded, n_slice]
    gather_scale  fp32  [W, m_max_padded, ceil(n_slice / GATHER_GROUP)]   (fp8 gather only)

An op that publishes nothing (``mode="gemm-only"``, or one rank: :func:`publishes`) keeps the words
and no data plane (zero rows): its plain GEMM writes the output.

Patterns (:data:`PATTERNS`): the same regions, counters and flags serve the three collectives of a
tensor-parallel block; a pattern says who owns an output slice and which phases run::

    all-reduce           slices by columns (N/W each); scatter, reduce, gather  -> out [M, N]
    reduce-scatter dim 1 slices by columns; scatter, reduce (no gather)       -> out [M, N/W]
    reduce-scatter dim 0 slices by rows (M/W each, Megatron's token split);
                         scatter, reduce                                        -> out [M/W, N]
    all-gather           each rank's input rows (M/W) go to every rank first; the GEMM consumes
                         them as they land                                      -> out [M, N]

A "slice" is one owner's block: ``slice rows x n_slice`` at ``slice_origin`` of the ``[M, N]``
product; ``partial[dest]`` and ``recv[src]`` hold one slice each (``m_max_padded`` rows: the most rows
a slice has, padded). The all-gather moves inputs instead: ``a_rows[src]`` (e4m3 ``[rows, K]``) and
``a_scales[src]`` (the rows' scales, :func:`input_scale_shape`), released by ``scatter_flags[src, c]``
with the (seq, M) stamp in ``scatter_m[src]``, exactly where a scatter puts its own, so rejected calls
and mismatched M read the same words in every pattern.

Completion protocol: a tile bumps ``counters[dest, chunk]`` by one; chunk (dest, c) of call ``seq``
is complete when the counter reaches the cumulative target ``CallPlan.counter_targets``. Flags carry
the call's ``seq`` and a waiter waits for ``flag >= seq``, so a flag left by an earlier (even failed)
call never satisfies a later one. The CPU backend never resets a word (the targets grow by a known
amount per call); the CUDA backend consumes them instead (counters zeroed at call start, each flag
zeroed by its single waiter, see ``cco.backends.cuda``), which keeps a captured graph's baked wait
targets valid. Neither needs a reset step between calls or graph replays.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field

MAX_CHUNKS = 8  # mori's knee: more chunks pay the fixed per-put cost (~2 us per SDMA put) more often
DEFAULT_CHUNKS = 4  # untuned; enough to overlap all but the last quarter of the scatter
TAPERED_CHUNKS = (1, 2, 2, 2, 2, 2, 2, 1)  # relative sizes: an early first put, a short tail (bench arms)
DEFAULT_BLOCK_M = 64  # CPU tile; GPU backends pass their own tile via build_config(block_m=...)
BLOCK_N_CHOICES = (128, 64, 32, 16)  # default block_n: the largest that divides n_slice
HEADER_WORDS = 8
HEADER_SEQ, HEADER_M, HEADER_LEFT = 0, 1, 2  # word indices in the header region
TILE_TABLE_CACHE = 64  # (config, M, rank) tile tables kept; eager calls with a few M values hit it
REGION_ALIGN = 256  # bytes; every region starts on a 256-byte boundary (DMA and vector friendly)
K_MIN = 256  # K=128 compiled but returned garbage: the peeled pipeline needs two K tiles
K_ALIGN = 128  # BLOCK_K of every kernel
BLOCKSCALE_N = 128  # blockscale B scales cover 128 rows of B
GATHER_GROUP = 128  # fp8 gather: one fp32 scale per row and 128 columns (a GEMM epilogue sees one tile)

QUANTS = ("ptpc", "blockscale", "mxfp8")
# how the weight operand is laid out in memory: the gfx950 kernel's 16x16 "bpreshuffle" order
# (cco.preshuffle; what GemmAllReduceOp takes by default), or plain row-major [N, K] (what the Triton
# kernels read: a backend that lists it in Backend.weight_layouts takes it as is, so a layer that lays
# its weight out once never pays an unshuffle per call)
WEIGHT_LAYOUTS = ("bpreshuffle", "row-major")
MODES = ("fused", "split", "gemm-only")
TRANSPORTS = ("dma", "lsa", "auto")  # auto: the backend picks per call (CUDA: lsa at small M); else dma
GATHER_DTYPES = ("bf16", "fp8")
# mori's benchmark arm names -> (mode, transport)
MODE_ALIASES = {
    "gemm-only": ("gemm-only", None),
    "split-sdma": ("split", "dma"),
    "fused-sdma": ("fused", "dma"),
    "split-lsa": ("split", "lsa"),
    "fused-lsa": ("fused", "lsa"),
}

ITEMSIZE = {"int64": 8, "bfloat16": 2, "float8_e4m3fn": 1, "float32": 4, "float8_e8m0fnu": 1}
SCALE_BLOCK_K = 128  # blockscale A scales: one per row and 128 columns of K (cco.quant)
MX_GROUP_K = 32  # mxfp8 A scales: one e8m0 per row and 32 columns of K (cco.quant)


@dataclass(frozen=True)
class Pattern:
    """Which collective a call runs around its GEMM: data the op, the layout and the backends read
    instead of a copy of the op per pattern."""

    name: str  # the key in PATTERNS
    owner_by: str  # "cols": owner d's slice is columns d*N/W..; "rows": rows d*M/W.. (Megatron's token split)
    scatter: bool  # the GEMM's tiles go to their slice's owner (counters, scatter puts)
    reduce: bool  # the owner sums its own and the received slices in fp32
    gather: bool  # the reduced slices go to every rank (the all-reduce's last phase)
    gathers_input: bool  # each rank's input rows go to every rank; the GEMM consumes them as they land
    unfused: str  # the unfused equivalent, for docstrings and errors


PATTERNS = {
    "all-reduce": Pattern("all-reduce", "cols", True, True, True, False,
                          "all_reduce(a @ b.T) -> [M, N]"),
    "reduce-scatter-cols": Pattern("reduce-scatter-cols", "cols", True, True, False, False,
                                   "reduce_scatter(a @ b.T, dim=1) -> [M, N/W]"),
    "reduce-scatter-rows": Pattern("reduce-scatter-rows", "rows", True, True, False, False,
                                   "reduce_scatter(a @ b.T, dim=0) -> [M/W, N]"),
    "all-gather": Pattern("all-gather", "rows", False, False, False, True,
                          "all_gather(a, dim=0) @ b.T -> [M, N]"),
}


def reduce_scatter_pattern(scatter_dim) -> str:
    """The pattern of a reduce-scatter along ``scatter_dim`` (0: rows/tokens, 1: columns)."""
    if scatter_dim not in (0, 1) or isinstance(scatter_dim, bool):
        raise ValueError(f"scatter_dim={scatter_dim!r} is not supported; pass 0 (tokens: rank r keeps rows "
                         f"r*M/W..(r+1)*M/W) or 1 (rank r keeps its N/W columns)")
    return "reduce-scatter-rows" if scatter_dim == 0 else "reduce-scatter-cols"


def input_scale_shape(quant: str, rows: int, k: int) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of one rank's slot of all-gathered A scales with ``rows`` rows: ptpc ``[rows]``
    fp32; blockscale ``[K/128, rows]`` fp32 (the column-major ``[rows, K/128]`` A scale, transposed,
    so a chunk of rows is a block of every scale column); mxfp8 ``[rows, K/32]`` e8m0."""
    if quant == "ptpc":
        return (rows,), "float32"
    if quant == "blockscale":
        return (k // SCALE_BLOCK_K, rows), "float32"
    return (rows, k // MX_GROUP_K), "float8_e8m0fnu"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align(x: int, a: int = REGION_ALIGN) -> int:
    return _ceil_div(x, a) * a


def normalize_mode(mode: str, transport: str | None, default_transport: str = "dma") -> tuple[str, str]:
    """Accept both ``mode="fused", transport="lsa"`` and mori's ``mode="fused-lsa"``.

    Raises ValueError naming the argument when the mode is unknown or an alias disagrees with an
    explicit transport."""
    if mode in MODE_ALIASES:
        base, implied = MODE_ALIASES[mode]
        if implied is not None and transport is not None and transport != implied:
            raise ValueError(
                f"mode={mode!r} implies transport={implied!r} but transport={transport!r} was passed; "
                f"pass mode={base!r} with transport={transport!r}, or drop transport"
            )
        mode, transport = base, implied or transport
    if mode not in MODES:
        allowed = ", ".join(MODES + tuple(a for a in MODE_ALIASES if a not in MODES))
        raise ValueError(f"mode={mode!r} is not supported; pass one of {allowed}")
    transport = default_transport if transport is None else transport
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not supported; pass one of {', '.join(TRANSPORTS)}")
    return mode, transport


# --------------------------------------------------------------------------------------------------
# window regions
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Region:
    """One typed array at a byte offset of every rank's window."""

    name: str
    offset: int  # bytes from the window start
    shape: tuple[int, ...]
    dtype: str  # a key of ITEMSIZE; torch dtype of the same name

    @property
    def nbytes(self) -> int:
        count = 1
        for s in self.shape:
            count *= s
        return count * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class WindowLayout:
    header: Region
    counters: Region
    scatter_flags: Region
    scatter_m: Region
    gather_flags: Region
    tile_flags: Region
    partial: Region
    recv: Region
    gather: Region
    gather_scale: Region
    a_rows: Region  # all-gather only: e4m3 [W, m_max_padded, K] (empty otherwise)
    a_scales: Region  # all-gather only: [W, *input_scale_shape] (empty otherwise)
    nbytes: int

    def regions(self) -> tuple[Region, ...]:
        return (self.header, self.counters, self.scatter_flags, self.scatter_m, self.gather_flags,
                self.tile_flags, self.partial, self.recv, self.gather, self.gather_scale, self.a_rows,
                self.a_scales)


def gather_scale_cols(n_slice: int) -> int:
    """fp8 gather scales per row of one owner's slice (the last group may be narrower)."""
    return _ceil_div(n_slice, GATHER_GROUP)


def window_layout(*, world: int, m_max_padded: int, n_slice: int, gather_dtype: str,
                  m_tiles: int = 0, n_tiles: int = 0, pattern: str = "all-reduce", k: int = 0,
                  quant: str = "ptpc", publishes: bool = True) -> WindowLayout:
    """The regions of one rank's window; those a pattern does not use are empty (zero rows), and so
    are every data plane where nothing is published (``publishes`` false: :func:`publishes`)."""
    pat = PATTERNS[pattern]
    if not publishes:  # the words stay (a few KiB): the backends bind them whatever the mode
        m_max_padded = m_tiles = 0
    rows = m_max_padded if pat.scatter else 0  # partial / recv
    g_rows = m_max_padded if pat.gather else 0
    a_rows = m_max_padded if pat.gathers_input else 0
    scale_shape, scale_dtype = input_scale_shape(quant, a_rows, k if a_rows else 0)
    specs = [
        ("header", (HEADER_WORDS,), "int64"),
        ("counters", (world, MAX_CHUNKS), "int64"),
        ("scatter_flags", (world, MAX_CHUNKS), "int64"),
        ("scatter_m", (world,), "int64"),
        ("gather_flags", (world, MAX_CHUNKS), "int64"),
        ("tile_flags", (2, world, m_tiles, n_tiles), "int64"),
        ("partial", (world, rows, n_slice), "bfloat16"),
        ("recv", (world, rows, n_slice), "bfloat16"),
        ("gather", (world, g_rows, n_slice), "float8_e4m3fn" if gather_dtype == "fp8" else "bfloat16"),
        ("gather_scale", (world, g_rows, gather_scale_cols(n_slice)) if gather_dtype == "fp8" else (world, 0, 0),
         "float32"),
        ("a_rows", (world, a_rows, k if a_rows else 0), "float8_e4m3fn"),
        ("a_scales", (world, *scale_shape), scale_dtype),
    ]
    offset, regions = 0, {}
    for name, shape, dtype in specs:
        regions[name] = Region(name, offset, shape, dtype)
        offset = _align(offset + regions[name].nbytes)
    return WindowLayout(**regions, nbytes=offset)


# --------------------------------------------------------------------------------------------------
# the op's configuration: built in one place
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OpConfig:
    """Everything fixed at op construction. Build it with :func:`build_config` only."""

    n: int
    k: int
    m_max: int
    world: int
    quant: str
    mode: str  # "fused" | "split" | "gemm-only"
    transport: str  # "dma" | "lsa"
    gather_dtype: str  # "bf16" | "fp8"
    chunks: int | tuple[int, ...]  # row chunks of a call with enough m-tiles (fewer for small M), or
    # their relative sizes (chunk_tiles)
    block_m: int
    block_n: int
    weight_layout: str = "bpreshuffle"  # WEIGHT_LAYOUTS
    pattern: str = "all-reduce"  # a key of PATTERNS
    n_slice: int = field(init=False)  # columns of one owner's slice: N/W (by columns) or N (by rows)
    slice_m_max: int = field(init=False)  # rows of one slice at most: m_max (by columns) or m_max // W
    m_max_padded: int = field(init=False)  # slice_m_max in whole m-tiles: the rows of a window plane
    n_tiles_per_dest: int = field(init=False)
    window: WindowLayout = field(init=False)
    # a config keys the per-call caches (tile tables, call shapes) that every call looks up: hashing
    # its fields each time took ~1.4 us, so the hash of the fields the rest derives from is kept
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self):
        set_ = object.__setattr__.__get__(self)
        set_("_hash", hash((self.n, self.k, self.m_max, self.world, self.quant, self.mode, self.transport,
                            self.gather_dtype, self.chunks, self.block_m, self.block_n, self.pattern)))
        by_rows = PATTERNS[self.pattern].owner_by == "rows"
        set_("n_slice", self.n if by_rows else self.n // self.world)
        set_("slice_m_max", self.m_max // self.world if by_rows else self.m_max)
        set_("m_max_padded", padded_m(self.slice_m_max, self.block_m))
        set_("n_tiles_per_dest", self.n_slice // self.block_n)
        set_("window", window_layout(world=self.world, m_max_padded=self.m_max_padded,
                                     n_slice=self.n_slice, gather_dtype=self.gather_dtype,
                                     m_tiles=self.m_max_padded // self.block_m, n_tiles=self.n_tiles_per_dest,
                                     pattern=self.pattern, k=self.k, quant=self.quant,
                                     publishes=self.publishes))

    @property
    def pattern_spec(self) -> Pattern:
        return PATTERNS[self.pattern]

    @property
    def publishes(self) -> bool:
        """Whether this op's calls put anything into the window (module-level :func:`publishes`)."""
        return publishes(self.mode, self.world)


def publishes(mode: str, world: int) -> bool:
    """Whether an op's calls put anything into the window: not with ``mode="gemm-only"`` (the plain
    GEMM writes its output) nor with one rank (the collective is the identity: the plain GEMM too).
    Where not, the window's data planes have no rows (an 8B model's down projection at m_max 4096
    mapped 96 MiB of them, never written), so such an op has no self test either."""
    return mode != "gemm-only" and world > 1


def _pick_block_n(n_slice: int) -> int | None:
    return next((b for b in BLOCK_N_CHOICES if n_slice % b == 0), None)


MAX_M = (1 << 24) - 1  # the most rows of a call: the 24 bits of M in a call's (seq, tag, M) stamp (cco.transport.base)
CALL_TAGS = 1 << 8  # a call's caller tag, 0 .. CALL_TAGS - 1: the stamp's 8 bits above M (cco.nn's layers)


def valid_tag(tag) -> bool:
    """Whether ``tag`` is a caller tag a call's stamp holds: an int 0 .. ``CALL_TAGS - 1`` (a bool is not)."""
    return type(tag) is int and 0 <= tag < CALL_TAGS


def build_config(*, n: int, k: int, m_max: int, world: int, quant: str = "ptpc", mode: str = "fused",
                 transport: str | None = None, gather_dtype: str = "bf16", chunks: int | tuple[int, ...] | None = None,
                 block_m: int | None = None, block_n: int | None = None,
                 default_transport: str = "dma", weight_layout: str = "bpreshuffle",
                 pattern: str = "all-reduce") -> OpConfig:
    """The single place that decides whether a configuration is expressible.

    Raises ValueError whose message names the argument, its value, what is allowed and the fix."""
    mode, transport = normalize_mode(mode, transport, default_transport)
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r} is not supported; pass one of {', '.join(PATTERNS)}")
    by_rows = PATTERNS[pattern].owner_by == "rows"
    if pattern != "all-reduce" and mode == "gemm-only":
        raise ValueError(f"mode='gemm-only' is the all-reduce op's plain GEMM; the {pattern} op runs 'fused' or "
                         f"'split' (build a GemmAllReduceOp with mode='gemm-only' for the GEMM alone)")
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={weight_layout!r} is not supported; pass one of {', '.join(WEIGHT_LAYOUTS)}")
    for name, value in (("n", n), ("k", k), ("m_max", m_max), ("world", world)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if m_max > MAX_M:
        raise ValueError(f"m_max={m_max} is more rows than a call's stamp holds ({MAX_M}); run the rows in calls of "
                         f"at most {MAX_M}")
    if quant not in QUANTS:
        raise ValueError(f"quant={quant!r} is not supported; pass one of {', '.join(QUANTS)}")
    if gather_dtype not in GATHER_DTYPES:
        raise ValueError(f"gather_dtype={gather_dtype!r} is not supported; pass one of {', '.join(GATHER_DTYPES)}")
    if k < K_MIN or k % K_ALIGN:
        raise ValueError(f"k={k} is not supported; K must be >= {K_MIN} and a multiple of {K_ALIGN}: pad the "
                         f"reduction dimension with zeros to k={padded_k(k)} (zero weight columns and activation "
                         f"columns add nothing; cco.nn.RowParallelLinear pads both)")
    layer = "ColumnParallelLinear" if PATTERNS[pattern].gathers_input else "RowParallelLinear"  # (its layer)
    pad_n = (f"pad N with zero weight rows to n={padded_n(n, world, quant=quant, block_n=block_n)} "
             f"(cco.nn.{layer} does, and drops the extra output columns)")
    if quant == "blockscale" and n % BLOCKSCALE_N:
        raise ValueError(f"n={n} is not supported with quant='blockscale'; N must be a multiple of {BLOCKSCALE_N}: "
                         f"{pad_n}")
    if by_rows and m_max < world:
        raise ValueError(f"m_max={m_max} is smaller than world={world}; the {pattern} op splits the rows (tokens) "
                         f"over the ranks, so build it with m_max >= {world}")
    if not by_rows and n % world:
        raise ValueError(f"n={n} is not divisible by world={world}; every rank owns N/world output "
                         f"columns, so {pad_n}")
    n_slice = n if by_rows else n // world
    if block_n is None:
        block_n = _pick_block_n(n_slice)
        if block_n is None:
            raise ValueError(f"n={n} with world={world} gives a {n_slice}-column slice per rank, which no "
                             f"tile width in {BLOCK_N_CHOICES} divides; {pad_n}")
    elif block_n < 1 or n_slice % block_n:
        slice_is = f"N = {n}" if by_rows else f"the per-rank slice N/world = {n}/{world} = {n_slice}"
        raise ValueError(f"block_n={block_n} (the backend's tile width) must divide {slice_is}; {pad_n}")
    block_m = DEFAULT_BLOCK_M if block_m is None else block_m
    if block_m < 1:
        raise ValueError(f"block_m={block_m} must be a positive int")
    chunks = check_chunks(DEFAULT_CHUNKS if chunks is None else chunks)
    return OpConfig(n=n, k=k, m_max=m_max, world=world, quant=quant, mode=mode, transport=transport,
                    gather_dtype=gather_dtype, chunks=chunks, block_m=block_m, block_n=block_n,
                    weight_layout=weight_layout, pattern=pattern)


def padded_k(k: int) -> int:
    """The smallest K' >= k that :func:`build_config` accepts: whole 128-wide K tiles, at least two."""
    return max(K_MIN, _ceil_div(k, K_ALIGN) * K_ALIGN)


def padded_n(n: int, world: int, *, quant: str = "ptpc", block_n: int | None = None) -> int:
    """The smallest N' >= n that :func:`build_config` accepts for ``world`` ranks and a tile ``block_n``
    wide (None: the narrowest of ``BLOCK_N_CHOICES``, which the layout then picks or a wider one):
    every rank's slice N'/world a whole number of tiles, and for blockscale N' whole 128-row B
    scale blocks."""
    step = world * (BLOCK_N_CHOICES[-1] if block_n is None else block_n)
    if quant == "blockscale":
        step = math.lcm(step, BLOCKSCALE_N)
    return _ceil_div(n, step) * step


def supports(m: int, n: int, k: int, world: int, **options) -> str | None:
    """``None`` when ``[m, k] x [n, k]`` over ``world`` ranks is expressible with the tiles in
    ``options``, else the reason (with the fix).

    ``options`` are build_config's (quant, mode, transport, gather_dtype, chunks, block_m, block_n,
    weight_layout, m_max; m_max defaults to m). Without block_m / block_n this is the CPU backend's
    answer; ``cco.supports`` (``cco.shapes.supports``) asks the backend of a device for its tiles and
    its own limits, which is what a caller wants."""
    options.setdefault("m_max", m)
    try:
        cfg = build_config(n=n, k=k, world=world, **options)
    except (ValueError, TypeError) as err:
        return str(err)
    if not isinstance(m, int) or m < 1:
        return f"m={m!r} must be a positive int"
    if m > cfg.m_max:
        return f"m={m} exceeds m_max={cfg.m_max}; build the op with m_max >= {m}"
    return None


# --------------------------------------------------------------------------------------------------
# per-call arithmetic
# --------------------------------------------------------------------------------------------------
def padded_m(m: int, block_m: int) -> int:
    """Rows the kernel computes for M rows: M rounded up to whole m-tiles."""
    return _ceil_div(m, block_m) * block_m


def slice_rows(cfg: OpConfig, m: int) -> int:
    """Rows of one slice in a call with ``m`` rows: ``m`` where slices are cut by columns; ``m / W``
    for the reduce-scatter along rows (``m`` is the call's whole M); ``m`` for the all-gather (``m`` is
    the call's rows per rank)."""
    return m // cfg.world if cfg.pattern == "reduce-scatter-rows" else m


def most_call_rows(pattern: str, rows: int, world: int) -> int:
    """The most rows one call of ``pattern`` may pass where the op holds ``rows`` (its m_max): the
    all-gather's a rank's share (``rows // world``), the reduce-scatter along rows' a multiple of the
    world, every other pattern's ``rows`` (:func:`call_rows_error` says the same of one call)."""
    if pattern == "all-gather":
        return rows // world
    if pattern == "reduce-scatter-rows":
        return rows - rows % world
    return rows


def call_rows_allowed(cfg: OpConfig) -> str:
    """The rows a call may pass, in words (for an ``m`` that is not an int >= 1): what
    :func:`call_rows_error` accepts."""
    if cfg.pattern == "all-gather":
        return f"1..{cfg.slice_m_max} rows per rank (m_max={cfg.m_max} gathered rows over world={cfg.world})"
    if cfg.pattern == "reduce-scatter-rows":
        return f"a multiple of world={cfg.world} from {cfg.world} to m_max={cfg.m_max}"
    return f"1..m_max={cfg.m_max}"


def call_rows_error(cfg: OpConfig, m: int) -> str | None:
    """None when a call may pass ``m`` rows, else why not (with the fix): at most ``m_max`` rows (the
    all-gather: ``m_max / W`` per rank), and for the reduce-scatter along rows a multiple of W."""
    if cfg.pattern == "all-gather":
        if m > cfg.slice_m_max:
            return (f"a has M={m} rows but the op was built with m_max={cfg.m_max} gathered rows, at most "
                    f"{cfg.slice_m_max} per rank over world={cfg.world}; split the batch or build the op with "
                    f"m_max >= {m * cfg.world}")
        return None
    if m > cfg.m_max:
        return (f"a has M={m} rows but the op was built with m_max={cfg.m_max}; split the batch or build the op "
                f"with m_max >= {m}")
    if cfg.pattern == "reduce-scatter-rows" and m % cfg.world:
        return (f"a has M={m} rows, not a multiple of world={cfg.world}; every rank keeps M/world rows "
                f"(tokens): pad the batch with zero rows to M={-(-m // cfg.world) * cfg.world}")
    return None


def slice_origin(cfg: OpConfig, dest: int, rows: int) -> tuple[int, int]:
    """(row, column) of the ``[M, N]`` product where slice ``dest`` starts, for slices of ``rows``
    rows: column ``dest * N/W`` where slices are cut by columns, row ``dest * rows`` by rows."""
    if cfg.pattern_spec.owner_by == "rows":
        return dest * rows, 0
    return 0, dest * cfg.n_slice


def out_shape(cfg: OpConfig, m: int, rank: int = 0) -> tuple[int, int]:
    """The shape of a call's output for ``m`` rows (the call's ``a`` rows)."""
    name = cfg.pattern
    if name == "all-reduce":
        return m, cfg.n
    if name == "reduce-scatter-cols":
        return m, cfg.n_slice
    if name == "reduce-scatter-rows":
        return m // cfg.world, cfg.n
    return m * cfg.world, cfg.n


def input_order(rank: int, world: int) -> tuple[int, ...]:
    """All-gather: the sources whose rows a rank's GEMM consumes, in order: its own (already there),
    then ``(rank - j) % world`` for j = 1..world-1, the order the peers' puts reach it (each peer
    puts to ``dest_order``: its next rank first)."""
    return tuple((rank - j) % world for j in range(world))


def chunk_weights(cfg: OpConfig) -> tuple[int, ...]:
    """Relative sizes of a call's chunks: ``cfg.chunks`` equal ones, or the sizes it names."""
    return cfg.chunks if isinstance(cfg.chunks, tuple) else (1,) * cfg.chunks


def check_chunks(chunks):
    """``chunks`` as an op takes it (a list as its tuple), or ValueError: an int in 1..MAX_CHUNKS, a
    tuple of 1..MAX_CHUNKS relative sizes (positive ints), or None (the backend's default)."""
    if chunks is None:
        return None
    if isinstance(chunks, list):
        chunks = tuple(chunks)
    if isinstance(chunks, tuple):
        if not 1 <= len(chunks) <= MAX_CHUNKS or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1
                                                         for w in chunks):
            raise ValueError(f"chunks={chunks!r} is not supported; relative chunk sizes are 1..{MAX_CHUNKS} "
                             f"positive ints, e.g. (1, 2, 2, 1)")
    elif not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks={chunks!r} is not supported; pass an int in 1..{MAX_CHUNKS}, a tuple of relative "
                         f"chunk sizes or None")
    return chunks


def check_call_options(*, transport=None, gather_dtype: str = "bf16", chunks=None) -> None:
    """ValueError for an op option that no backend and no shape takes (a layer checks these at
    construction: a misspelt transport is the caller's error, not a reason to run unfused, which a
    backend's refusal of a shape is)."""
    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not supported; pass one of {', '.join(TRANSPORTS)} or None")
    if gather_dtype not in GATHER_DTYPES:
        raise ValueError(f"gather_dtype={gather_dtype!r} is not supported; pass one of {', '.join(GATHER_DTYPES)}")
    check_chunks(chunks)


def call_chunks(cfg: OpConfig, m: int) -> int:
    """Row chunks of a call: those of cfg.chunks, or one per m-tile when a slice has fewer tiles than that."""
    return min(len(chunk_weights(cfg)), padded_m(slice_rows(cfg, m), cfg.block_m) // cfg.block_m)


def chunk_tiles(cfg: OpConfig, m: int) -> tuple[tuple[int, int], ...]:
    """Per chunk, the m-tile range [t0, t1): chunk i ends at tile ``floor(tiles * w_0..i / w_all)`` of
    the weights (equal weights: as even as possible), each chunk at least one tile; one chunk per
    tile when M has fewer tiles than chunks. Smaller first and last chunks (``(1, 2, ..., 2, 1)``)
    start the first put sooner and shorten what follows the GEMM's last tile."""
    tiles = padded_m(slice_rows(cfg, m), cfg.block_m) // cfg.block_m
    c = call_chunks(cfg, m)
    weights = chunk_weights(cfg)
    if c < len(weights):  # fewer m-tiles than chunks: one chunk per tile
        weights = (1,) * c
    total, cum, ends = sum(weights), 0, []
    for i, w in enumerate(weights):
        cum += w
        lo = (ends[-1] if ends else 0) + 1
        ends.append(min(max(tiles * cum // total, lo), tiles - (c - 1 - i)))
    return tuple(zip((0, *ends[:-1]), ends))


def chunk_rows(cfg: OpConfig, m: int) -> tuple[tuple[int, int], ...]:
    """Per chunk, the real rows [r0, r1) of a slice it carries (pad rows beyond the slice's are never
    moved)."""
    rows = slice_rows(cfg, m)
    return tuple((t0 * cfg.block_m, min(t1 * cfg.block_m, rows)) for t0, t1 in chunk_tiles(cfg, m))


def dest_order(rank: int, world: int) -> tuple[int, ...]:
    """Destinations in walk order: ``dest = (j + rank) % world`` for j = 1..world, so ranks start on
    different peers and every rank's own slice (no transfer) comes last."""
    return tuple((j + rank) % world for j in range(1, world + 1))


def reduce_order(rank: int, world: int) -> tuple[int, ...]:
    """Sources summed onto the own partial, in order ``(rank + j) % world`` for j = 1..world-1."""
    return tuple((rank + j) % world for j in range(1, world))


@dataclass(frozen=True)
class Tile:
    chunk: int
    dest: int  # the slice's owner (all-gather: the rank whose input rows the tile reads)
    m_tile: int
    n_tile: int  # within dest's slice
    row0: int  # within dest's slice; the product's row is slice_origin's row + row0
    col0: int  # within dest's slice; the product's column is slice_origin's column + col0 (all-reduce:
    # dest * n_slice + col0)


def tile_table(cfg: OpConfig, *, m: int, rank: int, dest_major: bool = False) -> tuple[Tile, ...]:
    """Every output tile of a call in the order the kernel writes them: (chunk, dest, m, n), or
    with ``dest_major`` (dest, chunk, m, n): every peer's tiles before the own ones, the order of
    the CUDA kernels (the ``lsa`` kernel's own tiles wait for the peers' tiles of the same position;
    the copy-engine scatters of the fused launch then run back to back from its first slice on).

    Cached per ``(cfg, m, rank, dest_major)`` (the config is frozen and hashable): building the
    table in Python takes ~20 ms at M=16384, N=7168 on 2 ranks, which an eager GPU call must not
    pay every time."""
    return _tile_table(cfg, m, rank, dest_major)


@functools.lru_cache(maxsize=TILE_TABLE_CACHE)
def _tile_table(cfg: OpConfig, m: int, rank: int, dest_major: bool) -> tuple[Tile, ...]:
    chunks = list(enumerate(chunk_tiles(cfg, m)))
    if cfg.pattern_spec.gathers_input:  # the own rows first (already there), then the peers' as they land
        own, *peers = input_order(rank, cfg.world)
        walk = [(c, own) for c in chunks] + [(c, d) for c in chunks for d in peers]
    else:
        dests = dest_order(rank, cfg.world)
        walk = [(c, d) for d in dests for c in chunks] if dest_major else [(c, d) for c in chunks for d in dests]
    return tuple(Tile(c, dest, mt, nt, mt * cfg.block_m, nt * cfg.block_n)
                 for (c, (t0, t1)), dest in walk for mt in range(t0, t1) for nt in range(cfg.n_tiles_per_dest))


def tile_table_rows(table: tuple[Tile, ...]) -> list[list[int]]:
    """The tile table as ``[chunk, dest, row0, col0]`` integer rows (a kernel's int32 tensor)."""
    return [[t.chunk, t.dest, t.row0, t.col0] for t in table]


def tiles_per_slot(cfg: OpConfig, m: int) -> tuple[int, ...]:
    """Tiles one (dest, chunk) slot receives per call, per chunk (the same for every dest); zero for
    a pattern whose GEMM publishes nothing (the all-gather: its transfers precede the GEMM)."""
    scale = 1 if cfg.pattern_spec.scatter else 0
    return tuple(scale * (t1 - t0) * cfg.n_tiles_per_dest for t0, t1 in chunk_tiles(cfg, m))


def counter_index(dest: int, chunk: int) -> int:
    """Flat index of counters[dest, chunk] (also of scatter_flags/gather_flags[rank, chunk])."""
    assert 0 <= chunk < MAX_CHUNKS
    return dest * MAX_CHUNKS + chunk


@dataclass(frozen=True)
class CallPlan:
    """What one call of the op needs to know, identical on every rank except ``rank``-dependent
    walk order. ``counter_targets[dest][chunk]`` is cumulative over all calls of the op."""

    seq: int  # 1, 2, 3, ... : flags of this call carry it
    m: int  # the call's rows (``a``'s; all-gather: this rank's share)
    padded_m: int  # slice_m in whole m-tiles
    rank: int
    chunks: int
    rows: tuple[tuple[int, int], ...]  # per chunk, [r0, r1) real rows
    counter_base: tuple[tuple[int, ...], ...]  # [world][MAX_CHUNKS] counters before this call
    counter_targets: tuple[tuple[int, ...], ...]  # [world][MAX_CHUNKS] counters after this call
    tiles: tuple[Tile, ...]
    slice_m: int = 0  # rows of one slice (layout.slice_rows); plan_call sets it
    origins: tuple[tuple[int, int], ...] = ()  # per dest, slice_origin
    tag: int = 0  # the caller's tag, stamped with (seq, M): which of an op's users (cco.nn layers) made the call

    def target(self, dest: int, chunk: int) -> int:
        return self.counter_targets[dest][chunk]

    def slot_tiles(self, dest: int, chunk: int) -> int:
        """Layout tiles slot (dest, chunk) receives in this call: what its counter gains. A
        producer of whole chunks adds it at once, after the chunk's rows are stored."""
        return self.counter_targets[dest][chunk] - self.counter_base[dest][chunk]


def partial_strides(cfg: OpConfig, *, by_rows: bool = False) -> tuple[int, int, int]:
    """Element strides (dest, row, column) of ``partial[dest][row, col]`` in the partial region.

    A producer of tiles fills the region's own dest-major planes, so every (dest, chunk) slice is
    one contiguous block (one put). A producer of whole rows (``by_rows``: the vendor GEMM, one call
    per chunk of rows and every column) fills the same bytes as one row-major ``[m_max_padded, N]``
    matrix: dest's plane starts at column ``dest * n_slice`` and its rows lie N apart, so a
    (dest, chunk) slice is a pitched block (one 2-D put). Either way a slice holds the rows of its
    chunk and the columns dest owns, and its counter reaches the same target."""
    if by_rows:
        return cfg.n_slice, cfg.n, 1
    return cfg.m_max_padded * cfg.n_slice, cfg.n_slice, 1


def zero_counters(world: int) -> tuple[tuple[int, ...], ...]:
    return tuple((0,) * MAX_CHUNKS for _ in range(world))


def plan_call(cfg: OpConfig, *, m: int, seq: int, rank: int,
              counter_base: tuple[tuple[int, ...], ...], tag: int = 0) -> CallPlan:
    """The plan of call ``seq`` with ``m`` rows; ``counter_base`` is the previous plan's
    ``counter_targets`` (``zero_counters(world)`` for the first call)."""
    assert seq >= 1
    return plan_from(call_shape(cfg, m, rank), seq=seq, counter_base=counter_base, tag=tag)


def call_shape(cfg: OpConfig, m: int, rank: int) -> tuple:
    """What the plan of a call of ``m`` rows on ``rank`` takes from those alone (for
    :func:`plan_from`; a caller may keep it per M: looking it up here hashes the whole config)."""
    assert 1 <= m <= cfg.m_max and 0 <= rank < cfg.world and call_rows_error(cfg, m) is None
    return _call_shape(cfg, m, rank)


def plan_from(shape: tuple, *, seq: int, counter_base: tuple[tuple[int, ...], ...], tag: int = 0) -> CallPlan:
    """The plan of call ``seq`` of the :func:`call_shape` ``shape``, after ``counter_base``, made by
    the caller ``tag``."""
    m, rank, padded, per_chunk, rows, tiles, slice_m, origins = shape
    targets = tuple(tuple(map(operator.add, base, per_chunk)) for base in counter_base)
    return CallPlan(seq=seq, m=m, padded_m=padded, rank=rank, chunks=len(rows), rows=rows, counter_base=counter_base,
                    counter_targets=targets, tiles=tiles, slice_m=slice_m, origins=origins, tag=tag)


@functools.lru_cache(maxsize=TILE_TABLE_CACHE)
def _call_shape(cfg: OpConfig, m: int, rank: int):
    """:func:`call_shape`, built once per (config, M, rank): an eager call pays its host time. The
    tiles per slot come padded to MAX_CHUNKS (zero past the call's chunks)."""
    per_chunk = tiles_per_slot(cfg, m)
    rows = slice_rows(cfg, m)
    return (m, rank, padded_m(rows, cfg.block_m), per_chunk + (0,) * (MAX_CHUNKS - len(per_chunk)),
            chunk_rows(cfg, m), tile_table(cfg, m=m, rank=rank), rows,
            tuple(slice_origin(cfg, d, rows) for d in range(cfg.world)))
