"""Deadlines for the device-side waits of the CUDA (and HIP) backend, without a host sync per call.

A call's stream waits (``cuStreamWaitValue64`` on flags peers set) and the lsa kernel's spins wait
for words that only a peer writes. A peer that never writes them (it stalled, died, lost a put or
called with another M) would leave the device blocked for good, and every later
``torch.cuda.synchronize()`` with it. NCCL's watchdog aborts the communicator (and by default the
process); torch symmetric memory's signal waits ``trap``, which loses the CUDA context. Here the
blocked work is released and the context stays usable::

    device, per call                      host pinned words          watchdog thread (per op)
    ----------------                      -----------------          ------------------------
    before the first wait: write  ----->  IN_CALL = 1                every poll: IN_CALL set and no
    after the last wait:   write  ----->  IN_CALL = 0, PROGRESS = 1  PROGRESS for deadline_s: stuck

1. Marks (:class:`CallMarks`): stream write-values of constants into pinned host memory, so a
   captured CUDA graph replays them and graph replays are watched like eager calls; the thread
   reads them with plain loads (no CUDA call, no sync). ``PROGRESS`` is cleared by the thread, so
   back-to-back calls that keep ``IN_CALL`` set most of the time still show progress.
2. Release (:meth:`Watchdog.fire`), on streams of its own, in three steps; the first two are
   waited for through a pinned host word that a stream write-value sets once their work ran
   (``LANDED_*``: no event, whose record the driver can hold):
   a. a "failed" record into every peer's header (``FAILED_WORD``: the peers' watchdogs release
      their own calls at once instead of waiting out their deadlines, and their ops fail too),
      waited for up to ``RECORD_WAIT_S`` (a peer that consumes this call's data can see the record
      first; a dead peer's never lands);
   b. the NaN fill, by a worker thread, waited for up to ``POISON_WAIT_S``: the own ``recv``,
      ``gather`` (and ``gather_scale``) regions, the all-gather's input slots and the lsa tile
      flags filled with 0xFF bytes (NaN in bf16 and e4m3; -1 in a flag), so whatever is computed
      from a released wait is NaN, never a stale earlier call's bytes; with memsets, then the same with copies from a pinned host buffer
      (a copy runs on the copy engines while spinning programs hold every multiprocessor, which a
      memset may need);
   c. the release proper, by stream write-values only: this rank's outgoing flags muted
      (``flag_set = 0``: later flag copies carry 0, so no peer takes this call's data as good), the
      peers' stamps in ``scatter_m`` set to ``RELEASED`` (the reduce kernels find them unlike the
      call's and write NaN), every scatter and gather flag set (stream waits pass, the
      epilogue-reduce spin exits), every counter of this rank raised past any target
      (``COUNTER_RELEASED``: a put or reduce that waits for a counter the producer never
      released passes too; its data goes out under a muted flag) and the lsa tile flags of the
      rows the op's lsa calls used set to ``RELEASED`` (not a stamp: the lsa kernel's waits pass,
      and it writes NaN).
   Why write-values: while another host thread copies a stuck call's output to pageable memory
   (``out.cpu()`` before ``check()``), the driver holds every other thread's copies, memsets,
   kernel launches and event records until that copy is done, which is never before the release;
   a stream write-value and an event query still go through (measured on an H200,
   docs/experiments.md, "Faults and deadlines on the GPU"). The fill then goes out late, and the
   host read sees the call's own columns NaN (its reduce) and stale bytes in the peers' columns of
   the dma path: the error, raised by ``check()``, is what marks the output bad.
3. Errors: the op is *failed* from then on (its words are no longer in step with the peers'). The
   next call on it, ``check()`` and every later call raise :class:`CommTimeoutError` (or
   :class:`PeerMismatchError` when a peer's stamp shows another M for the call) naming the rank,
   the call's seq and M, and what each peer had sent. Close the op and build a new one (and a new
   communicator if a rank died): the CUDA context is untouched.

Threads. The deadline's thread reads only the pinned marks and issues the release; its diagnosis
reads (the peers' stamps and flags, for the error) run in a worker bounded by ``DIAGNOSIS_WAIT_S``,
and without them the error names the peers the call waits for and says it could not tell which.
A second thread reads, every poll, this rank's header records and the reduce kernels' status words (device
to host copies on its own stream; a read the driver holds stalls only that thread): a peer's
"failed" record fails this op (and releases a call in flight); a status set by a reduce
(``1 + src`` and the stamp rank src sent: another M, or the rejected stamp) becomes the error the
next call raises after it has taken part in the collective (``raise_deferred``), and ``check()``
raises it after a synchronisation.

Limits. A blocked stream wait holds the hardware queue its stream is mapped to; the release is
issued on ``RELEASE_STREAMS`` streams of their own (at least one lands on a queue no stuck wait
holds, unless work queued behind the stuck call holds every queue of the device:
``CUDA_DEVICE_MAX_CONNECTIONS``). The deadline counts from the device's entry into the call, so a
peer that compiles kernels on its first call for longer than ``deadline_s`` fails the call. While
another thread's pageable copy holds the driver, the diagnosis cannot read the peers' words: with
more than one peer the error names them all, not the one that stalled.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from cco import layout
from cco.cuda.kernels import STATUS_WORDS
from cco.transport.base import (REJECTED_M, STAMP_SEQS, describe_call, mismatch_text, stamp_seq, stamp_seq_m, unstamp,
                                unstamp_seq_m)
from cco.transport.protocol import CommTimeoutError, PeerMismatchError
from cco.transport.reasons import rejected_error

IN_CALL, PROGRESS = 0, 1  # words of CallMarks
# A header word of a GPU window (its SEQ/M/LEFT words are the CPU backend's; GPU peers never read
# them): (seq, rank + 1) of the last call a peer failed (its deadline passed) and released
FAILED_WORD = layout.HEADER_LEFT + 1
RELEASE_STREAMS = 8  # the default CUDA_DEVICE_MAX_CONNECTIONS: one stream per hardware queue
RECORD_WAIT_S = 0.25  # the release's wait for a "failed" record to land in a peer (a live one: us)
POISON_WAIT_S = 0.2  # ... and for the NaN fill to land (it cannot while the driver holds fills)
LANDED_RECORD, LANDED_POISON = 0, 1  # the pinned words the release's steps set once they ran
LEFT_WAIT_S = 1.0  # a released call still in its waits this long after the release is logged
FILL_BYTES = 16 << 20  # the pinned 0xFF buffer the copied NaN fills read, piece by piece
RELEASED = -1  # an lsa tile flag or a peer's stamp set by a release: never a (seq, M) stamp
RELEASED_WORD = RELEASED & ((1 << 64) - 1)  # ... as the unsigned word a stream write-value takes
COUNTER_RELEASED = 1 << 62  # a released counter: past every target (consumed words, zeroed per call)
# The thread polls every deadline_s / 50 within these bounds: a stuck call is released at most 2 %
# (and 50 ms) past its deadline, well inside the 2 s the op promises, and the thread takes the GIL
# at most 500 times a second (each poll is a few plain loads and, while idle, one small async read)
POLL_MIN_S, POLL_MAX_S = 0.002, 0.05
READ_WAIT_S = 1.0  # how long a diagnostic read may take before the release goes ahead without it
DIAGNOSIS_WAIT_S = 1.0  # ... and all of them (with the two waits above the release stays within
# the 2 s past the deadline promised)
SYNC_POLL_S = 0.0002  # sync()'s look at the marks while a replayed call is still in
_WORD = 8

_fill_buffer: torch.Tensor | None = None  # one per process, shared by every op's watchdog
_log = logging.getLogger(__name__)


def _fill_source() -> torch.Tensor:
    """The pinned buffer of 0xFF bytes (made once, before any call can be stuck: a pinned
    allocation inside a stuck call's release could wait on the device)."""
    global _fill_buffer
    if _fill_buffer is None:
        _fill_buffer = torch.full((FILL_BYTES,), 0xFF, dtype=torch.uint8, pin_memory=True)
    return _fill_buffer


def _word_addresses(t: torch.Tensor) -> list[int]:
    """The address of every element of the view ``t`` (no device work: plain arithmetic)."""
    addrs = [t.data_ptr()]
    for size, stride in zip(t.shape, t.stride()):
        addrs = [a + i * stride * t.element_size() for a in addrs for i in range(size)]
    return addrs


class CallMarks:
    """The two pinned host words a call's device work writes (module note, step 1)."""

    def __init__(self):
        self.words = torch.zeros(2, dtype=torch.int64, pin_memory=True)

    def _addr(self, word: int) -> int:
        return self.words.data_ptr() + word * _WORD

    def enter(self, write, stream) -> None:
        """``write(stream, addr, value)`` (the schedule's stream write): before the call's first wait."""
        write(stream, self._addr(IN_CALL), 1)

    def leave(self, write, stream) -> None:
        """After the call's last wait (on a stream that has waited for every other waiting one)."""
        write(stream, self._addr(IN_CALL), 0)
        write(stream, self._addr(PROGRESS), 1)

    def in_call(self) -> bool:
        return bool(int(self.words[IN_CALL]))

    def take_progress(self) -> bool:
        """Whether a call left since the last look (and clear the word)."""
        if int(self.words[PROGRESS]):
            self.words[PROGRESS] = 0
            return True
        return False


def poll_interval(deadline_s: float) -> float:
    return min(POLL_MAX_S, max(POLL_MIN_S, deadline_s / 50))


class Watchdog:
    """The deadline of one op's device-side waits on one rank (see the module note).

    ``window``/``config``: the op's window and layout; ``schedule``: the op's
    ``cco.cuda.dma.CopyEngineSchedule`` (its ``status``, ``stamp`` and ``flag_set`` words, its
    ``reduced`` events, its stream write); ``memops``: the stream memory operations of the device
    (``cco.cuda.memops`` or the HIP one); ``notes``: where rejecting peers leave their reasons."""

    def __init__(self, *, marks: CallMarks, window, config: layout.OpConfig, schedule, memops, deadline_s: float,
                 notes=None):
        self.marks = marks
        self.config = config
        self.schedule = schedule
        self.memops = memops
        self.deadline_s = deadline_s
        self.notes = notes
        self.rank, self.world = window.rank, window.world
        self.device = schedule.status.device
        self.peers = [p for p in layout.dest_order(self.rank, self.world) if p != self.rank]
        w = config.window
        self._header = window.words(w.header, rank=self.rank)
        self._peer_header = {p: window.words(w.header, rank=p) for p in self.peers}
        self._scatter_m = window.words(w.scatter_m, rank=self.rank)
        self._flags = [window.words(w.scatter_flags, rank=self.rank), window.words(w.gather_flags, rank=self.rank)]
        self._counters = window.words(w.counters, rank=self.rank)
        # what a released call may still read as data (the all-gather's input slots too; a region a
        # pattern does not use is empty and filled with nothing)
        self._poison = [window.tensor(r, rank=self.rank) for r in (w.recv, w.gather, w.gather_scale, w.a_rows,
                                                                   w.a_scales)]
        self._tile_flags = window.tensor(w.tile_flags, rank=self.rank)
        self._copy_host = getattr(memops, "copy_host", memops.copy)  # HIP names its host copies apart
        # Everything the release and the reads use is made now: a pinned allocation while a call is
        # stuck could be ordered behind the stuck work
        self._fill = _fill_source()
        self._streams = self._make_streams()  # the NaN fill by copies (step 2b), the reads
        self._set_streams = self._make_streams()  # the NaN fill by memsets (module note, step 2b)
        self._write_streams = self._make_streams()  # the release proper (step 2c)
        self._remote = self._make_streams()  # the peer records: a write to a dead peer may never land
        self._landed = torch.zeros(2, dtype=torch.int64, pin_memory=True)  # LANDED_*: the round seen to run
        self._poisoner: threading.Thread | None = None  # the NaN fill of the last release
        words = max(self.world * layout.MAX_CHUNKS, layout.HEADER_WORDS, STATUS_WORDS, self._tile_flags.numel())
        self._scratch = [torch.zeros(words, dtype=torch.int64, pin_memory=True) for _ in self._streams]
        self._scratch_events = [torch.cuda.Event() for _ in self._streams]
        self._read_lock = threading.Lock()
        # the monitor's reads (header records and the reduce status), one buffer per stream: a read
        # left pending on a held queue may land late, into its own buffer only
        self._seen = [torch.zeros(layout.HEADER_WORDS + STATUS_WORDS, dtype=torch.int64, pin_memory=True)
                      for _ in self._streams]
        self._seen_event = torch.cuda.Event()
        self._seen_stream = 0
        self._seen_since = None  # when the pending monitor read was issued (None: none pending)
        self._seen_valid = True  # the pending read was issued after the last status clear had run
        self._seen_gen = 0  # ... and after which clear (a read from before a later clear is stale)
        self._clear_gen = 0
        self._clear_event = None  # recorded after the last status clear (raise_failed, check)
        self._handled = {FAILED_WORD: 0}
        self.error: Exception | None = None  # the op failed: every later call raises this
        self.deferred: Exception | None = None  # raised by the next call, after it took part
        self.releases = 0  # release rounds so far (a graph of a failed op replayed again gets one too)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # two threads: the deadline's makes no call that can wait on the device or on another thread's
        # copy (module note, "Threads"); the reader's reads may, and it only reads
        self._thread = threading.Thread(target=self._run, name=f"cco-watchdog-rank{self.rank}", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"cco-watchdog-reads-rank{self.rank}",
                                        daemon=True)
        self._thread.start()
        self._reader.start()

    def _make_streams(self) -> list[int]:
        create = getattr(self.memops, "stream_create", None)
        if create is not None:
            return [create() for _ in range(RELEASE_STREAMS)]
        with torch.cuda.device(self.device):
            _, high = torch.cuda.Stream.priority_range()
            streams = [torch.cuda.Stream(device=self.device, priority=high) for _ in range(RELEASE_STREAMS)]
        self._torch_streams = getattr(self, "_torch_streams", []) + streams  # kept alive
        return [s.cuda_stream for s in streams]

    def _external(self, handle: int):
        return torch.cuda.ExternalStream(handle, device=self.device)

    @property
    def plan(self):
        """The last call issued (its seq and M name the call in errors)."""
        return getattr(self.schedule, "plan", None)

    # ---- the threads --------------------------------------------------------------------------------
    def _enter_thread(self) -> None:
        torch.cuda.set_device(self.device)  # the driver calls below need the device's context here
        relax = getattr(self.memops, "relax_capture_mode", None)
        if relax is not None:  # the op's thread may be capturing a graph while this one polls
            relax()

    def _read_loop(self) -> None:
        self._enter_thread()
        poll = poll_interval(self.deadline_s)
        while not self._stop.wait(poll):
            try:
                self._monitor()
            except Exception as err:  # log and keep reading
                _log.warning("rank %d: the op's watchdog reads: %s: %s", self.rank, type(err).__name__, err)

    def _run(self) -> None:
        self._enter_thread()
        poll = poll_interval(self.deadline_s)
        quiet_since = time.monotonic()  # last time the device was seen outside a call or leaving one
        released_at = None  # a release whose call has not been seen leaving yet
        while not self._stop.wait(poll):
            try:
                now = time.monotonic()
                if self.marks.take_progress() or not self.marks.in_call():
                    quiet_since = now
                    released_at = None
                if released_at is not None and now - released_at > LEFT_WAIT_S:
                    _log.warning("rank %d: the call released %.1f s ago is still in its waits: %s", self.rank,
                                 now - released_at, self._progress())
                    released_at = None
                if now - quiet_since > self.deadline_s:
                    # stuck: fail the op (first time) and release; a failed op's graph replayed
                    # again gets stuck again and released again, a deadline later
                    self.fire(self._diagnosed(now - quiet_since) if self.error is None else None)
                    quiet_since = released_at = time.monotonic()
            except Exception as err:  # log and keep watching: a dead thread would leave a stuck call stuck
                _log.warning("rank %d: the op's watchdog: %s: %s", self.rank, type(err).__name__, err)

    def _monitor(self) -> None:
        """Read this rank's header records and the reduce status (asynchronously: one read in
        flight, a fresh stream if it stays pending past READ_WAIT_S) and act on what changed."""
        if self._seen_since is not None:
            if not self._seen_event.query():
                if time.monotonic() - self._seen_since < READ_WAIT_S:
                    return
                self._seen_stream = (self._seen_stream + 1) % len(self._streams)  # a queue held by a wait
            else:
                self._act_on(self._seen[self._seen_stream].tolist(),
                             status_valid=self._seen_valid and self._seen_gen == self._clear_gen)
        s, buf = self._streams[self._seen_stream], self._seen[self._seen_stream]
        clear = self._clear_event
        self._seen_gen = self._clear_gen
        self._seen_valid = clear is None or clear.query()
        self._copy_host(s, buf.data_ptr(), self._header.data_ptr(), layout.HEADER_WORDS * _WORD)
        self._copy_host(s, buf.data_ptr() + layout.HEADER_WORDS * _WORD, self.schedule.status.data_ptr(),
                        STATUS_WORDS * _WORD)
        self._seen_event.record(self._external(s))
        self._seen_since = time.monotonic()

    def _act_on(self, seen: list[int], *, status_valid: bool) -> None:
        """``seen``: this rank's header words, then the status words."""
        failed = seen[FAILED_WORD]
        if failed and failed != self._handled[FAILED_WORD] and self.error is None:
            self._handled[FAILED_WORD] = failed
            seq, peer = unstamp_seq_m(failed)
            self.fire(CommTimeoutError(
                f"rank {self.rank}: rank {peer - 1} passed its deadline in call seq {seq} and released its waits; "
                f"the op is failed on every rank (this rank was in {self._call_name()})"))
        status, stamp = seen[layout.HEADER_WORDS:layout.HEADER_WORDS + 2]
        if status and status_valid and self.deferred is None and self.error is None:
            err = self._status_error(status, stamp)
            with self._lock:
                if self.deferred is None:
                    self.deferred = err

    # ---- errors -------------------------------------------------------------------------------------
    def _call_name(self) -> str:
        plan = self.plan
        return "the call in flight" if plan is None else f"call seq {plan.seq} ({describe_call(plan.m, plan.tag)})"

    def _status_error(self, status: int, stamp: int) -> Exception:
        """The error of a call whose reduce found rank ``status - 1``'s (seq, M) ``stamp`` unlike its own."""
        src = status - 1
        seq, m, tag = unstamp(stamp)
        plan = self.plan
        if plan is not None and stamp_seq(plan.seq) == seq:
            seq = plan.seq  # (a stamp holds the seq modulo STAMP_SEQS; the rejection's note is under the whole one)
        if m == REJECTED_M:
            return rejected_error(self.notes, rank=self.rank, src=src, seq=seq, output=" and its output is NaN")
        if plan is not None and plan.seq == seq:
            text = mismatch_text(self.rank, (plan.m, plan.tag), src, (m, tag), seq)
        else:
            text = (f"rank {self.rank}: rank {src} called with {describe_call(m, tag)} in call seq {seq}, this rank "
                    f"with another M or layer: every rank must call the same layers with the same M, in the same order")
        return PeerMismatchError(f"{text}; the call's output is NaN (the next call works)")

    def _diagnosed(self, waited: float) -> Exception:
        """:meth:`_timeout_error`, or a plain one if the diagnosis fails or does not end within
        DIAGNOSIS_WAIT_S (its reads are copies, which another thread's copy to pageable host memory
        can hold in the driver: the release must go on without them)."""
        found: list = []

        def diagnose():
            try:
                self._enter_thread()  # its copies need the device's context current in this thread
                found.append(self._timeout_error(waited))
            except Exception as err:
                found.append(f"{type(err).__name__}: {err}")

        worker = threading.Thread(target=diagnose, name=f"cco-watchdog-diagnosis-rank{self.rank}", daemon=True)
        worker.start()
        worker.join(DIAGNOSIS_WAIT_S)
        if found and isinstance(found[0], Exception):
            return found[0]
        why = found[0] if found else (f"its reads did not return within {DIAGNOSIS_WAIT_S:g} s: another thread's "
                                      f"copy to pageable host memory, such as out.cpu(), holds them")
        senders = ", ".join(f"rank {p}" for p in self.peers)
        return CommTimeoutError(f"rank {self.rank}: {self._call_name()} did not finish within deadline_s="
                                f"{self.deadline_s:g} s (waited {waited:.1f} s): it waits for what {senders} "
                                f"send{'s' if len(self.peers) == 1 else ''}{self._stuck_chunk()}; one that has "
                                f"not sent it has not started the call, stalled, died or lost a put (not read "
                                f"which: {why})")

    def _timeout_error(self, waited: float) -> Exception:
        """Diagnose the stuck call from what the peers sent (read before the release): their (seq, M)
        stamps, the flags of theirs not yet consumed here, a stamp a reduce found unlike its own."""
        own = self._read_words(self.schedule.stamp)
        seq, m, tag = unstamp(own[0]) if own is not None else (None, None, 0)
        call = f"call seq {seq} ({describe_call(m, tag)})" if seq is not None else self._call_name()
        lsa = getattr(self.schedule, "path", None) == "lsa"
        details, mismatch = [], None
        status = self._read_words(self.schedule.status)
        if status is not None and status[0]:
            p_seq, p_m, p_tag = unstamp(status[1])
            mismatch = (f"rank {status[0] - 1} called with {describe_call(p_m, p_tag)} in call seq {p_seq}, this rank "
                        f"with {describe_call(m, tag)}")
        if lsa:  # the lsa kernel's words: per-tile flags holding the sender's stamp until consumed
            planes = self._read_words(self._tile_flags)
            n = self._tile_flags[0, 0].numel()
            for p in self.peers:
                if planes is None:
                    details.append(f"rank {p}: its tile flags could not be read")
                    continue
                scatter, gather = planes[p * n:(p + 1) * n], planes[(self.world + p) * n:(self.world + p + 1) * n]
                sent = [v for v in scatter + gather if v]
                stamps = {unstamp(v) for v in sent}
                other = [(ps, describe_call(pm, pt)) for ps, pm, pt in stamps if (ps, pm, pt) != (seq, m, tag)]
                if other and mismatch is None:
                    mismatch = f"rank {p} sent tiles stamped (seq, M) = {sorted(other)}, this rank is in {call}"
                details.append(f"rank {p}: {len(sent)} of its tiles wait unconsumed here (none: it has not sent "
                               f"what this rank's kernel waits for: not started, stalled, dead or lost)")
        else:
            stamps = self._read_words(self._scatter_m)
            flags = [self._read_words(f) for f in self._flags]
            for p in self.peers:
                if stamps is None:
                    details.append(f"rank {p}: its stamps could not be read")
                    continue
                p_seq, p_m, p_tag = unstamp(stamps[p])
                if seq is not None and 0 < (seq - p_seq) % STAMP_SEQS < STAMP_SEQS // 2:  # (seqs modulo STAMP_SEQS)
                    details.append(f"rank {p} sent nothing of call seq {seq} (its last stamp is for seq {p_seq}: it "
                                   f"has not started the call, stalled or died)")
                    continue
                if p_seq == seq and p_m != REJECTED_M and (p_m, p_tag) != (m, tag) and mismatch is None:
                    mismatch = (f"rank {p} called with {describe_call(p_m, p_tag)}, this rank with "
                                f"{describe_call(m, tag)} (call seq {seq})")
                line = f"rank {p} started call seq {p_seq}"
                if flags[0] is not None and flags[1] is not None:
                    chunks = len(self.plan.rows) if self.plan is not None else layout.MAX_CHUNKS
                    row = slice(p * layout.MAX_CHUNKS, p * layout.MAX_CHUNKS + chunks)
                    line += (f"; its chunk flags not yet consumed here (1): scatter {flags[0][row]}, gather "
                             f"{flags[1][row]}{self._stuck_chunk()}")
                details.append(line)
        what = (f"rank {self.rank}: {call} did not finish within deadline_s={self.deadline_s:g} s (waited "
                f"{waited:.1f} s): " + "; ".join(details))
        if mismatch is not None:
            return PeerMismatchError(f"{what}. {mismatch}: every rank must call with the same M")
        return CommTimeoutError(what)

    def _progress(self) -> str:
        """Which of the schedule's streams of the call in flight have finished (for the log)."""
        sch = self.schedule
        if getattr(sch, "path", None) != "dma" or self.plan is None:
            return f"path {getattr(sch, 'path', None)}"
        done = {name: event.query() for name, event in (("reduced", sch.reduced[len(self.plan.rows) - 1]),
                                                          ("begun", sch.begin_event))}
        streams = {f"side stream {i}": e.query() for i, e in enumerate(getattr(sch, "done", {}).values())}
        return f"{done}, {streams}"

    def _stuck_chunk(self) -> str:
        plan = self.plan
        sch = self.schedule
        if plan is None or getattr(sch, "path", None) != "dma" or not getattr(sch, "chunk_events", False):
            return ""  # an lsa call, or a replayed one (its events are not the host's)
        for c in range(len(plan.rows)):
            if not sch.reduced[c].query():
                return f"; this rank's reduce waits at chunk {c}"
        return "; this rank's reduces are done: its assemble waits for gathers"

    def _read_words(self, words: torch.Tensor) -> list[int] | None:
        """A device word region read to the host on the first release stream that runs it within
        READ_WAIT_S (None if none does: the diagnosis then goes without it)."""
        n = words.numel()
        with self._read_lock:
            for s, buf, event in zip(self._streams, self._scratch, self._scratch_events):
                self._copy_host(s, buf.data_ptr(), words.data_ptr(), n * _WORD)
                event.record(self._external(s))
            until = time.monotonic() + READ_WAIT_S
            while time.monotonic() < until:
                for buf, event in zip(self._scratch, self._scratch_events):
                    if event.query():
                        return buf[:n].tolist()
                time.sleep(0.001)
        return None

    # ---- the release --------------------------------------------------------------------------------
    def fire(self, error: Exception | None) -> None:
        """Fail the op with ``error`` (the first error stays the op's) and release every device-side
        wait it may have (module note, step 2)."""
        with self._lock:
            if self.error is None:
                self.error = error
            self.releases += 1
            mark = self.releases
            seq = self.plan.seq if self.plan is not None else 0
            record = stamp_seq_m(seq, self.rank + 1)
            for s in self._remote:  # a: the same writes on every stream
                for p in self.peers:
                    try:  # the driver refuses a write into the window of a peer whose process is gone
                        self.memops.write(s, self._peer_header[p].data_ptr() + FAILED_WORD * _WORD, record)
                    except RuntimeError as err:
                        _log.warning("rank %d: no failed record for rank %d: %s", self.rank, p, err)
                self._land(s, LANDED_RECORD, mark)
            self._await_landed(LANDED_RECORD, mark, RECORD_WAIT_S)
            if self._poisoner is None or not self._poisoner.is_alive():  # b (one held by the driver still goes)
                self._poisoner = threading.Thread(target=self._fill_nan, args=(mark,), daemon=True,
                                                  name=f"cco-watchdog-fill-rank{self.rank}")
                self._poisoner.start()
            if not self._await_landed(LANDED_POISON, mark, POISON_WAIT_S):
                _log.warning("rank %d: the NaN fill did not land within %g s: released without it", self.rank,
                             POISON_WAIT_S)
            words = self._release_words()  # c
            for s in self._write_streams:
                try:
                    for addr, value in words:
                        self.memops.write(s, addr, value)
                except RuntimeError as err:  # a stream the driver refuses: the others still go
                    _log.warning("rank %d: the release: %s", self.rank, err)

    def _release_words(self) -> list[tuple[int, int]]:
        """(address, value) of step 2c's write-values, in their order."""
        words = [(self.schedule.flag_set.data_ptr(), 0)]
        words += [(self._scatter_m.data_ptr() + p * _WORD, RELEASED_WORD) for p in self.peers]
        words += [(flags.data_ptr() + i * _WORD, 1) for flags in self._flags for i in range(flags.numel())]
        words += [(self._counters.data_ptr() + i * _WORD, COUNTER_RELEASED) for i in range(self._counters.numel())]
        tiles = self._tile_flags
        if tiles.numel():  # the m-tiles of the most rows an lsa call of the op had
            used = tiles[:, :, :-(-getattr(self.schedule, "lsa_rows", 0) // self.config.block_m)]
            words += [(addr, RELEASED_WORD) for addr in _word_addresses(used)]
        return words

    def _land(self, stream: int, word: int, mark: int) -> None:
        try:  # a refusal must not stop the release: its wait then just runs out
            self.memops.write(stream, self._landed.data_ptr() + word * _WORD, mark)
        except RuntimeError as err:
            _log.warning("rank %d: the release's landing mark: %s", self.rank, err)

    def _await_landed(self, word: int, mark: int, wait_s: float) -> bool:
        """Whether a stream's write of ``mark`` into the pinned word ``word`` showed within ``wait_s``
        (plain loads: no driver call)."""
        until = time.monotonic() + wait_s
        while int(self._landed[word]) < mark:
            if time.monotonic() >= until:
                return False
            time.sleep(0.001)
        return True

    def _fill_nan(self, mark: int) -> None:
        """Step 2b, on a thread of its own (the driver may hold its fills until the release is done)."""
        try:
            self._enter_thread()
        except Exception as err:
            _log.warning("rank %d: the NaN fill: %s: %s", self.rank, type(err).__name__, err)
            return
        for streams, by_copy in ((self._set_streams, False), (self._streams, True)):
            try:
                for s in streams:
                    for region in self._poison + [self._tile_flags]:
                        self._fill_region(s, region, by_copy)
                    self._land(s, LANDED_POISON, mark)
            except RuntimeError as err:  # one way refused: the other still goes out
                _log.warning("rank %d: the NaN fill by %s: %s", self.rank, "copies" if by_copy else "memsets", err)

    def _fill_region(self, stream: int, region: torch.Tensor, by_copy: bool) -> None:
        start, nbytes = region.data_ptr(), region.numel() * region.element_size()
        if not by_copy:
            self.memops.fill(stream, start, 0xFF, nbytes)
            return
        for off in range(0, nbytes, FILL_BYTES):
            self._copy_host(stream, start + off, self._fill.data_ptr(), min(FILL_BYTES, nbytes - off))

    # ---- what the op raises -------------------------------------------------------------------------
    def failed_error(self) -> Exception | None:
        """The op's failure as a fresh exception (raised again by every later call), or None."""
        err = self.error
        if err is None:
            return None
        fresh = type(err)(f"{err}. The op is failed: close it and build a new GemmAllReduceOp on every rank (and "
                          f"a new Communicator if a rank died); its output of that call is NaN")
        return fresh

    def take_deferred(self) -> Exception | None:
        """The recorded status error, once; the status word is cleared in stream order on the
        current stream (after every call issued so far), so the monitor sees only later ones."""
        with self._lock:
            err, self.deferred = self.deferred, None
        if err is not None and not torch.cuda.is_current_stream_capturing():  # else it is raised again later
            self._clear()
        return err

    def _clear(self) -> None:
        self.schedule.status.zero_()
        event = torch.cuda.Event()
        event.record()
        self._clear_event = event
        self._clear_gen += 1

    def clear_status(self) -> None:
        """Clear the status word (in stream order on the current stream) and forget what the monitor
        read of it so far: a call this rank ran knowing its stamp differs (a rejected call)."""
        with self._lock:
            self.deferred = None
        self._clear()

    def check(self) -> None:
        """After a device synchronisation: raise what the calls so far recorded (the op's failure,
        a peer's failure record, a status set by a reduce), and clear the status word."""
        err = self.failed_error()
        if err is None:
            seen = self._read_words(self._header) or [0] * layout.HEADER_WORDS
            status = self._read_words(self.schedule.status) or [0] * STATUS_WORDS
            self._act_on(seen + status, status_valid=True)
            err = self.failed_error() or self.take_deferred()
        self.sync()
        if err is not None:
            raise err

    def sync(self) -> None:
        """Wait for the op's calls (joined into the stream they were issued on) and the local
        release work. Never the whole device: a "failed" record written into a dead peer's window
        need never complete. A replay of a captured call runs on whatever stream the caller
        replays it on, which the op never sees (the stream of the last call issued is the
        capture's): so also wait for the caller's current stream (a replay on it may not have
        entered yet, and its marks would say no call is in), then until the marks show the call
        left, which the thread's release bounds by the deadline (then the wait gives up, bounded
        too). A replay on another stream: synchronize that stream before ``check()``."""
        main = getattr(self.schedule, "main", None)
        if main is not None:
            main.synchronize()
        self._caller_stream().synchronize()
        until = time.monotonic() + self.deadline_s + LEFT_WAIT_S + poll_interval(self.deadline_s)
        while self.marks.in_call() and time.monotonic() < until:
            time.sleep(SYNC_POLL_S)
        for s in self._write_streams + self._set_streams + self._streams:
            self._external(s).synchronize()

    def _caller_stream(self):
        return torch.cuda.current_stream(self.device)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._reader.join(READ_WAIT_S)  # a read held in the driver must not hold close() too
        if self._poisoner is not None:  # its fills write the window: done before the window goes
            self._poisoner.join(READ_WAIT_S)
            if self._poisoner.is_alive():
                _log.error("rank %d: the NaN fill of the op's last release is still held by the driver", self.rank)
        destroy = getattr(self.memops, "stream_destroy", None)
        if destroy is not None:
            for s in self._streams + self._set_streams + self._write_streams + self._remote:
                destroy(s)
        self._streams = self._set_streams = self._write_streams = self._remote = []
