"""Triton kernels of the CUDA backend's reduce and gather phases (one launch per row chunk).

``reduce_chunk``: for rows [r0, r1) of this rank's column slice::

    acc  = partial[rank] + recv[(rank + 1) % W] + ... + recv[(rank + W - 1) % W]     (fp32, layout order)
    gather[rank] = bf16(acc)                       or  e4m3(acc / s), gather_scale[rank] = s,
                                                       s = max|acc| / 448 per row and 128 columns
    out[:, rank * n_slice:(rank + 1) * n_slice] = the value every peer will reconstruct

so the own columns of ``out`` need no second pass, and every rank ends with identical bits (with
the fp8 gather the owner writes the dequantized value too). Every program checks that
``scatter_m[src]`` holds this call's (seq, m) stamp (read from a device word, so a captured launch
stays valid) for every source: if one does not (a peer called with another M, or rejected its
inputs), the chunk's values are NaN (its rows would pair another call's data; the host raises the
error later, the output must not look good before that) and program 0 records the source in
``status``.

A reduce-scatter (``store_gather=False``) has no gather region: its reduce writes ``out`` only, at
column ``out_col0`` (0: the output is the own slice).

``check_stamps`` (the all-gather, which has no reduce): the same stamp check over every source, run
once a call's waits are all done; on a mismatch the whole output is NaN (its rows were computed from
another call's rows) and program 0 records the source in ``status``.

``dequant_chunk`` (fp8 gather only): rows [r0, r1) of every peer owner's ``gather[owner]`` ->
``out[:, owner * n_slice ...]``. With the bf16 gather that step is a pitched copy-engine copy instead.

Both are launched after stream waits on peers' flags, so neither should be compiled or loaded then:
loading a module may make the driver wait for the context's work to drain (CUDA's guide warns of it
under lazy loading), and that work waits on a peer that may wait on this rank's later submissions.
So the arguments that change per chunk and per M are not specialized (``CHUNK_ARGS``): one
compiled kernel per op serves every call, and the op loads it when it is built
(``load_only=True``), before any call can wait.
"""

from __future__ import annotations

import functools

import torch

from cco.layout import GATHER_GROUP, gather_scale_cols

STATUS_PEER_M_MISMATCH = 1  # status[0] = this + src when rank src stamped another (seq, m) ...
STATUS_WORDS = 2  # ... and status[1] = that stamp (the host names the peer's M from it)


def _pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


