"""Ops shared by layers: one :class:`cco.op.GemmAllReduceOp` (one window) per communicator and
shape family, and one :class:`cco.comm.Communicator` per process group.

A window holds ``partial``, ``recv`` and ``gather`` of ``m_max`` rows by N columns per rank, about
``3 * m_max * N * 2`` bytes (bf16 gather; 672 MiB at m_max 16384, N 7168): one per layer would not
fit a model. Calls are collective and run one at a time (a forward calls its layers in order; a
backward, where a sequence-parallel layer runs the dual pattern, calls them in the reverse order,
the same on every rank), so the layers of a family (same communicator, op class, padded ``[N, K]``,
quant and op options) take turns on one op. A family's op is built when its first layer is, which
every rank does in the same order (layers are built in model order), and closed when its last layer is.
"""

from __future__ import annotations

import atexit
import weakref

import torch.distributed as dist

from cco import layout, shapes
from cco.comm import Communicator
from cco.op import GemmAllReduceOp


def group_plan(comm: Communicator, n: int, k: int, *, m_max: int, unfused_reason: str | None = None, **options):
    """(plan, weight layout, fallback reason) of a fused op of the padded ``[n, k]`` shape on
    ``comm``, one verdict for the whole group: this rank's backend plans the shape
    (``cco.shapes.layer_shape`` with ``options``; ``unfused_reason``: refuse it anyway, say why),
    the ranks exchange their verdicts, and a rank that refuses makes every rank fall back (the reason
    None where every rank runs the op). The weight layout is the backend's ("row-major" where no
    backend runs on the device: the plan says why)."""
    try:
        weight_layout = shapes.backend_class(device=comm.device).weight_layouts[0]
    except ValueError:  # no backend runs on this device: layer_shape says why, the layer falls back
        weight_layout = "row-major"
    plan = shapes.layer_shape(n, k, comm.world, m_max=m_max, device=comm.device, weight_layout=weight_layout,
                              **options)
    reason = unfused_reason or plan.reason
    verdicts = comm.all_gather_object(reason)
    refused = [f"rank {r}: {why}" for r, why in enumerate(verdicts) if why is not None]
    fallback = None if not refused else (reason if len(set(verdicts)) == 1 else "; ".join(refused))
    return plan, weight_layout, fallback


class WindowPool:
    """The shared communicators and ops of a process (``DEFAULT_POOL``, unless a layer is given
    another)."""

    def __init__(self):
        self._comms: dict[int, tuple[object, Communicator]] = {}  # id(group) -> (group, comm)
        self._ops: dict[tuple, list] = {}  # family key -> [op, users]
        _POOLS.add(self)

    def communicator(self, group=None, *, cpu_group=None) -> Communicator:
        """``group`` itself when it is a Communicator; else the communicator of a torch.distributed
        group (None: the world), built on first use (collective over the group) with ``cpu_group``
        for its bootstrap where given (``Communicator.from_group``)."""
        if isinstance(group, Communicator):
            if cpu_group is not None:
                raise ValueError("cpu_group goes with a torch.distributed group; a Communicator has its bootstrap "
                                 "group already (Communicator.from_group(group, cpu_group=...))")
            return group
        group = dist.group.WORLD if group is None else group
        entry = self._comms.get(id(group))
        if entry is None:
            entry = self._comms[id(group)] = (group, Communicator.from_group(group, cpu_group=cpu_group))
        return entry[1]

    def acquire(self, comm: Communicator, *, op_class=GemmAllReduceOp, fn: str = "WindowPool.acquire",
                **options) -> GemmAllReduceOp:
        """The op of ``comm``, ``op_class`` (a pattern's op: GemmAllReduceOp, GemmReduceScatterOp,
        AllGatherGemmOp) and ``options`` (its keywords), built on first use; release it with
        :meth:`release`. Collective over ``comm``: whether this pool holds that op already must be
        the same on every rank (a layer closed on one rank only releases its op there, and the next
        layer of its family would build a new op, a collective construction, on that rank alone
        while its peers reuse theirs: the build would wait for peers that never come), so the
        ranks agree on it first and, where they differ, every rank raises ``ArgumentMismatchError``
        (``fn`` names the caller)."""
        key = (id(comm), op_class.__name__,
               tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items())))
        entry = self._ops.get(key)
        comm.agree(fn, {"an open op of this family in the pool (a layer closed on some ranks only?)":
                        entry is not None})
        if entry is None:
            entry = self._ops[key] = [op_class(comm, **options), 0]
        entry[1] += 1
        return entry[0]

    def users(self, op: GemmAllReduceOp) -> int:
        """Layers sharing ``op`` now."""
        return next((users for o, users in self._ops.values() if o is op), 0)

    def release(self, op: GemmAllReduceOp) -> None:
        """One user fewer; the last closes the op and frees its window (local, not collective)."""
        for key, entry in list(self._ops.items()):
            if entry[0] is op:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._ops[key]
                    op.close()
                return

    def close(self) -> None:
        """Close every op and every communicator this pool built (never a group it was given)."""
        for op, _ in self._ops.values():
            op.close()
        self._ops.clear()
        self.drop_groups()

    def drop_groups(self) -> None:
        """Let go of every group this pool's communicators were given (closing those communicators;
        their ops stay as they are, unusable). Local."""
        for _, comm in self._comms.values():
            comm.close()
        self._comms.clear()


