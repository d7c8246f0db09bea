"""What a rank leaves for its peers' errors: why it rejected a call, and that it closed its op.

A rank whose inputs fail validation still takes part in the call (``cco.op``, "Rejected calls"):
it publishes a "rejected" (seq, M) stamp, which is all a peer needs to fail the call. The reason
(the rank's own error message) is text of any length, so it does not travel through the window:
the rejecting rank writes it into the communicator's key-value store before it publishes the
stamp, and a peer that finds the stamp reads it from there. Both happen on the error path only.

A rank that closes its op (``close()``, local: a ``with`` block left on one rank by an exception
of its own, say) writes the seq of its last call there too. A peer that calls the op again waits
out its deadline, as for a stalled peer; its timeout then says which peers closed their op and
after which call, instead of leaving "stalled, died or lost a put" to guess (:meth:`PeerNotes.closed`).
"""

from __future__ import annotations

import datetime

from cco.transport.protocol import CommTimeoutError, PeerRejectedError
from cco.transport.store import STORE_CALL_S, store_of, within

REASON_CHARS = 400  # of the rejecting rank's error message, enough for its first sentences
_FETCH_S = 5.0  # a peer's wait for the reason; it was written before the stamp the peer just read


class PeerNotes:
    """What one op's ranks leave in the store for their peers, keyed by the op's ``token`` (the same
    on every rank): the reasons of rejected calls (by the call's seq and the rejecting rank), and
    the last call of a rank that closed its op."""

    def __init__(self, comm, token: str):
        self.comm = comm
        self.token = token

    def _key(self, seq: int, rank: int) -> str:
        return f"cco/{self.token}/rejected/{seq}/{rank}"

    def post(self, *, seq: int, rank: int, reason: str) -> str | None:
        """Publish ``reason``; None, or why it could not be published (the peers then say so)."""
        try:
            store_of(self.comm).set(self._key(seq, rank), reason[:REASON_CHARS])
        except Exception as err:  # the stamp alone still fails the call on every rank
            return f"{type(err).__name__}: {err}"
        return None

    def posted(self, *, seq: int, rank: int) -> bool:
        """Whether ``rank`` published a reason for rejecting call ``seq`` (without waiting for one)."""
        try:
            return bool(store_of(self.comm).check([self._key(seq, rank)]))
        except Exception:  # noqa: BLE001 - a store that cannot say: the caller waits for the stamp
            return False

    def fetch(self, *, seq: int, rank: int) -> str:
        """The reason ``rank`` gave for rejecting call ``seq``, or a note saying why it is missing."""
        key = self._key(seq, rank)
        try:
            store = store_of(self.comm)
            store.wait([key], datetime.timedelta(seconds=_FETCH_S))
            value = store.get(key)
        except Exception as err:
            return f"(its reason could not be read from the store: {type(err).__name__}: {err})"
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    def _closed_key(self, rank: int) -> str:
        return f"cco/{self.token}/closed/{rank}"

    def post_closed(self, *, rank: int, seq: int) -> None:
        """``rank`` closed its op after its call ``seq`` (best effort, bounded: close() is local and
        must neither fail nor wait on the store; where it cannot be written, the peers' timeouts say
        what they said before)."""
        key = self._closed_key(rank)
        within(lambda: store_of(self.comm).set(key, str(seq)))

    def _closed_layer_key(self, rank: int, tag: int) -> str:
        return f"cco/{self.token}/closed-layer/{tag}/{rank}"

    def post_closed_layer(self, *, rank: int, tag: int, seq: int) -> None:
        """``rank`` closed its layer ``tag`` (``cco.nn.pool.layer_tag``) of the family sharing this op
        after the op's call ``seq``, the op staying open for the family's other layers; best effort
        and bounded, as :meth:`post_closed`."""
        key = self._closed_layer_key(rank, tag)
        within(lambda: store_of(self.comm).set(key, str(seq)))

    def closed(self, peers, *, within_s: float = STORE_CALL_S, tag: int | None = None) -> dict[int, int]:
        """``{rank: seq of its last call}`` of the ``peers`` that closed their op, read within
        ``within_s`` (:func:`within`; none where the reads did not end by then); with ``tag``, the
        peers that closed that layer of the op's family instead (:meth:`post_closed_layer`)."""
        def read() -> dict[int, int]:
            store, found = store_of(self.comm), {}
            for p in peers:
                key = self._closed_key(p) if tag is None else self._closed_layer_key(p, tag)
                if store.check([key]):
                    found[p] = int(store.get(key))
            return found

        return within(read, within_s) or {}


def note_closed_peers(error: BaseException, notes: PeerNotes | None, *, rank: int, world: int, seq: int,
                      what: str, tag: int = 0) -> None:
    """Where ``error`` is a wait that passed its deadline (``CommTimeoutError``) in this rank's calls
    up to ``seq``, add a note naming each peer that closed its op (``what``) before that call: those
    calls could not complete; and, for a call of a layer (``tag`` > 0), each peer that closed that
    layer while its family's op stayed open (the peer's calls of the family's other layers go on,
    so its op is not closed, but this layer's calls never come). Once per error object (a failed op
    raises the same error again)."""
    if notes is None or not isinstance(error, CommTimeoutError) or getattr(error, "_cco_closed_looked", False):
        return
    error._cco_closed_looked = True
    peers = [p for p in range(world) if p != rank]
    for peer, last in sorted(notes.closed(peers).items()):
        if last < seq:
            error.add_note(f"rank {peer} closed its {what} (close()) after its call seq {last}, so rank {rank}'s "
                           f"calls since cannot complete: close the op on every rank together (or none)")
    if tag > 0:
        for peer, last in sorted(notes.closed(peers, tag=tag).items()):
            if last < seq:
                error.add_note(f"rank {peer} closed layer #{tag} (close()) after its {what}'s call seq {last}, so "
                               f"rank {rank}'s calls of that layer since cannot complete: close the layers on every "
                               f"rank together (cco.nn.close_layers), or none")


def post_rejection(notes: PeerNotes | None, *, seq: int, rank: int, error: BaseException) -> None:
    """Publish ``error`` as ``rank``'s reason for rejecting call ``seq`` (before its rejected stamp);
    where it cannot be published, say so on ``error`` (the stamp alone still fails the call)."""
    problem = notes.post(seq=seq, rank=rank, reason=f"{type(error).__name__}: {error}") if notes is not None else None
    if problem is not None:
        error.add_note(f"rank {rank}: the reason could not be passed to the peers: {problem}")


def rejected_error(notes: PeerNotes | None, *, rank: int, src: int, seq: int,
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
