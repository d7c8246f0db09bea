"""``lsa``: load/store access. The producer stores tiles straight into the owner's window; the tile
that completes a (dest, chunk) releases the owner's flag. No copier, no staging copy."""

from __future__ import annotations

from cco import layout
from cco.transport.base import Transport
from cco.transport.protocol import Deadline


class LsaTransport(Transport):
    name = "lsa"
    producer_stores_remote = True

    def begin(self, plan: layout.CallPlan, deadline: Deadline) -> None:
        self._deadline = deadline

    def chunk_complete(self, plan, dest, chunk) -> None:
        self._send_scatter_chunk(plan, dest, chunk, data_in_place=True)

    def publish_all(self, plan) -> None:
        # split-lsa: tiles went to the local partial; store each chunk into its owner now
        for chunk in range(plan.chunks):
            for dest in layout.dest_order(self.rank, self.world):
                if dest != self.rank:
                    self._send_scatter_chunk(plan, dest, chunk, data_in_place=False)

    def put(self, **kw) -> None:
        self._execute_put(**kw)

    def finish(self) -> None:
        pass