# Every pool's communicators let go of their groups at interpreter exit, before finalization. A job
# that destroys its groups (dist.destroy_process_group) leaves them to be freed once nothing holds
# them, and freeing a gloo group joins its worker threads; a pool still holding one kept its workers
# alive into the interpreter's finalization, where they can abort the process ("terminate called
# without an active exception", pytorch/pytorch#190489; docs/experiments.md, "the exit-time abort,
# its holders"). Registered at import, so it runs after the handlers a job registers later.
_POOLS: "weakref.WeakSet[WindowPool]" = weakref.WeakSet()


@atexit.register
def _drop_groups_at_exit() -> None:
    for pool in list(_POOLS):
        pool.drop_groups()


# What a bootstrap group's layers count, whichever pool built them: [layers built (layer_tag), unfused
# call headers (header_seq)]. Keyed by the group, not the pool or the Communicator: every header and
# every op's bootstrap exchange of those layers goes over that group, so two pools (or two Communicators
# from_group of one group) that counted apart gave their first layers one tag and their unfused
# headers one seq, and a call of one against a peer's call of the other paired. Weak: a group the
# job destroys takes its counts with it (every rank destroys it collectively, so none counts on).
_GROUP_COUNTS: "weakref.WeakKeyDictionary[object, list[int]]" = weakref.WeakKeyDictionary()


def _counts(comm: Communicator) -> list[int]:
    return _GROUP_COUNTS.setdefault(comm.group, [0, 0])


def layer_tag(comm: Communicator) -> int:
    """The tag of a layer built on ``comm`` now, 1 .. ``layout.CALL_TAGS - 1``: its place among the
    layers built on ``comm``'s bootstrap group in this process, in any pool (cycled past 255). Every
    call of the layer carries it (the op's (seq, tag, M) stamp, the unfused header), so that rank 0's
    call of one layer and rank 1's of another, which take the same seq of a shared op (one family) or
    of the group's unfused headers (:func:`header_seq`), fail on every rank instead of pairing. A
    layer's construction is collective, so it has the same tag on every rank; two layers whose places
    are 255 apart share a tag."""
    counts = _counts(comm)
    counts[0] += 1
    return 1 + (counts[0] - 1) % (layout.CALL_TAGS - 1)


def header_seq(comm: Communicator) -> int:
    """The seq of the next call header that no op's call numbers (the unfused layers'): one count for
    the layers on ``comm``'s bootstrap group, as a shared op's seq is one count for its family, so
    that a call of one layer against a peer's call of another (their tags differ: every rank raises)
    leaves the ranks in step for the next calls."""
    counts = _counts(comm)
    counts[1] += 1
    return counts[1] - 1


DEFAULT_POOL = WindowPool()
