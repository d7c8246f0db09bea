"""What the Triton kernels' memory ordering relies on in the PTX that Triton makes of them.

``fp8_gemm_rows_ws_kernel`` releases a tile (an add to its counter, which a copy engine's wait
then reads) after the tile left through TMA stores. Triton issues a bulk store from one elected
thread of each storing warp (two warps with Triton 3.6, one with 3.9) and the release add from one
thread. The release is ordered only if, between the tile's last bulk store and the add, the PTX
holds the full wait for the stores' writes (``cp.async.bulk.wait_group 0``; the ``.read`` form
waits only for the staging to be read) and, after it, a barrier of the threads (so the adding
thread follows every storing one). Triton 3.9 puts such a barrier there, 3.6 does not (found by
this check on the GPU machine's Triton, 2026-12-07), so the kernel's own wait carries the barrier
(``kernels.py``'s ``_bulk_writes_done``: in inline asm, since a ``tl.debug_barrier`` in the loop
stops Triton from pipelining it). That barrier is the whole block's, so the loop must run on every
thread: a kernel split into warp-specialized partitions (``setmaxnreg``, or named barriers of a
partition's threads) would hang on it. :func:`bulk_release_problem` checks both on the PTX of a
compiled kernel: the host's Triton (tests, for sm_90) and the GPU machine's
(``tests/python/cco/test_cuda_sp.py``) each compile their own.
"""

from __future__ import annotations

import re

# the instructions that order a release: bulk tensor stores, bulk waits, barriers, release adds
_OPS = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared\S*|cp\.async\.bulk\.wait_group(?:\.read)?\s+\d+"
                  r"|(?:bar|barrier)\.sync\S*\s+\d+|(?:red|atom)\.\S*release\S*")


def release_path(ptx: str) -> list[list[str]]:
    """Per release add in ``ptx``: the ordering instructions from the last bulk tensor store before
    it up to the add, whitespace collapsed."""
    ops = [" ".join(op.split()) for op in _OPS.findall(ptx)]
    paths, last_store = [], None
    for i, op in enumerate(ops):
        if op.startswith("cp.async.bulk.tensor"):
            last_store = i
        elif "release" in op and last_store is not None:
            paths.append(ops[last_store:i + 1])
    return paths


# what marks a kernel split into warp-specialized partitions: register reallocation between the
# partitions, or a barrier of some of the block's threads (``bar.sync id, threads``)
_PARTITIONED = re.compile(r"setmaxnreg|(?:bar|barrier)\.sync(?:\.aligned)?\s+\d+\s*,")


def bulk_release_problem(ptx: str) -> str | None:
    """Why a release add in ``ptx`` may be seen before the bulk stores ahead of it, or None: each
    add needs a full ``cp.async.bulk.wait_group 0`` after the last store and a barrier after that
    wait, and the kernel must not be split into warp-specialized partitions (its block-wide
    barrier would hang). Also a problem: no add follows a bulk store (nothing was checked)."""
    split = _PARTITIONED.search(ptx)
    if split:
        return f"the kernel is split into warp-specialized partitions ({split.group(0)!r}): a block-wide barrier hangs"
    paths = release_path(ptx)
    if not paths:
        return "no release add follows a bulk tensor store"
    for path in paths:
        waits = [i for i, op in enumerate(path) if re.fullmatch(r"cp\.async\.bulk\.wait_group 0", op)]
        if not waits:
            return f"no full bulk wait (cp.async.bulk.wait_group 0) between the store and the release: {path}"
        if not any(op.startswith(("bar.sync", "barrier.sync")) for op in path[waits[0] + 1:]):
            return f"no barrier between the full bulk wait and the release: {path}"
    return None


def rows_ws_ptx_sm90(quant: str = "ptpc") -> str:
    """The PTX of ``fp8_gemm_rows_ws_kernel`` compiled for sm_90 by the installed Triton on this
    host (no GPU needed), as the reduce-scatter along rows' producer launches it for ``quant``
    (its fused tile at ``rows_ws_config``'s stages, world 8). Not under Triton's interpreter (run it in a process of its own)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cco.layout import MAX_CHUNKS
    from cco.quant import SCALE_BLOCK
    from kernels_fused.hopper.gemm import QUANT_ID, default_config, rows_ws_config
    from kernels_fused.hopper.kernels import fp8_gemm_rows_ws_kernel

    cfg = rows_ws_config(default_config(quant), quant)
    operand = "bf16" if quant == "mxfp8" else "fp8e4nv"  # mxfp8's operands arrive dequantized
    signature = {"a_src": f"tensordesc<{operand}[{cfg.block_m}, {cfg.block_k}]>",
                 "b_src": f"tensordesc<{operand}[{cfg.block_n}, {cfg.block_k}]>",
                 "c_desc": f"tensordesc<bf16[1, {cfg.block_m}, {cfg.block_n // 2}]>",
                 "as_ptr": "*fp32", "bs_ptr": "*fp32", "chunk_ptr": "*i32", "counter_ptr": "*i64",
                 **dict.fromkeys(("M", "N", "K", "rank", "slice_rows", "tiles_m", "stride_asm", "stride_ask",
                                  "stride_bsn", "stride_bsk"), "i32")}
    constexprs = dict(QUANT=QUANT_ID[quant], MX_BF16=True, PRECISE_ACC=cfg.precise_acc, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE_BLOCK=SCALE_BLOCK, WORLD=8,
                      MAX_CHUNKS=MAX_CHUNKS, TILE_WEIGHT=1, NUM_PROGS=132, INTERPRET=False)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    compiled = triton.compile(ASTSource(fn=fp8_gemm_rows_ws_kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return compiled.asm["ptx"]


def main(argv=None) -> int:
    """``python -m kernels_fused.hopper.ptx [QUANT ...]``: compile the reduce-scatter along rows'
    warp-specialized producer for sm_90 here and check its releases; exit 1 on a problem."""
    import sys

    quants = (sys.argv[1:] if argv is None else argv) or ["ptpc"]
    problems = 0
    for quant in quants:
        problem = bulk_release_problem(rows_ws_ptx_sm90(quant))
        problems += problem is not None
        print(f"{quant}: {problem or 'every release follows a full bulk wait and a barrier (one partition)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
