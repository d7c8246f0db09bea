"""``Watchdog.sync`` (what ``op.check()`` and ``close()`` wait for on CUDA) waits for a replayed
CUDA graph too: the op sees only the stream of the last call it issued (for a captured call, the
capture's, idle once the capture ended), so the wait also synchronizes the caller's current stream
(a replay on it may not have entered the call yet, its marks then still say "not in a call": on an
H200 ``check()`` returned before a replay had begun and missed its release) and watches the marks
the call's device work writes, until they show it left, bounded by the deadline the watchdog's
release keeps. Host logic, with the marks and streams as stand-ins (no GPU)."""

import threading
import time
import types

from cco.cuda import watchdog as wd


class _Marks:
    def __init__(self, leave_after_s):
        self.until = None if leave_after_s is None else time.monotonic() + leave_after_s

    def in_call(self):
        return self.until is None or time.monotonic() < self.until


def _watchdog(marks, deadline_s):
    w = object.__new__(wd.Watchdog)
    w.marks, w.deadline_s, w._streams, w._set_streams, w._write_streams = marks, deadline_s, [], [], []
    w.schedule = types.SimpleNamespace(main=types.SimpleNamespace(synchronize=lambda: None))  # idle
    w._caller_stream = lambda: types.SimpleNamespace(synchronize=lambda: None)  # idle
    return w


def test_sync_waits_for_a_replay_to_leave():
    w = _watchdog(_Marks(leave_after_s=0.3), deadline_s=5.0)
    w.sync()
    # Compared with the moment the call leaves, on the marks' own clock: a duration measured from
    # after the marks were made is shorter than 0.3 s by the time between the two readings.
    returned = time.monotonic()
    assert not w.marks.in_call() and returned >= w.marks.until, returned - w.marks.until


def test_sync_gives_up_a_deadline_after_a_call_that_never_leaves():
    w = _watchdog(_Marks(leave_after_s=None), deadline_s=0.2)
    done = threading.Event()
    threading.Thread(target=lambda: (w.sync(), done.set()), daemon=True).start()
    bound = 0.2 + wd.LEFT_WAIT_S + wd.poll_interval(0.2)
    assert done.wait(bound + 2.0), "sync() did not return within its bound"


class _ReplayOnCallerStream:
    """A replay launched on the caller's stream: its marks show no call until the device enters
    it, and synchronizing the stream returns once it left."""

    def __init__(self, enter_after_s, leave_after_s):
        t = time.monotonic()
        self.enter, self.leave = t + enter_after_s, t + leave_after_s

    def in_call(self):
        return self.enter <= time.monotonic() < self.leave

    def synchronize(self):
        time.sleep(max(0.0, self.leave - time.monotonic()))


def test_sync_waits_for_a_replay_that_has_not_entered_yet():
    replay = _ReplayOnCallerStream(enter_after_s=0.05, leave_after_s=0.3)
    w = _watchdog(replay, deadline_s=5.0)
    w._caller_stream = lambda: replay
    w.sync()
    early = replay.leave - time.monotonic()
    assert early <= 0, f"sync() returned {early:.3f} s before the replay left"
