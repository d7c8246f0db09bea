"""The watchdog's release of a stuck call while the driver holds this process's other calls.

On an H200, while one host thread copies a stuck call's output to pageable memory (``out.cpu()``
before ``op.check()``), the driver holds every other thread's copies, memsets, kernel launches and
event records until that copy is done, which it never is before the release; stream write-values
and event queries still go through (docs/experiments.md, "Faults and deadlines on the GPU"). So the
deadline's thread makes no copy before its release (its diagnosis reads are bounded,
``DIAGNOSIS_WAIT_S``; the monitor's reads run on a thread of their own), the NaN fill runs on a
worker whose landing the release waits for only ``POISON_WAIT_S``, and the release proper is made
of write-values alone, on streams of its own.

Host logic: the memory operations are a recorder whose write-values run at once (a write into the
pinned "landed" words lands there, as the device would) and whose fills and copies can be held;
the marks are a call that never leaves. No GPU.
"""

import threading
import time
import types

import pytest
import torch

from cco.cuda import watchdog as wd

DEADLINE_S = 0.2
BLOCK_M = 2
ISSUE_S = 0.002  # a fill's or copy's host time: a release not waiting for them overtakes them


class _Driver:
    """Records every operation in issue order; ``held``: fills and copies wait until ``unblock``."""

    def __init__(self, *, held: bool):
        self.ops = []
        self.unblock = threading.Event()
        if not held:
            self.unblock.set()
        self.landed = None  # the watchdog's pinned LANDED words, once it has them

    def write(self, stream, addr, value):
        self.ops.append((stream, "write", addr, value, time.monotonic()))
        if self.landed is not None:
            for word in range(self.landed.numel()):
                if addr == self.landed.data_ptr() + 8 * word:
                    self.landed[word] = value

    def fill(self, stream, dst, byte, nbytes):
        self.unblock.wait()
        time.sleep(ISSUE_S)
        self.ops.append((stream, "fill", dst, byte, nbytes))

    def copy(self, stream, dst, src, nbytes):
        self.unblock.wait()
        time.sleep(ISSUE_S)
        self.ops.append((stream, "copy", dst, src, nbytes))


class _StuckMarks:
    def take_progress(self):
        return False

    def in_call(self):
        return True


def _watchdog(memops, *, lsa_rows=3):
    """A Watchdog's state as ``__init__`` leaves it, on CPU tensors and named streams: rank 0 of 2."""
    w = object.__new__(wd.Watchdog)
    w.marks, w.memops, w.deadline_s, w.rank, w.world, w.peers = _StuckMarks(), memops, DEADLINE_S, 0, 2, [1]
    w.config = types.SimpleNamespace(block_m=BLOCK_M)
    w.schedule = types.SimpleNamespace(plan=None, path="dma", flag_set=torch.zeros(1, dtype=torch.int64),
                                       stamp=torch.zeros(1, dtype=torch.int64), lsa_rows=lsa_rows,
                                       status=torch.zeros(2, dtype=torch.int64))
    w._copy_host = memops.copy
    w._peer_header = {1: torch.zeros(8, dtype=torch.int64)}
    w._scatter_m = torch.zeros(2, dtype=torch.int64)
    w._poison = [torch.zeros(64, dtype=torch.bfloat16) for _ in range(3)]
    w._flags = [torch.zeros(4, dtype=torch.int64) for _ in range(2)]
    w._counters = torch.zeros(2 * 4, dtype=torch.int64)  # [dest, chunk]
    w._tile_flags = torch.zeros(2, 2, 4, 3, dtype=torch.int64)  # [plane, src, m-tile, n-tile]
    w._fill = torch.full((64,), 0xFF, dtype=torch.uint8)
    w._streams, w._set_streams, w._write_streams, w._remote = ["copy-stream"], ["set-stream"], ["write-stream"], \
        ["remote-stream"]
    w._landed = memops.landed = torch.zeros(2, dtype=torch.int64)
    w._poisoner = None
    w._scratch, w._scratch_events = [torch.zeros(64, dtype=torch.int64)], [None]
    w._header = torch.zeros(8, dtype=torch.int64)  # the monitor's reads (a thread of their own)
    w._seen, w._seen_stream, w._seen_since, w._seen_event = [torch.zeros(10, dtype=torch.int64)], 0, None, None
    w._clear_event, w._clear_gen, w._seen_gen = None, 0, 0
    w._read_lock, w._lock, w._stop = threading.Lock(), threading.Lock(), threading.Event()
    w.error = w.deferred = None
    w.releases = 0
    w._enter_thread = lambda: None  # no device context to enter
    return w


