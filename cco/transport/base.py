"""The transport interface: how a completed (dest, chunk) slice of the partial, and a reduced chunk,
reach the rank that needs them.

Two transports, one interface:

- ``dma``: the producer stores tiles into its own window; a copier (SDMA / copy engine on a GPU, a
  thread on the CPU) watches the per-(dest, chunk) counters and, once a chunk is complete, copies it
  into ``recv[rank]`` of its owner, then releases the owner's scatter flag.
- ``lsa``: the producer stores each tile straight into ``recv[rank]`` of the owner; the tile that
  completes a chunk releases the owner's scatter flag.

Both signal with the call's ``seq`` (see ``cco.transport.protocol``). A put is always data first,
then its flag, so a receiver that sees the flag sees the data.

:class:`FaultPlan` injects the failures the op must survive: a lost put (data and flag never land)
and a silent engine (flags released, no bytes moved: the trap of a transport built without DMA
support).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, NamedTuple

import torch

from cco import layout
from cco.transport.protocol import Deadline, release


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drop:
    """Lose the put of ``phase`` ("scatter" | "gather") from ``src`` to ``dest`` of chunk ``chunk``
    in call ``seq`` (None matches any)."""

    phase: str = "scatter"
    seq: int | None = None
    src: int | None = None
    dest: int | None = None
    chunk: int | None = None

    def matches(self, *, phase, seq, src, dest, chunk) -> bool:
        return (self.phase == phase and self.seq in (None, seq) and self.src in (None, src)
                and self.dest in (None, dest) and self.chunk in (None, chunk))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Failures to inject into a transport (tests and ``self_test`` demonstrations only)."""

    drops: tuple[Drop, ...] = ()
    silent: bool = False  # release every flag but move no bytes

    def dropped(self, **key) -> bool:
        return any(d.matches(**key) for d in self.drops)


class Transport(abc.ABC):
    """Moves slices between the symmetric windows of one op. One instance per op and rank."""

    name: ClassVar[str]
    producer_stores_remote: ClassVar[bool]  # lsa: tiles go straight into the owner's recv

    def __init__(self, *, config: layout.OpConfig, window, faults: FaultPlan | None = None):
        self.config = config
        self.window = window
        self.rank = window.rank
        self.world = window.world
        self.faults = faults or FaultPlan()
        w = config.window
        self._recv = [window.tensor(w.recv, rank=r) for r in range(self.world)]
        self._partial = window.tensor(w.partial, rank=self.rank)
        self._scatter_flags = [window.words(w.scatter_flags, rank=r) for r in range(self.world)]
        self._scatter_m = [window.words(w.scatter_m, rank=r) for r in range(self.world)]

    # ---- producer side ------------------------------------------------------------------------------
    def set_partial(self, planes: torch.Tensor) -> None:
        """The ``[W, rows, n_slice]`` planes of the own partial region that the next calls' producer
        writes and the scatter reads: the region's dest-major planes (the default), or those of its
        row-major reading by a producer of whole rows (``cco.layout.partial_strides``)."""
        self._partial = planes

    def tile_destination(self, dest: int) -> torch.Tensor:
        """Where the producer stores tiles for ``dest``: ``[m_max_padded, n_slice]`` bf16."""
        if self.producer_stores_remote and dest != self.rank and not self.faults.silent:
            return self._recv[dest][self.rank]
        return self._partial[dest]

    @abc.abstractmethod
    def begin(self, plan: layout.CallPlan, deadline: Deadline) -> None:
        """Start of a call's scatter (before the first tile)."""

    @abc.abstractmethod
    def chunk_complete(self, plan: layout.CallPlan, dest: int, chunk: int) -> None:
        """Called by the producer right after the tile that completed (dest, chunk), dest != rank."""

    @abc.abstractmethod
    def publish_all(self, plan: layout.CallPlan) -> None:
        """Split mode: every counter is already at its target; send everything."""

    @abc.abstractmethod
    def put(self, *, dest: int, copies: list[tuple[torch.Tensor, torch.Tensor]], flag_words: torch.Tensor,
            flag_index: int, seq: int, phase: str, chunk: int, stamp=None) -> None:
        """Copy each ``(src, dst)`` pair (dst in ``dest``'s window), then write ``stamp`` = (words,
        index, value) if given (the all-gather's (seq, M) word of chunk 0), then release
        ``flag_words[flag_index] = seq`` (a word of ``dest``'s window). ``phase``: "scatter" for a
        pattern's first transfers (the GEMM's slices, or the all-gather's input rows), "gather"."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Wait until every put of the call has landed; raise the first transport error."""

    def abort(self) -> None:
        """The call failed: stop waiting for incomplete chunks; puts of complete ones still land
        (peers need this rank's chunk-0 stamp to reach their own verdict). Returns once nothing is
        in flight."""

    def close(self) -> None:
        self.abort()

    # ---- shared helpers -----------------------------------------------------------------------------
    def _send_scatter_chunk(self, plan: layout.CallPlan, dest: int, chunk: int, *, data_in_place: bool) -> None:
        """Put chunk ``chunk`` of ``dest``'s slice into ``recv[rank]`` of dest (unless the producer
        already stored it there) and release its flag.

        Chunk 0 also carries this rank's (seq, m) stamp, checked by the owner before reducing."""
        r0, r1 = plan.rows[chunk]
        copies = [] if data_in_place else [(self._partial[dest][r0:r1], self._recv[dest][self.rank][r0:r1])]
        stamp = None
        if chunk == 0:
            stamp = (self._scatter_m[dest], self.rank, stamp_of_plan(plan))
        # executed inline: dma calls this from its copier, lsa from the producer
        self._execute_put(dest=dest, copies=copies, stamp=stamp, flag_words=self._scatter_flags[dest],
                 flag_index=layout.counter_index(self.rank, chunk), seq=plan.seq, phase="scatter", chunk=chunk)

    def _execute_put(self, *, dest, copies, flag_words, flag_index, seq, phase, chunk, stamp=None) -> None:
        """The data movement itself, with fault injection (both transports end here).

        ``stamp`` = (words, index, value) is signalling metadata written just before the flag (the
        (seq, M) word of chunk 0); a silent engine still writes it, as it still writes flags."""
        if self.faults.dropped(phase=phase, seq=seq, src=self.rank, dest=dest, chunk=chunk):
            return  # a lost put: neither data nor flag arrive
        if not self.faults.silent:
            for src, dst in copies:
                dst.copy_(src)
        if stamp is not None:
            release(*stamp)
        release(flag_words, flag_index, seq)


