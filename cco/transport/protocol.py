"""The completion protocol's primitives: deadlines, waits on monotonic words, and its errors.

On the CPU path every word a waiter watches (tile counters, scatter/gather flags, the header's
LEFT word) only grows: counters by one per tile, flags to the seq of the call that set them. A wait
is ``word >= target`` with a deadline, so repeated calls need no reset, and a value left by an
earlier call can never satisfy a later one. (The CUDA path consumes words instead, for graph
replay: ``cco.backends.cuda``.)

Memory ordering on the CPU window: a writer stores the data, then the flag, each with plain stores
to shared memory. x86-64 (TSO) keeps stores in program order as seen by other cores, and a reader
loads the flag before the data, so data written before a flag is visible once the flag is. Other
architectures would need fences here; the CPU path checks ``platform.machine()`` at window open.
"""

from __future__ import annotations

import time


class CommTimeoutError(TimeoutError):
    """A wait passed its deadline: a peer died, stalled, called with other arguments, or a transfer
    was lost. The message names the rank that waited, what it waited for and what it saw."""


class PeerMismatchError(ValueError):
    """Ranks called the same collective with different arguments (e.g. different M)."""


class PeerRejectedError(PeerMismatchError):
    """A peer rejected its inputs to this call (its own error is a TypeError or ValueError); the
    message names that rank, the call's seq and the peer's reason. The call fails on every rank;
    the ranks stay in step, so the next call works."""


class ArgumentMismatchError(PeerMismatchError):
    """Ranks built a collective object (an op, a layer) with different arguments. Construction is
    collective, so every rank raises it, naming each differing argument and each rank's value."""


class TransferError(RuntimeError):
    """A transport failed while moving a chunk (raised on the rank that owns the transport)."""


class SelfTestError(RuntimeError):
    """``self_test()`` found bytes that did not arrive, or arrived wrong."""


class Deadline:
    """An absolute deadline shared by every wait of one call."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expires = time.monotonic() + seconds

    def left(self) -> float:
        return self.expires - time.monotonic()


# Polling backoff: spin briefly, then sleep so ranks oversubscribing a few cores still progress.
_SPIN_POLLS = 64
_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3


def wait_at_least(words, index: int, target: int, *, deadline: Deadline, what: str,
                  cancelled=None) -> int:
    """Wait until ``words[index] >= target`` (``words`` a 1-D int64 tensor view); return its value.

    ``what`` describes the word for the error, e.g. ``"rank 1: scatter flag of src 0, chunk 2,
    seq 7"``. ``cancelled`` (optional callable) lets a helper thread stop waiting when its call has
    already failed. A word that reached its target before the cancel (or the deadline) is always
    returned, never reported as cancelled or late."""
    polls, sleep = 0, _SLEEP_MIN_S
    while True:
        # Sample the stop conditions BEFORE loading the word. A waiter descheduled between a load and
        # the check would otherwise give up on a stale value: the producer can complete the word and
        # then cancel the call in that gap (a failing rank's copier then dropped a complete chunk).
        # Sampled first, a stop is only honoured if the word is still short after it.
        expired = deadline.left() <= 0
        stop = cancelled is not None and cancelled()
        value = int(words[index])
        if value >= target:
            return value
        if expired:
            raise CommTimeoutError(
                f"{what}: waited {deadline.seconds:.3g} s for value >= {target}, last saw {value} "
                f"(a peer died, stalled, called with other arguments, or a transfer was lost)"
            )
        if stop:
            raise CommTimeoutError(f"{what}: wait cancelled because the call already failed")
        polls += 1
        if polls > _SPIN_POLLS:
            time.sleep(sleep)
            sleep = min(sleep * 2, _SLEEP_MAX_S)


def release(words, index: int, value: int) -> None:
    """Publish ``words[index] = value`` after all earlier stores (see module note on ordering)."""
    words[index] = value
