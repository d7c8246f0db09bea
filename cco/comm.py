"""Communicator: rank, world, local device and a CPU (gloo) group, however the ranks were launched.

Four ways in, one object out::

    comm = Communicator.from_env()            # torchrun (RANK/WORLD_SIZE/MASTER_*), or mpirun
                                              # (OMPI_/PMI_ variables, bootstrapped over mpi4py)
    comm = Communicator.from_group(tp_group)  # the ranks of a group of a job that is already running
                                              # (tensor parallel inside TP x DP or TP x PP)
    outcomes = spawn(fn, world=4, args=(...)) # self-spawned local ranks (tests, the demo):
                                              # fn(comm, *args) runs in each rank process

``rank`` and ``world`` are the rank within, and the size of, the communicator's group; the gloo group
carries only bootstrap traffic (window names, barriers at setup); the op's data moves through
windows. ``close()`` destroys the process group if this communicator created it (never one it was
given), is idempotent, and runs on ``with`` exit. Nothing here is a per-call collective.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

if dist.is_available() and not dist.is_initialized():
    # torch.distributed.nn.functional binds ``group.WORLD`` as its functions' default arguments when it is
    # imported. Imported after init_process_group (torch._dynamo imports it: torch.compile, the first call
    # of any torch.library custom op, transformers' tensor-parallel model), those defaults hold the world
    # group past destroy_process_group: its gloo workers live on to interpreter exit and can abort it
    # there (docs/experiments.md, "the exit-time abort, its holders"). Imported here, before any group
    # exists, they hold None.
    import torch.distributed.nn.functional  # noqa: F401

DEFAULT_TIMEOUT_S = 120.0  # bootstrap collectives (group creation, window setup)
# int64 per rank in every gather_words exchange: (seq, count, when this rank entered it in us of wall
# time, its timeout in ms, up to six words)
EXCHANGE_WORDS = 10
_HEAD = 4  # the words before the caller's
# A rank that enters an exchange this late after the first one (a share of the timeout, at most the
# seconds beside it) makes it fail on every rank: the first rank's wait ends at the timeout, and the
# margin covers the gather's own latency and the hosts' clock skew (gather_words)
LATE_SHARE, LATE_MARGIN_MAX_S = 0.25, 5.0
# groups of closed communicators whose timed-out exchange was still posted (Communicator.close)
_STUCK_GROUPS: list = []
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")


def _first_env(names) -> str | None:
    return next((os.environ[n] for n in names if n in os.environ), None)


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():  # ROCm builds report through torch.cuda as well
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def late_bound(timeout_s: float) -> float:
    """How late after the first rank another may enter a ``gather_words`` exchange of ``timeout_s``
    (seconds) before the exchange fails on every rank."""
    return timeout_s - min(LATE_SHARE * timeout_s, LATE_MARGIN_MAX_S)


class Communicator:
    """Ranks of one job. Build it with :meth:`from_env`, :meth:`from_mpi`, :func:`spawn`, or directly
    with an ``init_method`` (``"env://"``, ``"tcp://host:port"``, ``"file:///path"``)."""

    def __init__(self, *, rank: int, world: int, init_method: str, local_rank: int | None = None,
                 device: torch.device | str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 launcher: str = "direct"):
        if not 0 <= rank < world:
            raise ValueError(f"Communicator: rank={rank} must be in 0..world-1 (world={world})")
        self._place(rank=rank, world=world, local_rank=local_rank, device=device, launcher=launcher)
        timeout = datetime.timedelta(seconds=timeout_s)
        if dist.is_initialized():
            if dist.get_world_size() != world or dist.get_rank() != rank:
                raise RuntimeError(
                    f"Communicator: torch.distributed is already initialized as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, not rank {rank} of {world}; for a group of that job (tensor "
                    f"parallel inside a larger job) use Communicator.from_group(group)"
                )
            # reuse the job's group; add a gloo group for CPU bootstrap if its backend is not gloo
            self.group = dist.new_group(backend="gloo", timeout=timeout)
            self._owns_group = False
        else:
            backend = "gloo" if self.device.type == "cpu" else "cpu:gloo,cuda:nccl"
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                    world_size=world, timeout=timeout)
            self.group = dist.group.WORLD
            self._owns_group = True
        self._handshake()

    def _place(self, *, rank: int, world: int, local_rank: int | None, device, launcher: str) -> None:
        self.rank = rank
        self.world = world
        self.local_rank = rank if local_rank is None else local_rank
        self.device = torch.device(device) if device is not None else _default_device(self.local_rank)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": this local rank's GPU
            self.device = _default_device(self.local_rank) if torch.cuda.is_available() else self.device
        if self.device.type == "cuda":
            # streams, symmetric memory and the kernels' launches all use the current device: without
            # this every local rank would work on device 0
            torch.cuda.set_device(self.device)
        self.launcher = launcher
        self._owns_group = False
        self._group = None

    @property
    def group(self):
        """The communicator's CPU (gloo) process group. A closed communicator holds none: reading it
        raises, so that no exchange of a closed communicator falls back to the default group
        (``group=None`` in torch.distributed)."""
        group = self._group
        if group is None:
            raise RuntimeError(f"Communicator(rank={self.rank}, world={self.world}): "
                               f"{'closed' if getattr(self, '_closed', False) else 'not set up'}; it holds no group")
        return group

    @group.setter
    def group(self, group) -> None:
        self._group = group

    def _handshake(self) -> None:
        # One gloo all-reduce before anyone may leave: a rank's init can return while a peer is still
        # connecting its mesh, and a rank that then failed and closed its sockets made that peer's init
        # fail too ("Gloo connectFullMesh failed ... Connection closed by peer"), so one rank's error
        # showed as two. A CPU tensor keeps it on gloo in a mixed gloo/NCCL group.
        dist.all_reduce(torch.zeros(1), group=self.group)
        self._closed = False
        self._stale = None  # gather_words' exchange that timed out, still posted: (work, tensors, seq)

    # ---- launchers --------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, *, device=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "Communicator":
        """Ranks launched by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``) or by
        mpirun/mpiexec (Open MPI, MPICH or MVAPICH variables; needs mpi4py)."""
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return cls(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]),
                       local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
                       init_method="env://", device=device, timeout_s=timeout_s, launcher="torchrun")
        if _first_env(_MPI_RANK_VARS) is not None:
            return cls.from_mpi(device=device, timeout_s=timeout_s)
        raise RuntimeError(
            "Communicator.from_env: no launcher found: set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT "
            "(torchrun does), launch under mpirun, or use cco.comm.spawn(fn, world=...) for local ranks"
        )

    @classmethod
    def from_group(cls, group=None, *, device=None, cpu_group=None) -> "Communicator":
        """The ranks of ``group``, a process group of a job whose torch.distributed is already
        initialized (``None``: the whole world). Collective over ``group`` (one all-reduce on its CPU
        backend); never creates or destroys a process group.

        ``rank`` and ``world`` are this process's rank in ``group`` and the group's size, so a tensor
        parallel group inside TP x DP (or TP x PP) is a communicator of its own. Bootstrap traffic
        (window names, barriers) needs a group that carries CPU tensors: ``group`` itself when its
        backend includes gloo (``"gloo"``, ``"cpu:gloo,cuda:nccl"``), else ``cpu_group``, a gloo group
        of the same ranks. ``device`` defaults to the current CUDA device (set it per local rank, as
        torchrun jobs do) or the CPU."""
        fn = "Communicator.from_group"
        if not dist.is_initialized():
            raise RuntimeError(f"{fn}: torch.distributed is not initialized; call dist.init_process_group first, "
                               f"or use Communicator.from_env() to let the communicator initialize it")
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            # (not the group's ranks: torch gives every non-member one placeholder group, whose ranks
            # would be another group's)
            raise ValueError(f"{fn}: this process (global rank {dist.get_rank()}) is not a member of the group; "
                             f"build the communicator on its members only")
        bootstrap = group if cpu_group is None else cpu_group
        if cpu_group is not None and dist.get_process_group_ranks(cpu_group) != dist.get_process_group_ranks(group):
            raise ValueError(f"{fn}: cpu_group has ranks {dist.get_process_group_ranks(cpu_group)} but group has "
                             f"{dist.get_process_group_ranks(group)}; pass a gloo group of the same ranks")
        backend = str(dist.get_backend(bootstrap))
        if "gloo" not in backend and "mpi" not in backend:
            raise ValueError(f"{fn}: the group's backend is {backend!r}, which carries no CPU tensors for the "
                             f"bootstrap; pass cpu_group=dist.new_group(ranks, backend='gloo') (collective over "
                             f"the world), or create the group with backend='cpu:gloo,cuda:nccl'")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        comm = cls.__new__(cls)
        comm._place(rank=rank, world=dist.get_world_size(group), local_rank=None, device=device, launcher="group")
        comm.group = bootstrap
        comm._handshake()
        return comm

    @classmethod
    def from_mpi(cls, *, device=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "Communicator":
        """Ranks launched by mpirun: mpi4py gives rank and size; rank 0 picks a TCP rendezvous
        address and broadcasts it over MPI; the rest is the same gloo group as under torchrun."""
        try:
            from mpi4py import MPI  # lazy: optional dependency
        except ImportError as err:
            raise RuntimeError("Communicator.from_mpi needs mpi4py (pip install mpi4py mpich)") from err
        world_comm = MPI.COMM_WORLD
        rank, world = world_comm.Get_rank(), world_comm.Get_size()
        launched = _first_env(_MPI_SIZE_VARS)
        if launched is not None and launched.isdigit() and int(launched) != world:
            # mpi4py built against another MPI than the launcher's: each process would be a job of
            # one rank of its own, run alone and pass
            raise RuntimeError(f"Communicator.from_mpi: the launcher started {launched} ranks but MPI reports "
                               f"{world} (mpi4py is built against another MPI than this mpirun's); launch with "
                               f"the mpirun of mpi4py's MPI (python3 -c 'import mpi4py; print(mpi4py.get_config())')")
        address = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                address = f"tcp://{socket.gethostbyname(socket.gethostname())}:{s.getsockname()[1]}"
        address = world_comm.bcast(address, root=0)
        local = _first_env(_MPI_LOCAL_VARS)
        if local is None:
            local = world_comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        return cls(rank=rank, world=world, local_rank=int(local), init_method=address, device=device,
                   timeout_s=timeout_s, launcher="mpirun")

    # ---- bootstrap collectives (gloo) ---------------------------------------------------------------
    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def broadcast_object(self, obj, *, src: int = 0):
        """``obj`` of the communicator's rank ``src`` on every rank (``src`` counts in this group)."""
        box = [obj]
        # torch.distributed names the source by its global rank, also for a subgroup
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_words(self, words: list[int], *, seq: int, timeout_s: float, what: str) -> list[list[int]]:
        """Every rank's ``words`` (at most ``EXCHANGE_WORDS - 4`` ints), in rank order: one gather on the
        CPU group, waited for at most ``timeout_s`` (a collective call's header: a peer that never
        comes, because it died or made another call, raises ``CommTimeoutError`` naming ``what``
        here instead of blocking until the group's own timeout). ``seq`` names the collective call
        the exchange belongs to (an op's call seq, a layer's header count): ranks that exchange at
        different seqs made different calls.

        Different seqs, the same verdict from the same words on every rank: a rank whose seq is
        below the highest is behind (its exchange met the peers' exchange of a later call: it
        missed a call of theirs, which failed without it) and raises ``PeerMismatchError`` with
        ``behind`` set to how many calls it is behind, so that its caller can take part in the
        missed calls as rejected ones (``cco.nn``'s layers: ``op.reject``); a rank at the highest
        seq posts its exchange once more, which meets the behind ranks' next exchange (their
        exchange of this call). Before, both raised, and their op seqs stayed one apart: every later
        call failed on both.

        A gather that timed out stays posted (gloo cannot withdraw it), and the peers' next exchange
        pairs with it. So this rank's next exchange completes it first (within ``timeout_s`` too):
        where every peer made that same exchange late (its seq), it is spent and this one goes ahead;
        where every peer's seq is this exchange's, the peers made this very exchange against the
        stale words, saw this rank behind and post theirs once more: this one goes ahead and meets
        it; anything else raises ``PeerMismatchError``. (Each exchange has the same size, whatever
        its words: gloo aborts a gather whose sizes differ.) One rank: its own words, no exchange.

        A peer that comes late, but while this rank's gather is still posted (it timed out, or is
        about to), completes it: before, that peer went on into the call's data collective alone
        (an unfused layer's all-reduce) and waited there for the group's own timeout. So every rank
        also sends when it entered (wall time) and its timeout: where the last rank entered more than
        ``timeout - min(LATE_SHARE * timeout, LATE_MARGIN_MAX_S)`` seconds after the first, every rank
        that gets the words raises ``CommTimeoutError`` too, the same verdict from the same words,
        and the first rank's stale gather is then spent (the ranks stay in step). The margin is what
        the gather's latency and the hosts' clock skew may take: below it, the first rank's wait has
        not ended when the words arrive. (So the hosts' wall clocks must agree to within the margin,
        as NTP keeps them: ranks of one host share a clock; hosts whose clocks are seconds apart
        would fail exchanges that were in time, with that message.)"""
        from cco.transport.protocol import CommTimeoutError

        if len(words) > EXCHANGE_WORDS - _HEAD:
            raise ValueError(f"gather_words: {len(words)} words; at most {EXCHANGE_WORDS - _HEAD}")
        if self.world == 1:
            return [list(words)]
        if self._stale is not None:
            work, every, stale_seq = self._stale
            try:
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
            except RuntimeError as err:
                raise CommTimeoutError(
                    f"rank {self.rank}: {what}: the peers did not answer this rank's exchange of call seq {stale_seq} "
                    f"(it timed out before) within {timeout_s:g} s: a peer died or stalled; build a new "
                    f"communicator: {err}") from None
            self._stale = None
            peers = {int(t[0]) for r, t in enumerate(every) if r != self.rank}
            if peers != {stale_seq} and peers != {seq}:  # the peers' exchange of another call
                self._words_of(every, what, seq=seq, retry=False)  # (raises: the seqs differ)
        for attempt in range(2):
            mine = torch.zeros(EXCHANGE_WORDS, dtype=torch.int64)
            mine[0], mine[1], mine[2], mine[3] = seq, len(words), time.time_ns() // 1000, round(timeout_s * 1000)
            mine[_HEAD:_HEAD + len(words)] = torch.tensor(words, dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(self.world)]
            work = dist.all_gather(every, mine, group=self.group, async_op=True)
            try:
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
            except RuntimeError as err:
                self._stale = (work, every, seq)
                raise CommTimeoutError(
                    f"rank {self.rank}: {what}: the peers did not take part within {timeout_s:g} s (a peer died, "
                    f"stalled, or made another call; this rank's next exchange on the communicator completes "
                    f"this one first): {err}") from None
            found = self._words_of(every, what, seq=seq, retry=attempt == 0)
            if found is not None:
                return found
        raise AssertionError("gather_words: _words_of raises rather than ask for a third attempt")

    def _words_of(self, every: list[torch.Tensor], what: str, *, seq: int, retry: bool) -> list[list[int]] | None:
        """The words of a completed exchange (rank order); None where this rank posts its exchange
        once more (``retry``: its seq is the highest and a peer's is lower); or on every rank the
        same verdict from the same words: ``PeerMismatchError`` where the ranks' seqs (or word
        counts) differ (``behind``: how many calls this rank's call ``seq`` is behind the highest
        seq; its own row may be a stale exchange's), ``CommTimeoutError`` where a rank entered too
        late after the first (:meth:`gather_words`)."""
        from cco.transport.protocol import CommTimeoutError, PeerMismatchError

        rows = [t.tolist() for t in every]
        seqs = [r[0] for r in rows]
        if len({(r[0], r[1]) for r in rows}) > 1:
            behind = max(0, max(seqs) - seq)
            if retry and behind == 0 and len(set(seqs)) > 1:
                return None
            err = PeerMismatchError(
                f"rank {self.rank}: {what}: the ranks exchanged for different collective calls ("
                + ", ".join(f"call seq {r[0]} on rank {i}" for i, r in enumerate(rows))
                + "): one rank's call met another call of its peers (a call of no rows against one with rows, "
                  "a timed-out call against the next); every rank raises"
                + (f", this rank is {behind} call(s) behind its peers" if behind > 0 else "")
                + ", and the next call is in step")
            err.behind = behind
            raise err
        entered = [r[2] for r in rows]
        first, last = entered.index(min(entered)), entered.index(max(entered))
        timeout_s = min(r[3] for r in rows) / 1000
        late, bound = (entered[last] - entered[first]) / 1e6, late_bound(timeout_s)
        if late > bound:
            raise CommTimeoutError(
                f"rank {self.rank}: {what}: rank {last} entered this exchange {late:.2f} s after rank {first}, past "
                f"{bound:.2f} s of its {timeout_s:g} s timeout: rank {first} has given up "
                f"waiting (or is about to), so every rank raises, and the next call is in step")
        return [r[_HEAD:_HEAD + r[1]] for r in rows]

    def agree(self, fn: str, arguments: dict, *, error: BaseException | None = None) -> None:
        """Construction of a collective object (an op, a layer) is collective: every rank calls this
        with the same ``fn`` and the arguments that must match on every rank, before anything is
        mapped or built for them, and every rank reaches the same verdict in one exchange:

        - arguments that differ: :class:`ArgumentMismatchError` on every rank, naming each such
          argument and every rank's value (before this check a rank with another ``m_max`` failed
          to map its peers' windows while they waited for it);
        - ``error``, this rank's own rejection of its arguments (None: accepted): raised on this
          rank, and :class:`PeerRejectedError` naming this rank and its reason on every peer.

        Values are compared by ``repr`` (a list and a tuple of the same items are equal)."""
        from cco.transport.protocol import ArgumentMismatchError, PeerRejectedError

        mine = ({name: repr(tuple(v) if isinstance(v, list) else v) for name, v in arguments.items()},
                None if error is None else f"{type(error).__name__}: {error}")
        every = [mine] if self.world == 1 else self.all_gather_object(mine)
        differ = [name for name in arguments if len({args.get(name) for args, _ in every}) > 1]
        if differ:
            raise ArgumentMismatchError(
                f"{fn}: construction is collective and the ranks passed different arguments: " + "; ".join(
                    f"{name} = " + ", ".join(f"{args.get(name)} on rank {r}" for r, (args, _) in enumerate(every))
                    for name in differ) + "; build it with the same arguments on every rank")
        if error is not None:
            raise error
        rejected = [f"rank {r}: {why}" for r, (_, why) in enumerate(every) if why is not None]
        if rejected:
            raise PeerRejectedError(f"{fn}: a peer rejected its construction arguments ({'; '.join(rejected)}); "
                                    f"rank {self.rank} raises too, so that no rank is left waiting")

    # ---- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the process group this communicator created (not one it found) and drop its
        reference to its group (reading ``group`` raises after it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        # No reference to the group is left here (a group it was given stays its owner's): once no
        # other holds it either, the group is freed, and freeing it joins its gloo worker threads, each
        # releasing its last collective's tensors first. Left to interpreter exit, a worker that
        # releases them then asks a finalizing interpreter for the GIL, and the process aborts
        # ("terminate called without an active exception"; pytorch/pytorch#190489; docs/experiments.md,
        # "the exit-time abort"). Except where an exchange that timed out is still posted: a worker
        # waits in it until the peer leaves or gloo's own timeout ends it, and freeing the group would
        # wait for that worker here, so that group is kept to process exit as before.
        if self._stale is not None:
            _STUCK_GROUPS.append(self._group)
        self._group = None
        self._stale = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Communicator(rank={self.rank}, world={self.world}, device={self.device}, launcher={self.launcher})"


# --------------------------------------------------------------------------------------------------
# self-spawned local ranks
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """What one spawned rank did: returned ``value``, raised (``error_type``, ``error``), or died."""

    rank: int
    value: object = None
    error_type: str | None = None
    error: str | None = None
    exitcode: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_type is None and self.exitcode == 0


class SpawnError(RuntimeError):
    """One or more spawned ranks failed; the message lists each failure."""


def _rank_main(fn, rank, world, init_method, device, timeout_s, args, conn):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks: loopback only
    torch.set_num_threads(1)  # world ranks share the machine's cores
    t0 = time.monotonic()
    try:
        with Communicator(rank=rank, world=world, init_method=init_method, device=device,
                          timeout_s=timeout_s, launcher="spawn") as comm:
            value = fn(comm, *args)
        message = ("ok", value, None, time.monotonic() - t0)
    except BaseException as err:  # report everything, including KeyboardInterrupt, to the parent
        message = ("error", type(err).__name__, f"{err}\n{traceback.format_exc()}", time.monotonic() - t0)
    try:
        # plain pickle: tensors travel by value (multiprocessing's pickler would pass a shared-memory
        # handle that dies with this process)
        try:
            payload = pickle.dumps(message)
        except Exception as err:
            payload = pickle.dumps(("error", type(err).__name__, f"rank {rank}: result not picklable: {err}",
                                    time.monotonic() - t0))
        conn.send_bytes(payload)
    finally:
        conn.close()


def spawn(fn, *, world: int, args: tuple = (), device="cpu", timeout_s: float = 300.0,
          bootstrap_timeout_s: float = 60.0) -> list[RankOutcome]:
    """Run ``fn(comm, *args)`` in ``world`` fresh local rank processes; return one outcome per rank.

    ``fn`` must be importable (a module-level function; a lambda or a nested one is a TypeError).
    Processes come from a forkserver that has already imported torch (and torch._dynamo), so a rank
    starts in well under a second. A rank still running after ``timeout_s`` is killed and reported with
    ``error_type="SpawnTimeout"``. Use :func:`check_outcomes` to turn failures into one exception.
    """
    if world < 1:
        raise ValueError(f"spawn: world={world} must be >= 1")
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        # the rank processes unpickle fn by its name: this one has none they could import, and each
        # would die before reporting anything (an outcome that says only "exited with code 1")
        raise TypeError(f"spawn: fn={fn!r} has no name to import by (a lambda or a function defined inside "
                        f"another); pass a module-level function (the rank processes import it by name)")
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: the first custom-op call or compile in a rank imports it (1.2 s of one core,
    # each rank of each spawn); imported here it comes before any group (torch.distributed.nn.functional)
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "cco.comm"])
    with tempfile.TemporaryDirectory(prefix="cco-spawn-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs, pipes = [], []
        for rank in range(world):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"cco-rank{rank}",
                            args=(fn, rank, world, init_method, device, bootstrap_timeout_s, args, child_end))
            p.start()
            child_end.close()
            procs.append(p)
            pipes.append(parent_end)
        deadline = time.monotonic() + timeout_s
        messages: dict[int, tuple] = {}
        for rank, (p, pipe) in enumerate(zip(procs, pipes)):
            # a rank reports before it exits; poll the pipe so a full pipe never blocks its exit
            while rank not in messages:
                left = deadline - time.monotonic()
                if pipe.poll(max(0.0, min(left, 0.1))):
                    try:
                        messages[rank] = pickle.loads(pipe.recv_bytes())
                    except EOFError:
                        break
                    except Exception as err:  # sent, but it does not load here: this rank's error, not the parent's
                        messages[rank] = ("error", "ResultNotReadable",
                                          f"rank {rank}: its result was sent but does not load in the parent "
                                          f"({type(err).__name__}: {err}); torch's pickle of some dtypes (fp8 "
                                          f"among them, torch 2.13) does not load back: return such a tensor "
                                          f"as its bytes, t.view(torch.uint8)", float("nan"))
                elif not p.is_alive() or left <= 0:
                    if pipe.poll(0):
                        continue
                    break
        outcomes = []
        for rank, p in enumerate(procs):
            p.join(max(0.0, deadline - time.monotonic()) if rank in messages else 0.5)
            killed = p.is_alive()
            if killed:
                p.kill()
                p.join()
            msg = messages.get(rank)
            if msg is None:
                if killed:
                    outcomes.append(RankOutcome(rank=rank, error_type="SpawnTimeout",
                                                error=f"rank {rank} did not finish within {timeout_s} s",
                                                exitcode=p.exitcode))
                else:
                    outcomes.append(RankOutcome(rank=rank, error_type="Died",
                                                error=f"rank {rank} exited with code {p.exitcode}",
                                                exitcode=p.exitcode))
            elif msg[0] == "ok":
                outcomes.append(RankOutcome(rank=rank, value=msg[1], exitcode=p.exitcode, seconds=msg[3]))
            else:
                outcomes.append(RankOutcome(rank=rank, error_type=msg[1], error=msg[2],
                                            exitcode=p.exitcode, seconds=msg[3]))
        for pipe in pipes:
            pipe.close()
    return outcomes


def check_outcomes(outcomes: list[RankOutcome]) -> list:
    """The ranks' return values, or :class:`SpawnError` listing every failed rank."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        lines = [f"rank {o.rank}: {o.error_type}: {o.error}" for o in failed]
        raise SpawnError(f"{len(failed)} of {len(outcomes)} ranks failed:\n" + "\n".join(lines))
    return [o.value for o in outcomes]
