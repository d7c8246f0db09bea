"""CPU backend: the reference tile kernel plus the CPU transports over shared-memory windows.

Same protocol, regions and walk order as the GPU backends (see ``cco.backends.base``), so it is the
executable specification of the op; every rank is a process and every put a real copy between
process memories.
"""

from __future__ import annotations

import os

import torch

from cco import layout
from cco.backends.base import Backend, row_major_readings
from cco.preshuffle import unshuffle_b
from cco.quant import dequantize_a, dequantize_b, dequantize_gather, quantize_gather
from cco.transport import transport_class
from cco.transport.base import REJECTED_M, mismatch_text, stamp_of_plan, stamp_rejected, stamp_seq, unstamp
from cco.transport.protocol import CommTimeoutError, Deadline, PeerMismatchError, release, wait_at_least
from cco.transport.reasons import post_rejection, rejected_error
from kernels_fused.cpu.tiles import dequantized_operands, run_arriving_tiles, run_chunks, run_tiles

# A call waits this many deadlines for a peer to leave the previous call: the peer entered that call
# before this rank finished it, so it leaves within its own deadline plus its error-path wait.
PREVIOUS_CALL_DEADLINES = 2
HEADER_PID = layout.HEADER_LEFT + 1  # CPU backend: the rank's process id, for its peers' liveness checks


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie has exited; it only waits for its
    parent to collect it). The ranks of a CPU window share the host: they map the same files."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class CpuBackend(Backend):
    name = "cpu"
    block_m = layout.DEFAULT_BLOCK_M
    block_n = None  # layout picks the widest tile that divides N/world
    # fused / split calls on the dma transport produce whole chunks of rows into the partial region
    # read row-major (kernels_fused.cpu.tiles.run_chunks): the CUDA backend's vendor producer, modelled
    chunk_producer = False
    patterns = tuple(layout.PATTERNS)

    @classmethod
    def supports_device(cls, device):
        return None if torch.device(device).type == "cpu" else f"CpuBackend runs on cpu, not {device}"

    def __init__(self, **kw):
        super().__init__(**kw)
        cfg, win, rank = self.config, self.window, self.window.rank
        self.rank, self.world = rank, win.world
        name = "dma" if cfg.transport == "auto" else cfg.transport  # nothing to pick between on the CPU
        self.transport = transport_class(name)(config=cfg, window=win, faults=self.faults)
        w = cfg.window
        self._header = win.words(w.header, rank=rank)
        self._peer_header = [win.words(w.header, rank=r) for r in range(self.world)]
        self._counters = win.words(w.counters, rank=rank)
        self._scatter_flags = win.words(w.scatter_flags, rank=rank)
        self._scatter_m = win.words(w.scatter_m, rank=rank)
        self._peer_scatter_m = [win.words(w.scatter_m, rank=r) for r in range(self.world)]
        self._peer_scatter_flags = [win.words(w.scatter_flags, rank=r) for r in range(self.world)]
        self._gather_flags = [win.words(w.gather_flags, rank=r) for r in range(self.world)]
        self._partial = self._dest_major = win.tensor(w.partial, rank=rank)
        self._rows = self._by_rows = None
        if cfg.pattern == "all-reduce":  # the chunk producer's reading: whole rows of [M, N]
            self._rows, self._by_rows = row_major_readings(self._dest_major, cfg)
        self._a_rows = [win.tensor(w.a_rows, rank=r) for r in range(self.world)]
        self._a_scales = [win.tensor(w.a_scales, rank=r) for r in range(self.world)]
        self._recv = win.tensor(w.recv, rank=rank)
        self._gather = [win.tensor(w.gather, rank=r) for r in range(self.world)]
        self._gather_scale = [win.tensor(w.gather_scale, rank=r) for r in range(self.world)]
        self._header[HEADER_PID] = os.getpid()

    # ---- modes --------------------------------------------------------------------------------------
    def gemm(self, a, b_pre, a_scale, b_scale, *, out, plan):
        a_f, b_f = dequantized_operands(a, b_pre, a_scale, b_scale, self.config.quant)
        ns = self.config.n_slice

        def destination(dest):  # dest's slice of the [M, N] product
            row, col = plan.origins[dest]
            return out[row:row + plan.slice_m, col:col + ns]

        run_tiles(a_f, b_f, config=self.config, plan=plan, destination=destination)

    def fused(self, a, b_pre, a_scale, b_scale, *, out, plan):
        a_f, b_f = dequantized_operands(a, b_pre, a_scale, b_scale, self.config.quant)
        by_rows = self._use_partial(by_rows=self._chunk_producer_runs())

        def steps(deadline):
            self.transport.begin(plan, deadline)
            complete = lambda dest, chunk: self.transport.chunk_complete(plan, dest, chunk)  # noqa: E731
            if by_rows:
                run_chunks(a_f, b_f, config=self.config, plan=plan, partial_rows=self._rows, counters=self._counters,
                           on_chunk_complete=complete)
            else:
                run_tiles(a_f, b_f, config=self.config, plan=plan, destination=self.transport.tile_destination,
                          counters=self._counters, on_chunk_complete=complete)
            self._after_scatter(plan, out, deadline)

        self._run_call(plan, steps)

    def split(self, a, b_pre, a_scale, b_scale, *, out, plan):
        a_f, b_f = dequantized_operands(a, b_pre, a_scale, b_scale, self.config.quant)
        by_rows = self._use_partial(by_rows=self._chunk_producer_runs())

        def steps(deadline):
            if by_rows:
                run_chunks(a_f, b_f, config=self.config, plan=plan, partial_rows=self._rows, counters=self._counters)
            else:
                run_tiles(a_f, b_f, config=self.config, plan=plan, destination=lambda dest: self._partial[dest],
                          counters=self._counters)
            self._communicate(plan, out, deadline)

        self._run_call(plan, steps)

    def _chunk_producer_runs(self) -> bool:
        """Whether this call's producer is the one of whole rows: asked for, on the dma transport, in
        the all-reduce (its row-major reading of the partial region is [M, N])."""
        return self.chunk_producer and self.config.transport != "lsa" and self.config.pattern == "all-reduce"

    def _use_partial(self, *, by_rows: bool) -> bool:
        """The partial region's planes this call's producer writes and the transfers read: the
        dest-major ones, or (``by_rows``) those of its row-major reading (``layout.partial_strides``)."""
        self._partial = self._by_rows if by_rows else self._dest_major
        self.transport.set_partial(self._partial)
        return by_rows

    def all_reduce_window(self, *, out, plan):
        self._use_partial(by_rows=False)  # the self test fills the dest-major planes

        def steps(deadline):
            for dest in range(self.world):
                for chunk in range(plan.chunks):
                    release(self._counters, layout.counter_index(dest, chunk), plan.target(dest, chunk))
            self._communicate(plan, out, deadline)

        self._run_call(plan, steps)

    # ---- all-gather ---------------------------------------------------------------------------------
    def all_gather_gemm(self, a, b_pre, a_scale, b_scale, *, out, plan, gathered=None):
        cfg, rank = self.config, self.rank
        b_f = dequantize_b(unshuffle_b(b_pre), b_scale, cfg.quant)
        fused = cfg.mode == "fused"

        def rows_of(src, chunk, deadline):
            r0, r1 = plan.rows[chunk]
            if src != rank and fused:  # split waited for every chunk before the GEMM
                self._arrival(plan, src, chunk, deadline)
            return dequantize_a(self._a_rows[rank][src][r0:r1], self._scale_rows(self._a_scales[rank][src], r0, r1),
                                cfg.quant)

        def steps(deadline):
            self.transport.begin(plan, deadline)
            own_rows, own_scales = self._a_rows[rank][rank], self._a_scales[rank][rank]
            own_rows[:plan.m] = a  # local memory: the slot the GEMM and the puts read
            self._scale_rows(own_scales, 0, plan.m).copy_(a_scale)
            self._put_inputs(plan)
            if not fused:
                self._wait_inputs(plan, deadline)
            run_arriving_tiles(lambda src, chunk: rows_of(src, chunk, deadline), b_f, config=cfg, plan=plan, out=out)
            self._finish_together(plan, deadline)
            if gathered is not None:
                self._assemble_inputs(plan, *gathered)

        self._run_call(plan, steps)

    def gather_inputs_window(self, *, plan):
        def steps(deadline):
            self.transport.begin(plan, deadline)
            self._put_inputs(plan)
            self._wait_inputs(plan, deadline)
            self._finish_together(plan, deadline)

        self._run_call(plan, steps)

    def _put_inputs(self, plan) -> None:
        """Put the own slot's rows, chunk by chunk, into ``a_rows[rank]`` / ``a_scales[rank]`` of every
        peer (next rank first), each chunk's flag after its data, chunk 0's (seq, M) stamp before it."""
        rank = self.rank
        rows, scales = self._a_rows[rank][rank], self._a_scales[rank][rank]
        for chunk in range(plan.chunks):
            r0, r1 = plan.rows[chunk]
            for dest in layout.dest_order(rank, self.world)[:-1]:
                copies = [(rows[r0:r1], self._a_rows[dest][rank][r0:r1]),
                          (self._scale_rows(scales, r0, r1), self._scale_rows(self._a_scales[dest][rank], r0, r1))]
                stamp = (self._peer_scatter_m[dest], rank, stamp_of_plan(plan)) if chunk == 0 else None
                self.transport.put(dest=dest, copies=copies, flag_words=self._peer_scatter_flags[dest],
                                   flag_index=layout.counter_index(rank, chunk), seq=plan.seq, phase="scatter",
                                   chunk=chunk, stamp=stamp)

    def _arrival(self, plan, src, chunk, deadline) -> None:
        """Wait for chunk ``chunk`` of ``src``'s input rows; on chunk 0 check its (seq, M) stamp."""
        self._wait_flag(self._scatter_flags, layout.counter_index(src, chunk), plan, deadline,
                        what=f"rank {self.rank}: input rows of chunk {chunk} from rank {src}, seq {plan.seq}")
        if chunk == 0:
            self._check_peer_m(src, plan)

    def _wait_inputs(self, plan, deadline) -> None:
        for chunk in range(plan.chunks):
            for src in layout.input_order(self.rank, self.world)[1:]:
                self._arrival(plan, src, chunk, deadline)

    def _assemble_inputs(self, plan, a_all, scale_all) -> None:
        """The gathered input, ``[W * m, K]`` and its scales in ``a_scale``'s layout, from the slots."""
        m = plan.m
        for src in range(self.world):
            a_all[src * m:(src + 1) * m] = self._a_rows[self.rank][src][:m]
            scale_all[src * m:(src + 1) * m] = self._scale_rows(self._a_scales[self.rank][src], 0, m)

    def reject(self, *, seq, error, plan_for):
        """Take part in call ``seq`` with inputs this rank rejected: enter it like any call, publish
        the rejected stamp and the chunk-0 scatter flag to every peer (all a peer reads before it
        checks the stamp), leave it. Peers raise :class:`PeerRejectedError`; nothing else of the
        call is read by anyone, and the next call's flags (``>= seq + 1``) never match these."""
        try:
            self._enter(seq, REJECTED_M)
        except CommTimeoutError as late:  # a peer is still in the previous call: it will time out
            error.add_note(f"{late}; the peers were not told of the rejection and time out this call")
            self._leave_failed(seq, error)
            return
        post_rejection(self.notes, seq=seq, rank=self.rank, error=error)
        flag = layout.counter_index(self.rank, 0)
        for peer in layout.dest_order(self.rank, self.world)[:-1]:
            release(self._peer_scatter_m[peer], self.rank, stamp_rejected(seq))
            release(self._peer_scatter_flags[peer], flag, seq)
        self._leave_failed(seq, error)

    def close(self):
        self.transport.close()

    # ---- call lifecycle -----------------------------------------------------------------------------
    def _run_call(self, plan, steps) -> None:
        """One collective call: enter (wait for every peer to have left the previous call), run
        ``steps(deadline)``, leave (``header[LEFT] = seq``). A failed call leaves too, but only
        after every peer that entered it has left it as well (bounded): see ``cco.op``, "Recovery"."""
        try:
            self._enter(plan.seq, plan.m)
            steps(Deadline(self.deadline_s))  # the call's deadline starts once every peer is in reach
        except BaseException as err:
            self.transport.abort()  # nothing of this call is in flight from here on
            if isinstance(err, CommTimeoutError):
                for peer in layout.dest_order(self.rank, self.world)[:-1]:
                    if self._peer_gone(peer):
                        err.add_note(f"rank {self.rank}: rank {peer}'s process has exited")
            self._leave_failed(plan.seq, err)
            raise
        self._header[layout.HEADER_LEFT] = plan.seq

    def _peer_gone(self, peer: int) -> bool:
        """Whether ``peer``'s process has exited (it published its process id at construction)."""
        pid = int(self._peer_header[peer][HEADER_PID])
        return pid > 0 and not process_alive(pid)

    def _enter(self, seq: int, m: int) -> None:
        """Wait until every peer has left call ``seq - 1``, then stamp ``header = (seq, m)``.

        Nothing of call ``seq`` is published before this returns, so a slow peer still reading call
        ``seq - 1`` (a failing one may be reading our chunk-0 stamp, a successful one its gathers)
        never sees it overwritten. A peer still in that call leaves it within its own deadline plus
        its error-path wait, hence ``PREVIOUS_CALL_DEADLINES`` deadlines here."""
        if seq > 1:
            entry = Deadline(PREVIOUS_CALL_DEADLINES * self.deadline_s)
            for peer in layout.dest_order(self.rank, self.world)[:-1]:
                wait_at_least(self._peer_header[peer], layout.HEADER_LEFT, seq - 1, deadline=entry,
                              what=f"rank {self.rank}: rank {peer} leaving call seq {seq - 1} before "
                                   f"call seq {seq} starts")
        self._header[layout.HEADER_SEQ] = seq
        self._header[layout.HEADER_M] = m

    def _leave_failed(self, seq: int, err: BaseException) -> None:
        """Error path: mark call ``seq`` left, then wait (one deadline at most) until every peer that
        entered it has left it too, so that this rank's next call cannot overwrite the stamps, flags
        and data a slower peer still reads to reach its own verdict on this call.

        Not waited for: a peer that has not entered the call (stalled before it: it reads nothing of
        this call before it enters, and this rank's next call waits in ``_enter`` for it to leave
        this one), and a peer whose process has exited. Waiting a deadline for either made a rank
        raise only after twice its deadline."""
        self._header[layout.HEADER_LEFT] = seq
        if not isinstance(err, Exception):
            return  # KeyboardInterrupt and the like: leave at once
        rendezvous = Deadline(self.deadline_s)
        for peer in layout.dest_order(self.rank, self.world)[:-1]:
            if int(self._peer_header[peer][layout.HEADER_SEQ]) < seq:
                continue
            try:
                wait_at_least(self._peer_header[peer], layout.HEADER_LEFT, seq, deadline=rendezvous,
                              what=f"rank {self.rank}: rank {peer} leaving failed call seq {seq}",
                              cancelled=lambda: self._peer_gone(peer))
            except CommTimeoutError as late:
                if not self._peer_gone(peer):
                    err.add_note(f"{late}; this rank's next call waits for it to leave this one first")
                    return

    # ---- protocol steps -----------------------------------------------------------------------------
    def _communicate(self, plan, out, deadline):
        """Scatter after the whole GEMM (split mode and self-test), then reduce and gather."""
        self.transport.begin(plan, deadline)
        self.transport.publish_all(plan)
        self._after_scatter(plan, out, deadline)

    def _after_scatter(self, plan, out, deadline):
        """Steps 4-5 of the pattern: reduce, gather and assemble (all-reduce), or reduce into ``out``
        (reduce-scatter: the own slice is the output)."""
        if self.config.pattern_spec.gather:
            self._reduce_gather_assemble(plan, out, deadline)
        else:
            self._reduce_into(plan, out, deadline)

    def _reduced_chunk(self, plan, chunk, deadline) -> torch.Tensor:
        """Step 4 for one chunk: wait for the own tiles and every peer's scatter, check the peers'
        (seq, M) stamps on chunk 0, sum in fp32 in ``layout.reduce_order``."""
        rank, seq = self.rank, plan.seq
        r0, r1 = plan.rows[chunk]
        wait_at_least(self._counters, layout.counter_index(rank, chunk), plan.target(rank, chunk),
                      deadline=deadline, what=f"rank {rank}: own tiles of chunk {chunk}, seq {seq}")
        acc = self._partial[rank][r0:r1].float()
        for src in layout.reduce_order(rank, self.world):
            self._wait_flag(self._scatter_flags, layout.counter_index(src, chunk), plan, deadline,
                            what=f"rank {rank}: scatter of chunk {chunk} from rank {src}, seq {seq}")
            if chunk == 0:
                self._check_peer_m(src, plan)
            acc += self._recv[src][r0:r1].float()
        return acc

    def _reduce_into(self, plan, out, deadline):
        """Reduce-scatter: the reduced own slice, chunk by chunk, is the output (``[slice rows, n_slice]``)."""
        for chunk in range(plan.chunks):
            r0, r1 = plan.rows[chunk]
            out[r0:r1] = self._reduced_chunk(plan, chunk, deadline).to(torch.bfloat16)
        self._finish_together(plan, deadline)

    def _finish_together(self, plan, deadline) -> None:
        """The end of a call of a pattern without a gather phase (reduce-scatter, all-gather): tell
        every peer this rank completed call ``seq`` (``gather_flags[rank, 0] = seq`` in its window),
        wait for every peer's word. Without it a rank whose own slice was complete returned while a
        peer failed the same call (its put to that peer lost): the ranks' verdicts differed."""
        rank, flag = self.rank, layout.counter_index(self.rank, 0)
        for dest in layout.dest_order(rank, self.world)[:-1]:
            self.transport.put(dest=dest, copies=[], flag_words=self._gather_flags[dest], flag_index=flag,
                               seq=plan.seq, phase="gather", chunk=0)
        self.transport.finish()
        for src in layout.reduce_order(rank, self.world):
            self._wait_flag(self._gather_flags[rank], layout.counter_index(src, 0), plan, deadline,
                            what=f"rank {rank}: rank {src} completing call seq {plan.seq}")

    def _wait_flag(self, words, index, plan, deadline, what) -> None:
        value = wait_at_least(words, index, plan.seq, deadline=deadline, what=what)
        if value != plan.seq:
            # a peer enters call seq + 1 only after this rank has left seq (_enter), so a later seq here
            # means the peer does not run this protocol (another build of the op, or the ranks' ops
            # were built in a different order)
            raise CommTimeoutError(f"{what}: the peer already signalled seq {value} while this rank is in "
                                   f"seq {plan.seq}; the ranks are out of step; rebuild the op on every rank")

    def _check_peer_m(self, src, plan) -> None:
        seq, m, tag = unstamp(int(self._scatter_m[src]))
        if seq != stamp_seq(plan.seq):
            raise PeerMismatchError(f"rank {self.rank}: rank {src}'s chunk-0 stamp is for seq {seq}, not "
                                    f"{stamp_seq(plan.seq)} (cco.transport.base.stamp_seq); "
                                    f"the ranks are out of step; rebuild the op on every rank")
        if m == REJECTED_M:
            raise rejected_error(self.notes, rank=self.rank, src=src, seq=plan.seq)
        if (m, tag) != (plan.m, plan.tag):
            raise PeerMismatchError(mismatch_text(self.rank, (plan.m, plan.tag), src, (m, tag), plan.seq))

    def _reduce_gather_assemble(self, plan, out, deadline):
        rank, seq = self.rank, plan.seq
        for chunk in range(plan.chunks):
            self._gather_chunk(plan, chunk, self._reduced_chunk(plan, chunk, deadline))
        self.transport.finish()
        for chunk in range(plan.chunks):
            for owner in layout.dest_order(rank, self.world):
                self._wait_flag(self._gather_flags[rank], layout.counter_index(owner, chunk), plan, deadline,
                                what=f"rank {rank}: gather of chunk {chunk} from rank {owner}, seq {seq}")
        self._assemble(plan, out)

    def _gather_chunk(self, plan, chunk, acc: torch.Tensor) -> None:
        """Put the reduced chunk of the own slice into ``gather[rank]`` of every rank."""
        rank, (r0, r1) = self.rank, plan.rows[chunk]
        flag = layout.counter_index(rank, chunk)
        if self.config.gather_dtype == "fp8":
            q, scale = quantize_gather(acc, layout.GATHER_GROUP)
            payload = [(q, lambda d: self._gather[d][rank][r0:r1]), (scale, lambda d: self._gather_scale[d][rank][r0:r1])]
        else:
            payload = [(acc.to(torch.bfloat16), lambda d: self._gather[d][rank][r0:r1])]
        for dest in layout.dest_order(rank, self.world):
            copies = [(src, dst(dest)) for src, dst in payload]
            if dest == rank:  # the own slot is local memory, not a transfer
                for src, dst in copies:
                    dst.copy_(src)
                release(self._gather_flags[rank], flag, plan.seq)
            else:
                self.transport.put(dest=dest, copies=copies, flag_words=self._gather_flags[dest], flag_index=flag,
                                   seq=plan.seq, phase="gather", chunk=chunk)

    def _assemble(self, plan, out) -> None:
        m, ns = plan.m, self.config.n_slice
        gather, scale = self._gather[self.rank], self._gather_scale[self.rank]
        for owner in range(self.world):
            cols = out[:, owner * ns:(owner + 1) * ns]
            if self.config.gather_dtype == "fp8":
                cols.copy_(dequantize_gather(gather[owner][:m], scale[owner][:m], layout.GATHER_GROUP).to(torch.bfloat16))
            else:
                cols.copy_(gather[owner][:m])