STAMP_M_BITS = 32  # the word's low half: the call's (tag, M); the high half its seq, modulo STAMP_SEQS
STAMP_SEQS = (1 << 31) - 1  # a stamp's seqs 1 .. STAMP_SEQS (a word of seq 2**31 and up would pass int64: an
# op of 80 layers at 30 steps/s gets there in ~10 days; peers compare stamps of calls a few seqs apart at most,
# so the residue tells them apart; never 0, the seq of a word no call has written)
STAMP_ROW_BITS = layout.MAX_M.bit_length()  # M's bits (build_config refuses an m_max above layout.MAX_M); the tag's above
assert layout.CALL_TAGS << STAMP_ROW_BITS == 1 << STAMP_M_BITS
REJECTED_M = 0  # the M of a (seq, M) stamp that says "this rank rejected its inputs to call seq"


class Stamp(NamedTuple):
    seq: int
    m: int  # the call's rows, or REJECTED_M
    tag: int  # the caller's tag (0: the op called directly; cco.nn layers: their layer_tag)


def stamp_seq_m(seq: int, m: int, tag: int = 0) -> int:
    """One int64 word holding (seq, tag, m), the seq as :func:`stamp_seq` holds it: written and read
    whole, so the triple is never torn.
    ``m`` is a call's rows, or :data:`REJECTED_M` (see :func:`stamp_rejected`). ``tag`` names the
    caller among the users of one op (``cco.nn``'s layers of one family share their op, so their
    calls take seqs of one count: without it, rank 0's call of one layer and rank 1's of another
    would pair). The peers compare the whole word, on the host and on the device alike."""
    assert 0 <= m <= layout.MAX_M and layout.valid_tag(tag)
    return (stamp_seq(seq) << STAMP_M_BITS) | (tag << STAMP_ROW_BITS) | m


def stamp_seq(seq: int) -> int:
    """The seq a stamp of call ``seq`` >= 1 holds, 1 .. :data:`STAMP_SEQS` (``seq`` itself below
    that): compare a stamp's seq with this."""
    return (seq - 1) % STAMP_SEQS + 1 if seq > 0 else seq


def stamp_of_plan(plan: layout.CallPlan) -> int:
    """The (seq, tag, M) stamp of ``plan``'s call."""
    return stamp_seq_m(plan.seq, plan.m, plan.tag)


def stamp_rejected(seq: int) -> int:
    """The stamp a rank publishes for call ``seq`` when it rejected its own inputs: no real call has
    M = 0, so a peer that compares it with its own (seq, M) finds a mismatch and can name it."""
    return stamp_seq_m(seq, REJECTED_M)


def unstamp(word: int) -> Stamp:
    low = word & ((1 << STAMP_M_BITS) - 1)
    return Stamp(word >> STAMP_M_BITS, low & layout.MAX_M, low >> STAMP_ROW_BITS)


def unstamp_seq_m(word: int) -> tuple[int, int]:
    """(seq, M) of a stamp, its tag left out (for words that carry no tag: the watchdog's record)."""
    seq, m, _ = unstamp(word)
    return seq, m


def describe_call(m: int, tag: int) -> str:
    """How an error names a call: its rows and, where a layer made it, the layer's tag."""
    return f"M={m}" + (f" (layer #{tag})" if tag else "")


def mismatch_text(rank: int, own: tuple[int, int], src: int, theirs: tuple[int, int], seq: int) -> str:
    """The error of a call whose (M, tag) ``own`` differs from the (M, tag) ``theirs`` that rank
    ``src`` stamped for the same call ``seq``: other rows, or another layer of the op's family."""
    if own[0] != theirs[0]:
        return (f"rank {rank}: called with {describe_call(*own)} but rank {src} called with "
                f"{describe_call(*theirs)} (call seq {seq}); every rank must pass the same number of rows")
    return (f"rank {rank}: called layer #{own[1]} but rank {src} called layer #{theirs[1]} of the same op (call seq "
            f"{seq}, M={own[0]}): the layers of one shape share their op (cco.nn.WindowPool), and every rank must "
            f"call the same layers in the same order (#0: the op called directly)")