# the per-chunk and per-M arguments (module note): a value Triton specializes on (divisible by 16,
# equal to 1) would select another compiled kernel, loaded in the middle of a call
CHUNK_ARGS = ("row0", "rows", "programs")


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=CHUNK_ARGS)
    def _reduce(
        partial_ptr, recv_ptr, gather_ptr, gscale_ptr, out_ptr, scatter_m_ptr, status_ptr,
        stamp_ptr, rank, row0, rows, n_slice, partial_stride, region_stride, out_stride, out_col0, scale_cols,
        programs,
        WORLD: tl.constexpr, FP8_GATHER: tl.constexpr, BLOCK_C: tl.constexpr, GROUP: tl.constexpr,
        STORE_GATHER: tl.constexpr,
    ):
        pid = tl.program_id(0)
        stamp = tl.load(stamp_ptr)
        mismatch = rank < 0  # False
        for j in tl.static_range(1, WORLD):
            src = (rank + j) % WORLD
            other = tl.load(scatter_m_ptr + src) != stamp
            mismatch = mismatch | other
            if pid == 0:
                if other:
                    tl.store(status_ptr, 1 + src)  # STATUS_PEER_M_MISMATCH + src
                    tl.store(status_ptr + 1, tl.load(scatter_m_ptr + src))
        cols = tl.arange(0, BLOCK_C)
        mask = cols < n_slice
        for i in range(pid, rows, programs):
            row = (row0 + i).to(tl.int64)
            offs = row * n_slice + cols
            acc = tl.load(partial_ptr + row * partial_stride + cols, mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(1, WORLD):
                src = (rank + j) % WORLD
                acc += tl.load(recv_ptr + src * region_stride + offs, mask=mask, other=0.0).to(tl.float32)
            acc = tl.where(mismatch, float("nan"), acc)
            if FP8_GATHER:
                groups = tl.reshape(acc, (BLOCK_C // GROUP, GROUP))
                scale = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-30) / 448.0  # cco.quant.quantize_gather
                scale = tl.where(mismatch, float("nan"), scale)  # tl.max skips NaN: the scale carries it
                q = tl.reshape((groups / scale[:, None]).to(tl.float8e4nv), (BLOCK_C,))
                tl.store(gather_ptr + offs, q, mask=mask)
                g = tl.arange(0, BLOCK_C // GROUP)
                tl.store(gscale_ptr + row * scale_cols + g, scale, mask=g < scale_cols)
                value = tl.reshape(tl.reshape(q.to(tl.float32), (BLOCK_C // GROUP, GROUP)) * scale[:, None],
                                   (BLOCK_C,)).to(tl.bfloat16)
            else:
                value = acc.to(tl.bfloat16)
                if STORE_GATHER:  # (a reduce-scatter has no gather region)
                    tl.store(gather_ptr + offs, value, mask=mask)
            tl.store(out_ptr + row * out_stride + out_col0 + cols, value, mask=mask)

    @triton.jit(do_not_specialize=CHUNK_ARGS)
    def _check(
        out_ptr, scatter_m_ptr, status_ptr, stamp_ptr, rank, rows, n, out_stride, programs,
        WORLD: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # the reduce's stamp check, written out (a jit helper closed over here is not resolved by
        # every Triton this runs on)
        stamp = tl.load(stamp_ptr)
        mismatch = rank < 0  # False
        for j in tl.static_range(1, WORLD):
            src = (rank + j) % WORLD
            other = tl.load(scatter_m_ptr + src) != stamp
            mismatch = mismatch | other
            if pid == 0:
                if other:
                    tl.store(status_ptr, 1 + src)  # STATUS_PEER_M_MISMATCH + src
                    tl.store(status_ptr + 1, tl.load(scatter_m_ptr + src))
        if mismatch:
            cols = tl.arange(0, BLOCK_C)
            nan = tl.full((BLOCK_C,), float("nan"), tl.float32).to(tl.bfloat16)
            for i in range(pid, rows, programs):
                row = (pid * 0 + i).to(tl.int64)  # (i is a plain int under the interpreter)
                for c0 in range(0, n, BLOCK_C):
                    tl.store(out_ptr + row * out_stride + c0 + cols, nan, mask=c0 + cols < n)

    @triton.jit(do_not_specialize=CHUNK_ARGS)
    def _dequant(
        gather_ptr, gscale_ptr, out_ptr, rank, row0, rows, n_slice, region_stride, scale_stride, out_stride,
        scale_cols, programs,
        WORLD: tl.constexpr, BLOCK_C: tl.constexpr, FP8_GATHER: tl.constexpr, GROUP: tl.constexpr,
    ):
        owner = (rank + 1 + tl.program_id(1)) % WORLD
        cols = tl.arange(0, BLOCK_C)
        mask = cols < n_slice
        for i in range(tl.program_id(0), rows, programs):
            row = (row0 + i).to(tl.int64)
            q = tl.load(gather_ptr + owner * region_stride + row * n_slice + cols, mask=mask, other=0.0)
            if FP8_GATHER:
                scale = tl.load(gscale_ptr + owner * scale_stride + row * scale_cols + cols // GROUP, mask=mask,
                                other=0.0)
                value = (q.to(tl.float32) * scale).to(tl.bfloat16)
            else:
                value = q
            tl.store(out_ptr + row * out_stride + owner * n_slice + cols, value, mask=mask)

    return _reduce, _dequant, _check


def _block_c(n_slice: int) -> int:
    return max(_pow2(n_slice), GATHER_GROUP)


def _warps(block_c: int) -> int:
    return 8 if block_c >= 2048 else 4


def _programs(rows: int, programs: int | None) -> int:
    return rows if programs is None else max(1, min(rows, programs))


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict, load_only: bool) -> None:
    """Launch, or (``load_only``) compile and load the kernel these arguments select, launching nothing."""
    if not load_only:
        kernel[grid](*args, **kwargs)
        return
    kernel.warmup(*args, grid=grid, **kwargs)._init_handles()


def reduce_chunk(*, partial: torch.Tensor, recv: torch.Tensor, gather: torch.Tensor | None,
                 gather_scale: torch.Tensor | None, out: torch.Tensor, scatter_m: torch.Tensor,
                 status: torch.Tensor, rank: int, rows: tuple[int, int], stamp: torch.Tensor,
                 programs: int | None = None, load_only: bool = False, out_col0: int | None = None) -> None:
    """Reduce rows ``rows`` of this rank's slice (see module doc). ``partial``, ``recv``, ``gather``
    are the window's [W, rows_max, n_slice] regions (``partial`` as the producer wrote it: its rows
    may lie further apart, ``cco.layout.partial_strides``); ``out`` is the caller's bf16 [M, N]; ``stamp``
    the int64 word holding this call's (seq, m) stamp. ``programs``: how many programs stride the rows
    (None: one per row). ``gather=None`` (a reduce-scatter): ``out`` only, its own slice from column
    ``out_col0`` (default: ``rank * n_slice``, the all-reduce's; 0 for a reduce-scatter)."""
    world, _, n_slice = recv.shape
    r0, r1 = rows
    if r1 <= r0:
        return
    store_gather = gather is not None
    fp8 = store_gather and gather.dtype == torch.float8_e4m3fn
    block_c = _block_c(n_slice)
    reduce = _kernels()[0]
    grid = _programs(r1 - r0, programs)
    gather_arg = gather[rank] if store_gather else out  # unread without STORE_GATHER
    _launch(reduce, (grid,), (
        partial[rank], recv, gather_arg, gather_scale[rank] if fp8 else gather_arg, out, scatter_m, status,
        stamp, rank, r0, r1 - r0, n_slice, partial.stride(1), recv.stride(0), out.stride(0),
        rank * n_slice if out_col0 is None else out_col0, gather_scale_cols(n_slice), grid,
    ), dict(WORLD=world, FP8_GATHER=fp8, BLOCK_C=block_c, GROUP=GATHER_GROUP, STORE_GATHER=store_gather,
            num_warps=_warps(block_c)), load_only)


CHECK_PROGRAMS = 1024  # the stamp check's programs: each reads the stamps; on a mismatch they stride the rows


def check_stamps(*, out: torch.Tensor, scatter_m: torch.Tensor, status: torch.Tensor, stamp: torch.Tensor,
                 rank: int, world: int, load_only: bool = False) -> None:
    """The all-gather's stamp check (module doc): ``out`` (bf16 [rows, N], unit column stride) all
    NaN if any source's stamp in ``scatter_m`` differs from ``stamp``; ``status`` records it."""
    rows, n = out.shape
    if rows == 0 or world == 1:
        return
    block_c = min(_pow2(n), 4096)
    grid = _programs(rows, CHECK_PROGRAMS)
    _launch(_kernels()[2], (grid,), (out, scatter_m, status, stamp, rank, rows, n, out.stride(0), grid),
            dict(WORLD=world, BLOCK_C=block_c, num_warps=4), load_only)


def dequant_chunk(*, gather: torch.Tensor, gather_scale: torch.Tensor | None, out: torch.Tensor, rank: int,
                  rows: tuple[int, int], programs: int | None = None, load_only: bool = False) -> None:
    """Rows ``rows`` of every peer owner's gathered slice -> ``out`` (bf16): dequantized for the fp8
    gather (``gather_scale`` given), copied for the bf16 one."""
    world, _, n_slice = gather.shape
    r0, r1 = rows
    if r1 <= r0 or world == 1:
        return
    block_c = _block_c(n_slice)
    dequant = _kernels()[1]
    grid = _programs(r1 - r0, programs)
    _launch(dequant, (grid, world - 1), (
        gather, gather if gather_scale is None else gather_scale, out, rank, r0, r1 - r0, n_slice, gather.stride(0),
        0 if gather_scale is None else gather_scale.stride(0), out.stride(0), gather_scale_cols(n_slice), grid,
    ), dict(WORLD=world, BLOCK_C=block_c, FP8_GATHER=gather_scale is not None, GROUP=GATHER_GROUP,
            num_warps=_warps(block_c)), load_only)
