"""``dma``: a copier moves completed chunks. The producer only stores tiles locally and bumps the
per-(dest, chunk) counters; the copier (here a thread, on a GPU the SDMA / copy engines) waits for
each counter to reach its target, copies that contiguous slice into the owner's ``recv`` and
releases the owner's flag. Gather puts queue on the same copier, after the scatter."""

from __future__ import annotations

import concurrent.futures as cf
import threading

from cco import layout
from cco.transport.base import Transport
from cco.transport.protocol import CommTimeoutError, Deadline, wait_at_least


class DmaTransport(Transport):
    name = "dma"
    producer_stores_remote = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self._counters = self.window.words(self.config.window.counters, rank=self.rank)
        self._engine = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cco-dma-rank{self.rank}")
        self._cancel = threading.Event()
        self._jobs: list[cf.Future] = []
        self._deadline: Deadline | None = None

    def begin(self, plan: layout.CallPlan, deadline: Deadline) -> None:
        assert not self._jobs, "previous call not finished or aborted"
        self._deadline = deadline
        self._cancel.clear()
        if self.config.pattern_spec.scatter:  # the all-gather's GEMM publishes no tiles: only its puts queue
            self._jobs.append(self._engine.submit(self._watch_counters, plan))

    def _watch_counters(self, plan: layout.CallPlan) -> None:
        """Copier loop of one call: chunks in tile-walk order, each as soon as it is complete."""
        for chunk in range(plan.chunks):
            for dest in layout.dest_order(self.rank, self.world):
                if dest == self.rank:
                    continue  # the own slice is reduced in place
                wait_at_least(
                    self._counters, layout.counter_index(dest, chunk), plan.target(dest, chunk),
                    deadline=self._deadline, cancelled=self._cancel.is_set,
                    what=f"rank {self.rank} copier: tiles of (dest {dest}, chunk {chunk}), seq {plan.seq}",
                )
                self._send_scatter_chunk(plan, dest, chunk, data_in_place=False)

    def chunk_complete(self, plan, dest, chunk) -> None:
        pass  # the copier watches the counters

    def publish_all(self, plan) -> None:
        pass  # counters are at their targets; the copier started at begin() sends everything

    def put(self, **kw) -> None:
        self._jobs.append(self._engine.submit(self._execute_put, **kw))

    def finish(self) -> None:
        try:
            for job in self._jobs:
                try:
                    job.result(timeout=max(0.0, self._deadline.left()))
                except cf.TimeoutError:
                    raise CommTimeoutError(
                        f"rank {self.rank} copier: puts still in flight after the call's "
                        f"{self._deadline.seconds:.3g} s deadline"
                    ) from None
        finally:
            self._jobs = []

    def abort(self) -> None:
        """Stop waiting, but still send what is complete: queued jobs are not cancelled. A chunk
        whose tiles are all written goes out (as a copy engine already given the put would), so a
        peer still gets this rank's chunk-0 (seq, M) stamp and reaches the same verdict on the
        failed call (a mismatched M), instead of timing out on a put that was dropped here. The
        copier's waits on incomplete chunks see the cancel flag and end at once; a chunk the producer
        completed before the cancel still goes out (``wait_at_least`` loads the counter after it
        samples the cancel flag)."""
        self._cancel.set()
        cf.wait(self._jobs)
        self._jobs = []

    def close(self) -> None:
        self.abort()
        self._engine.shutdown(wait=True)