def _expected_release(w) -> set:
    """(address, value) of the release proper, computed element by element."""
    tiles = w._tile_flags
    used_m_tiles = -(-w.schedule.lsa_rows // BLOCK_M)
    words = {(w.schedule.flag_set.data_ptr(), 0), (w._scatter_m[1].data_ptr(), wd.RELEASED_WORD)}
    words |= {(f[i].data_ptr(), 1) for f in w._flags for i in range(f.numel())}
    words |= {(w._counters[i].data_ptr(), wd.COUNTER_RELEASED) for i in range(w._counters.numel())}
    words |= {(tiles[p, s, m, n].data_ptr(), wd.RELEASED_WORD) for p in range(2) for s in range(2)
              for m in range(used_m_tiles) for n in range(tiles.shape[3])}
    return words


def _released(memops, stream="write-stream"):
    return [op for op in memops.ops if op[0] == stream and op[1] == "write"]


def _released_words(memops) -> set:
    """(address, value) of the release's write-values so far."""
    return {(op[2], op[3]) for op in _released(memops)}


def test_release_is_issued_while_fills_and_copies_are_held():
    memops = _Driver(held=True)
    w = _watchdog(memops)
    thread = threading.Thread(target=w._run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    try:
        bound = DEADLINE_S + 2.0  # the op's promise: every live rank raises within deadline + 2 s
        while not _released(memops) and time.monotonic() - t0 < bound + 1.0:
            time.sleep(0.01)
        assert w.error is not None, "the deadline did not fire while fills and copies were held"
        assert "waits for what rank 1 sends" in str(w.error) and "did not return" in str(w.error), str(w.error)
        released = _released(memops)
        assert released, "no release was issued while fills and copies were held"
        assert released[0][4] - t0 <= bound, f"the release began {released[0][4] - t0:.2f} s after the call"
        expected = _expected_release(w)
        until = time.monotonic() + 2.0  # the rest of the round; a loaded host may need more than a few ms
        while _released_words(memops) != expected and time.monotonic() < until:
            time.sleep(0.01)
        assert _released_words(memops) == expected
        released = _released(memops)
        assert released[0][2:4] == (w.schedule.flag_set.data_ptr(), 0)  # muted before any flag is set
        record = w._peer_header[1].data_ptr() + wd.FAILED_WORD * 8
        assert [op[2] for op in memops.ops if op[0] == "remote-stream"][0] == record
        assert not [op for op in memops.ops if op[1] in ("fill", "copy")], "a held fill went out"
    finally:
        w._stop.set()
        memops.unblock.set()
        thread.join(5.0)
    assert not thread.is_alive()
    w._poisoner.join(5.0)
    # once the driver lets them through, the fills follow: every region, by memsets then copies
    regions = {t.data_ptr() for t in w._poison} | {w._tile_flags.data_ptr()}
    assert {op[2] for op in memops.ops if op[0] == "set-stream" and op[1] == "fill"} == regions


def test_the_nan_fill_lands_before_the_release_when_nothing_holds_it():
    memops = _Driver(held=False)
    w = _watchdog(memops)
    w.fire(RuntimeError("stuck"))
    ops = memops.ops
    first_release = ops.index(_released(memops)[0])
    regions = {t.data_ptr() for t in w._poison} | {w._tile_flags.data_ptr()}
    assert {op[2] for op in ops[:first_release] if op[1] == "fill"} == regions
    assert _released_words(memops) == _expected_release(w)
    assert str(w.error) == "stuck" and w.releases == 1


def test_a_refused_memset_leaves_the_copied_fill():
    class RefusedFill(_Driver):
        def fill(self, stream, dst, byte, nbytes):
            raise RuntimeError("cuMemsetD8Async failed: CUDA_ERROR_NOT_SUPPORTED")

    memops = RefusedFill(held=False)
    w = _watchdog(memops)
    w.fire(RuntimeError("stuck"))
    first_release = memops.ops.index(_released(memops)[0])
    copied = {op[2] for op in memops.ops[:first_release] if op[0] == "copy-stream" and op[1] == "copy"}
    assert copied >= {t.data_ptr() for t in w._poison} | {w._tile_flags.data_ptr()}
    assert _released_words(memops) == _expected_release(w)


@pytest.mark.parametrize("lsa_rows, m_tiles", [(0, 0), (1, 1), (2, 1), (3, 2), (8, 4)])
def test_the_lsa_tile_flags_released_are_those_of_the_rows_used(lsa_rows, m_tiles):
    w = _watchdog(_Driver(held=False), lsa_rows=lsa_rows)
    tile_words = {a for a, v in w._release_words() if v == wd.RELEASED_WORD} - {w._scatter_m[1].data_ptr()}
    tiles = w._tile_flags
    assert tile_words == {tiles[p, s, m, n].data_ptr() for p in range(2) for s in range(2) for m in range(m_tiles)
                          for n in range(tiles.shape[3])}
