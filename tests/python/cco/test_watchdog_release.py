"""The watchdog's release of a stuck call while the driver holds this process's copies.

On an H200, a host thread copying a stuck call's output to pageable memory (``out.cpu()`` before
``op.check()``) waits in the driver for the call, and while it waits the driver holds every other
thread's copy: the watchdog's own reads blocked in their ``cuMemcpyAsync``, so its deadline never
fired, and a release made of copies never ran (docs/BENCHMARKS.md, "Faults and deadlines on the
GPU"). So the deadline's thread makes no copy before its release: its diagnosis reads are bounded
(``DIAGNOSIS_WAIT_S``), the monitor's reads run on a thread of their own, and the release is issued
with memsets (and write-values) before the same release with copies.

Host logic: the memory operations are a recorder whose copies never return (the held driver),
the marks a call that never leaves. No GPU.
"""

import threading
import time
import types

import torch

from cco.cuda import watchdog as wd

DEADLINE_S = 0.2


class _HeldCopies:
    """Write-values and memsets are recorded; a copy blocks until ``unblock`` is set."""

    def __init__(self):
        self.ops = []
        self.unblock = threading.Event()
        self.copies_tried = 0

    def write(self, stream, addr, value):
        self.ops.append((stream, "write", addr, value))

    def fill(self, stream, dst, byte, nbytes):
        self.ops.append((stream, "fill", dst, byte, nbytes))

    def copy(self, stream, dst, src, nbytes):
        self.copies_tried += 1
        self.unblock.wait()
        self.ops.append((stream, "copy", dst, src, nbytes))


class _StuckMarks:
    def take_progress(self):
        return False

    def in_call(self):
        return True


def _watchdog(memops):
    """A Watchdog's state as ``__init__`` leaves it, on CPU tensors and named streams."""
    w = object.__new__(wd.Watchdog)
    w.marks, w.memops, w.deadline_s, w.rank, w.world, w.peers = _StuckMarks(), memops, DEADLINE_S, 0, 2, []
    w.schedule = types.SimpleNamespace(plan=None, path="dma", flag_set=torch.zeros(1, dtype=torch.int64),
                                       stamp=torch.zeros(1, dtype=torch.int64),
                                       status=torch.zeros(2, dtype=torch.int64))
    w._copy_host = memops.copy
    w._poison = [torch.zeros(64, dtype=torch.bfloat16) for _ in range(3)]
    w._flags = [torch.zeros(4, dtype=torch.int64) for _ in range(2)]
    w._tile_flags = torch.zeros(8, dtype=torch.int64)
    w._fill = torch.full((64,), 0xFF, dtype=torch.uint8)
    w._streams, w._set_streams, w._remote, w._remote_events = ["copy-stream"], ["set-stream"], [], []
    w._scratch, w._scratch_events = [torch.zeros(8, dtype=torch.int64)], [None]
    w._header = torch.zeros(8, dtype=torch.int64)  # the monitor's reads (a thread of their own)
    w._seen, w._seen_stream, w._seen_since, w._seen_event = [torch.zeros(10, dtype=torch.int64)], 0, None, None
    w._clear_event, w._clear_gen, w._seen_gen = None, 0, 0
    w._read_lock, w._lock, w._stop = threading.Lock(), threading.Lock(), threading.Event()
    w.error = w.deferred = None
    w.releases = 0
    w._enter_thread = lambda: None  # no device context to enter
    return w


def test_release_is_issued_while_copies_are_held():
    memops = _HeldCopies()
    w = _watchdog(memops)
    thread = threading.Thread(target=w._run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    try:
        bound = DEADLINE_S + 2.0  # the op's promise: every live rank raises within deadline + 2 s
        while w.error is None and time.monotonic() - t0 < bound + 1.0:
            time.sleep(0.01)
        failed_after = time.monotonic() - t0
        assert w.error is not None, "the deadline did not fire while copies were held"
        assert failed_after <= bound, f"the op failed {failed_after:.2f} s after the call began"
        assert "no diagnosis" in str(w.error) and "did not return" in str(w.error), str(w.error)
        # the whole memset release went out before the thread reached a copy
        until = time.monotonic() + 1.0
        while memops.copies_tried < 2 and time.monotonic() < until:  # the diagnosis's read, then the release's
            time.sleep(0.01)
        released = [op for op in memops.ops if op[0] == "set-stream"]
        regions = [t.data_ptr() for t in w._poison]
        fills = [op[2] for op in released if op[1] == "fill"]
        flag_words = {t.data_ptr() + 8 * i for t in w._flags for i in range(t.numel())}
        assert released[0] == ("set-stream", "write", w.schedule.flag_set.data_ptr(), 0)
        assert fills[:3] == regions and fills[-1] == w._tile_flags.data_ptr()
        assert {op[2] for op in released if op[1] == "write" and op[3] == 1} == flag_words
        last_fill = max(i for i, op in enumerate(released) if op[1] == "fill" and op[2] in regions)
        assert all(i > last_fill for i, op in enumerate(released) if op[1] == "write" and op[3] == 1)
    finally:
        w._stop.set()
        memops.unblock.set()
        thread.join(5.0)
    assert not thread.is_alive()
    # once the driver lets copies through, the copied release follows on its own streams
    assert ("copy-stream", "write", w.schedule.flag_set.data_ptr(), 0) in memops.ops


def test_a_refused_memset_leaves_the_copied_release():
    """The memset round is new beside the copied one: if the driver refuses it, the copies still go."""
    class RefusedFill(_HeldCopies):
        def fill(self, stream, dst, byte, nbytes):
            raise RuntimeError("cuMemsetD8Async failed: CUDA_ERROR_NOT_SUPPORTED")

    memops = RefusedFill()
    memops.unblock.set()
    w = _watchdog(memops)
    w.fire(RuntimeError("stuck"))
    flag_words = {t.data_ptr() + 8 * i for t in w._flags for i in range(t.numel())}
    copied = [op for op in memops.ops if op[0] == "copy-stream"]
    assert {op[2] for op in copied if op[1] == "write" and op[3] == 1} == flag_words
    assert {op[2] for op in copied if op[1] == "copy"} >= {t.data_ptr() for t in w._poison}
    assert str(w.error) == "stuck" and w.releases == 1
