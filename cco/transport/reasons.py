"""Why a rank rejected a call, for its peers' errors.

A rank whose inputs fail validation still takes part in the call (``cco.op``, "Rejected calls"):
it publishes a "rejected" (seq, M) stamp, which is all a peer needs to fail the call. The reason
(the rank's own error message) is text of any length, so it does not travel through the window:
the rejecting rank writes it into the communicator's key-value store before it publishes the
stamp, and a peer that finds the stamp reads it from there. Both happen on the error path only.
"""

from __future__ import annotations

import datetime

from cco.transport.protocol import PeerRejectedError

REASON_CHARS = 400  # of the rejecting rank's error message, enough for its first sentences
_FETCH_S = 5.0  # a peer's wait for the reason; it was written before the stamp the peer just read


def _store(comm):
    """The store of ``comm``'s process group: ``comm.store`` if the communicator has one, else the
    default group's (torchrun, mpirun and spawn all create one)."""
    store = getattr(comm, "store", None)
    if store is not None:
        return store
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class RejectionNotes:
    """The reasons of one op's rejected calls, keyed by the op's ``token`` (the same on every rank),
    the call's seq and the rejecting rank."""

    def __init__(self, comm, token: str):
        self.comm = comm
        self.token = token

    def _key(self, seq: int, rank: int) -> str:
        return f"cco/{self.token}/rejected/{seq}/{rank}"

    def post(self, *, seq: int, rank: int, reason: str) -> str | None:
        """Publish ``reason``; None, or why it could not be published (the peers then say so)."""
        try:
            _store(self.comm).set(self._key(seq, rank), reason[:REASON_CHARS])
        except Exception as err:  # the stamp alone still fails the call on every rank
            return f"{type(err).__name__}: {err}"
        return None

    def posted(self, *, seq: int, rank: int) -> bool:
        """Whether ``rank`` published a reason for rejecting call ``seq`` (without waiting for one)."""
        try:
            return bool(_store(self.comm).check([self._key(seq, rank)]))
        except Exception:  # noqa: BLE001 - a store that cannot say: the caller waits for the stamp
            return False

    def fetch(self, *, seq: int, rank: int) -> str:
        """The reason ``rank`` gave for rejecting call ``seq``, or a note saying why it is missing."""
        key = self._key(seq, rank)
        try:
            store = _store(self.comm)
            store.wait([key], datetime.timedelta(seconds=_FETCH_S))
            value = store.get(key)
        except Exception as err:
            return f"(its reason could not be read from the store: {type(err).__name__}: {err})"
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def post_rejection(notes: RejectionNotes | None, *, seq: int, rank: int, error: BaseException) -> None:
    """Publish ``error`` as ``rank``'s reason for rejecting call ``seq`` (before its rejected stamp);
    where it cannot be published, say so on ``error`` (the stamp alone still fails the call)."""
    problem = notes.post(seq=seq, rank=rank, reason=f"{type(error).__name__}: {error}") if notes is not None else None
    if problem is not None:
        error.add_note(f"rank {rank}: the reason could not be passed to the peers: {problem}")


def rejected_error(notes: RejectionNotes | None, *, rank: int, src: int, seq: int,
                   output: str = "") -> PeerRejectedError:
    """The error ``rank`` raises for call ``seq``, which rank ``src`` rejected, with ``src``'s
    reason; ``output`` says what became of this rank's output, where that needs saying."""
    reason = notes.fetch(seq=seq, rank=src) if notes is not None else "(the op has no store)"
    # a layer takes part in a call as a rejected one where a call of its own failed first (its header
    # timed out, or met a later call of its peers): its inputs were not the reason
    what = (f"took part in call seq {seq} as a rejected call, a call of its own having failed first"
            if reason.startswith(("CommTimeoutError:", "PeerMismatchError:")) else
            f"rejected its inputs to call seq {seq}")
    return PeerRejectedError(f"rank {rank}: rank {src} {what}, so the call fails on every rank{output} (the next "
                             f"call works); rank {src}: {reason}")
