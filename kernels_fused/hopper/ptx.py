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
compiled kernel: the walk's launch before its first run (``gemm.check_releases``), and the host's
compile for sm_90 (``kernels_fused.hopper.walk_ptx``: the tests with the host's Triton and with
the GPU machines', the GPU suite with the GPU machine's). Pure text reading: no Triton here.
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
