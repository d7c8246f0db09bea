"""The communicator's key-value store as the ops use it beside the window: notes for the peers on
error and close paths (``cco.transport.reasons``), and an IPC window's "unmapped" posts
(``cco.window.IpcWindow``). Every call there is best effort and bounded (:func:`within`): a store
served by a rank that died must neither hold a ``close()`` nor push an error past its bound.
"""

from __future__ import annotations

import threading

# The bound of one such call: a store round trip takes milliseconds; an error's note must stay within
# the fault bound (deadline + 2 s) where the store's server is on a dead rank and a read would wait
# out the store's own timeout (minutes)
STORE_CALL_S = 1.0


def store_of(comm):
    """The store of ``comm``'s process group: ``comm.store`` if the communicator has one, else the
    default group's (torchrun, mpirun and spawn all create one)."""
    store = getattr(comm, "store", None)
    if store is not None:
        return store
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def within(fn, seconds: float = STORE_CALL_S):
    """``fn()``'s result, or None where it raised or did not return within ``seconds``: the store
    calls of an error path or of a local close(), run in a daemon thread so that a store whose
    server died (a client may wait out the store's own timeout, minutes) does not hold the caller."""
    result: list = []

    def run():
        try:
            result.append(fn())
        except Exception:  # noqa: BLE001 - best effort: the caller goes on without it
            pass

    worker = threading.Thread(target=run, name="cco-store", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # no new thread at the interpreter's shutdown (a close() from a finalizer)
        return None
    worker.join(seconds)
    return result[0] if result else None
