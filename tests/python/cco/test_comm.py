"""Communicator, spawn and the shared-memory window, with real rank processes."""

import glob
import os
import re

import pytest

from cco import layout
from cco.comm import Communicator, check_outcomes, spawn
from cco.window import ShmWindow
from tests.python.cco.cpu_ranks import torchrun_two_ranks

pytestmark = pytest.mark.multirank


def _identity(comm):
    token = comm.broadcast_object(f"from-{comm.rank}" if comm.rank == 0 else None)
    return comm.rank, comm.world, str(comm.device), token, comm.all_gather_object(comm.rank * 10)


@pytest.mark.parametrize("world", [2, 4])
def test_spawn_gives_each_rank_its_identity(world):
    values = check_outcomes(spawn(_identity, world=world, timeout_s=60))
    for rank, (r, w, device, token, gathered) in enumerate(values):
        assert (r, w, device, token) == (rank, world, "cpu", "from-0")
        assert gathered == [10 * i for i in range(world)]


def _threads_around_close(comm):
    """Native threads of this rank process with its communicator's group open (after a collective,
    whose work a gloo worker thread ran) and after ``close()``."""
    def threads():
        return len(os.listdir("/proc/self/task"))
    comm.all_gather_object(comm.rank)
    during = threads()
    comm.close()
    after = threads()
    comm.close()  # idempotent (the spawn harness's ``with`` closes it once more too)
    try:
        comm.barrier()  # a closed communicator's exchange must not fall back to the default group
        refused = None
    except RuntimeError as err:
        refused = str(err)
    return during, after, refused


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_close_joins_the_groups_worker_threads():
    """``close()`` of a communicator that created its group leaves no gloo worker thread behind: the
    group, destroyed and no longer referenced, is freed there and joins its workers. A worker left
    to interpreter exit may release its last collective's tensors while the interpreter finalizes,
    and that aborts the process (docs/experiments.md, "the exit-time abort"). Fails with the
    communicator still holding ``group`` after the destroy: the thread count does not drop. And an
    exchange on the closed communicator raises instead of running on torch's default group."""
    for during, after, refused in check_outcomes(spawn(_threads_around_close, world=2, timeout_s=60)):
        assert during - after >= 2, (during, after)  # gloo runs two worker threads per group
        assert refused is not None and "closed" in refused, refused


# a torchrun rank (as the jobs whose groups this guards are): the spawn harness's ranks come from a
# forkserver that imported torch._dynamo before any group, which is the order this test must not assume
_DYNAMO_AFTER_THE_GROUP = """
import os, sys
from cco.comm import Communicator
comm = Communicator.from_env()
first = "torch._dynamo" not in sys.modules
import torch._dynamo  # noqa: F401 (as torch.compile or a torch.library custom op's first call imports it)
comm.all_gather_object(comm.rank)
during = len(os.listdir("/proc/self/task"))
comm.close()
after = len(os.listdir("/proc/self/task"))
os.write(1, f"rank {comm.rank} dynamo-first={first} threads {during} -> {after}\\n".encode())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_close_joins_the_workers_when_dynamo_came_after_the_group(tmp_path):
    """torch._dynamo imports torch.distributed.nn.functional, whose functions take ``group.WORLD``
    as a default argument, bound at import: imported once the group exists, it holds the group past
    ``close()`` and its gloo workers to interpreter exit. ``cco.comm`` imports it before any group
    exists. Fails without that import: the thread count does not drop."""
    script = tmp_path / "dynamo_after_the_group.py"
    script.write_text(_DYNAMO_AFTER_THE_GROUP)
    proc = torchrun_two_ranks(script, timeout_s=120)
    found = re.findall(r"rank (\d) dynamo-first=(\w+) threads (\d+) -> (\d+)", proc.stdout)
    assert sorted(rank for rank, *_ in found) == ["0", "1"], proc.stdout
    for _, first, during, after in found:
        assert first == "True", "torch._dynamo was imported before the group: this test would prove nothing"
        assert int(during) - int(after) >= 2, (during, after)


def _close_after_a_timed_out_exchange(comm):
    """Rank 0's ``close()`` time after its exchange timed out against a rank that stays away."""
    import time

    from cco.transport.protocol import CommTimeoutError

    if comm.rank == 0:
        try:
            comm.gather_words([1], seq=0, timeout_s=0.5, what="an exchange rank 1 never makes")
        except CommTimeoutError:
            pass
        t0 = time.monotonic()
        comm.close()
        return time.monotonic() - t0
    time.sleep(3.5)  # away, then gone: only its exit ends rank 0's posted gather
    return None


def test_close_after_a_timed_out_exchange_does_not_wait_for_it():
    """The gather of an exchange that timed out stays posted in a gloo worker until the peer leaves
    or gloo's own timeout ends it; ``close()`` keeps that group to process exit rather than free it
    (freeing waits for the worker): it returns at once. Fails with the group freed all the same
    (``close()`` then took until rank 1 exited, ~3 s)."""
    closed, _ = check_outcomes(spawn(_close_after_a_timed_out_exchange, world=2, timeout_s=60))
    assert closed < 1.0, closed


def _window_bytes(comm):
    cfg = layout.build_config(n=384, k=256, m_max=64, world=comm.world)
    with ShmWindow(comm=comm, layout=cfg.window) as win:
        comm.barrier()  # every rank finished opening (and unlinking)
        leftovers = glob.glob("/dev/shm/cco-window-*")
        partial = win.tensor(cfg.window.partial, rank=comm.rank)
        partial.fill_(comm.rank + 1)  # write my own window...
        comm.barrier()
        seen = [float(win.tensor(cfg.window.partial, rank=r).float().mean()) for r in range(comm.world)]
        peer = (comm.rank + 1) % comm.world  # ...and a peer's
        win.words(cfg.window.header, rank=peer)[comm.rank] = 100 + comm.rank
        comm.barrier()
        header = win.words(cfg.window.header, rank=comm.rank).tolist()
    return seen, header, leftovers


def test_shm_window_moves_bytes_between_processes():
    """Guards: a 'window' that is process-local memory (every rank would read only its own)."""
    world = 3
    values = check_outcomes(spawn(_window_bytes, world=world, timeout_s=60))
    for rank, (seen, header, leftovers) in enumerate(values):
        assert seen == [float(r + 1) for r in range(world)]
        writer = (rank - 1) % world
        assert header[writer] == 100 + writer
        assert leftovers == []  # files are unlinked once every rank mapped them


def _raise_on_rank1(comm):
    if comm.rank == 1:
        raise ValueError("rank one refuses")
    return "fine"


def _die_on_rank1(comm):
    if comm.rank == 1:
        os._exit(7)
    return "fine"


def test_spawn_reports_errors_and_deaths_without_hanging():
    """One rank's error or death is reported as that rank's, and its peer still finishes: a rank
    failing right after init used to break a peer still connecting its gloo mesh ("connectFullMesh
    failed ... Connection closed by peer"; 5 of 30 runs on the 2-core CI machine) until
    ``Communicator`` ended its init with a gloo all-reduce (0 of 30)."""
    outcomes = spawn(_raise_on_rank1, world=2, timeout_s=60)
    assert outcomes[0].ok and outcomes[0].value == "fine"
    assert outcomes[1].error_type == "ValueError" and "rank one refuses" in outcomes[1].error
    outcomes = spawn(_die_on_rank1, world=2, timeout_s=60)
    assert outcomes[0].ok
    assert outcomes[1].error_type == "Died" and outcomes[1].exitcode == 7
    with pytest.raises(Exception, match="rank 1: Died"):
        check_outcomes(outcomes)


class _NotLoadable:
    """Pickles, and fails to load (as torch 2.13's pickle of an fp8 tensor does)."""

    def __reduce__(self):
        return (_fail_to_load, ())


def _fail_to_load():
    raise AttributeError("type object 'UntypedStorage' has no attribute 'dtype' (simulated)")


def _result_not_loadable_on_rank1(comm):
    return _NotLoadable() if comm.rank == 1 else comm.rank


def test_spawn_reports_a_result_the_parent_cannot_load_as_that_ranks_error():
    """Before, the parent's unpickle raised out of ``spawn`` itself: every rank's outcome was lost to
    an AttributeError from torch's unpickler."""
    outcomes = spawn(_result_not_loadable_on_rank1, world=2, timeout_s=60)
    assert outcomes[0].ok and outcomes[0].value == 0
    assert outcomes[1].error_type == "ResultNotReadable" and "t.view(torch.uint8)" in outcomes[1].error


def test_spawn_refuses_a_function_its_ranks_cannot_import():
    """The ranks import ``fn`` by name: a nested function or a lambda killed each of them before it
    reported anything, and the outcomes said only "Died ... exited with code 1"."""
    def nested(comm):
        return comm.rank

    for fn in (nested, lambda comm: comm.rank):
        with pytest.raises(TypeError, match="has no name to import by"):
            spawn(fn, world=2, timeout_s=60)


def _tp_dp(comm, tp: int):
    """TP x DP on the world: TP groups of consecutive ranks, DP groups across them (every rank
    creates every group, as torch.distributed requires)."""
    import torch.distributed as dist

    world = comm.world
    tp_groups = [dist.new_group(list(range(s, s + tp)), backend="gloo") for s in range(0, world, tp)]
    dp_groups = [dist.new_group(list(range(r, world, tp)), backend="gloo") for r in range(tp)]
    return tp_groups[comm.rank // tp], dp_groups[comm.rank % tp]


def _from_group(comm):
    tp_group, dp_group = _tp_dp(comm, 2)
    tp = Communicator.from_group(tp_group)
    dp = Communicator.from_group(dp_group)
    seen = (tp.rank, tp.world, dp.rank, dp.world, tp.launcher)
    # each group's rank 0 is the source: global rank 2 in the second TP group, rank 1 in the second DP group
    token = tp.broadcast_object(f"tp-root-{comm.rank}" if tp.rank == 0 else None)
    dp_token = dp.broadcast_object(f"dp-root-{comm.rank}" if dp.rank == 0 else None)
    gathered = tp.all_gather_object(comm.rank)
    tp.close()
    dp.close()
    try:
        Communicator(rank=tp.rank, world=2, init_method="env://")
        refusal = None
    except RuntimeError as err:
        refusal = str(err)
    return seen, token, dp_token, gathered, refusal


def test_communicator_from_a_subgroup_of_a_running_job():
    """TP 2 x DP 2 on 4 ranks: each group is a communicator of its own rank and size, its object
    collectives count ranks within the group (a broadcast from "rank 0" of the second TP group
    came from global rank 0, which is not in it, before ``broadcast_object`` mapped the source),
    closing it leaves the job's groups alone, and the plain constructor points to from_group."""
    values = check_outcomes(spawn(_from_group, world=4, timeout_s=120))
    for rank, (seen, token, dp_token, gathered, refusal) in enumerate(values):
        assert seen == (rank % 2, 2, rank // 2, 2, "group")
        assert token == f"tp-root-{rank - rank % 2}"
        assert dp_token == f"dp-root-{rank % 2}"
        assert gathered == [rank - rank % 2, rank - rank % 2 + 1]
        assert refusal is not None and "from_group" in refusal


def _not_a_member(comm):
    import torch.distributed as dist

    group = dist.new_group([0], backend="gloo")
    if comm.rank == 0:
        return Communicator.from_group(group).world
    with pytest.raises(ValueError, match="not a member"):
        Communicator.from_group(group)
    return None


def test_from_group_refuses_a_rank_outside_the_group():
    assert check_outcomes(spawn(_not_a_member, world=2, timeout_s=60)) == [1, None]


def test_from_env_without_launcher_says_how_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="torchrun.*mpirun.*spawn"):
        Communicator.from_env()


def test_torchrun_launch_runs_the_demo(tmp_path):
    """The torchrun path end to end: torch.distributed.run starts 2 ranks of the demo."""
    proc = torchrun_two_ranks("-m", "cco.demo", "--shape", "64x256x256", timeout_s=180)
    assert "launcher=torchrun world=2" in proc.stdout and "PASS" in proc.stdout, proc.stdout


def _layers_take_cpu_group(comm):
    """Both layers built with ``group`` and a gloo ``cpu_group`` of the same ranks: the bootstrap
    on ``cpu_group``, the unfused path's collectives on ``group``, and the outputs right."""
    import torch
    import torch.distributed as dist

    from cco import quant as Q
    from cco.nn import ColumnParallelLinear, RowParallelLinear, WindowPool

    group, cpu = dist.new_group([0, 1], backend="gloo"), dist.new_group([0, 1], backend="gloo")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 512, generator=g), torch.randn(8, 512, generator=g)
    found = {}
    for name, build in (("row fused", lambda: RowParallelLinear(256, 256, group=group, cpu_group=cpu, m_max=8,
                                                                pool=WindowPool())),
                        ("row unfused", lambda: RowParallelLinear(256, 256, group=group, cpu_group=cpu, m_max=8,
                                                                  mode="unfused", pool=WindowPool())),
                        ("column sp", lambda: ColumnParallelLinear(512, 128, group=group, cpu_group=cpu, m_max=8,
                                                                   sequence_parallel=True, pool=WindowPool()))):
        layer = build()
        if name.startswith("row"):
            layer.load_weight(w[:, comm.rank * 256:(comm.rank + 1) * 256])
            with torch.no_grad():
                y = layer(x[:, comm.rank * 256:(comm.rank + 1) * 256])
            ref = x @ w.t()
        else:
            layer.load_weight(w[comm.rank * 128:(comm.rank + 1) * 128])
            with torch.no_grad():
                y = layer(x[comm.rank * 4:(comm.rank + 1) * 4])
            ref = x @ w[comm.rank * 128:(comm.rank + 1) * 128].t()
        found[name] = (layer.comm.group is cpu, layer._reduce_group is group, Q.rel_l2(y, ref))
        layer.close()
    try:
        RowParallelLinear(256, 256, group=Communicator.from_group(group), cpu_group=cpu, m_max=8, pool=WindowPool())
        found["communicator and cpu_group"] = "built"
    except ValueError as err:
        found["communicator and cpu_group"] = str(err)
    return found


def test_layers_take_a_cpu_group_beside_their_group():
    """The README and the guide tell a job whose TP group is NCCL-only to pass ``cpu_group=``; the
    layers took no such argument (TypeError), so the advice could only be followed by building the
    communicator by hand. Now both layers pass it to ``Communicator.from_group``."""
    for found in check_outcomes(spawn(_layers_take_cpu_group, world=2, timeout_s=120)):
        for name in ("row fused", "row unfused", "column sp"):
            bootstrap, reduce, err = found[name]
            assert bootstrap and reduce and err < 0.1, (name, found[name])
        assert "cpu_group goes with a torch.distributed group" in found["communicator and cpu_group"]


def _exchanges(comm, case):
    """Two exchanges per rank (``gather_words``), as ``case`` staggers them; each one's words or
    its error (type, and whether the message says what the test looks for)."""
    import time

    found = []

    def exchange(seq, timeout_s=2.0):
        try:
            found.append(("words", comm.gather_words([comm.rank, seq], seq=seq, timeout_s=timeout_s, what="test")))
        except Exception as err:
            found.append((type(err).__name__, getattr(err, "behind", None), str(err)))

    if case == "late":  # rank 1 enters past the late bound of a 1.2 s timeout (0.9 s), within the timeout
        time.sleep(1.05 if comm.rank == 1 else 0)
        exchange(1, timeout_s=1.2)
    elif case == "a little late":  # within the bound
        time.sleep(0.3 if comm.rank == 1 else 0)
        exchange(1)
    elif case == "behind":  # the last rank's exchange of call 4 meets the others' of call 5 (they made call 4 alone)
        if comm.rank == comm.world - 1:
            exchange(4)
    exchange(5)
    return found


def test_an_exchange_entered_past_the_late_bound_fails_on_every_rank():
    """A rank entering a gather_words exchange later than the timeout's late bound after the first
    (here 1.05 s into 1.2 s: the gather still completes on rank 0) raises CommTimeoutError on every
    rank, not only on those whose wait ended; the next exchange is in step. Within the bound the
    words come back (0.3 s into 2 s)."""
    from cco.comm import late_bound

    assert late_bound(1.2) == pytest.approx(0.9) and late_bound(60.0) == 55.0  # a quarter, at most 5 s
    for rank, found in enumerate(check_outcomes(spawn(_exchanges, world=2, args=("late",), timeout_s=60))):
        assert found[0][0] == "CommTimeoutError" and "rank 1 entered this exchange" in found[0][2], (rank, found)
        assert found[1] == ("words", [[0, 5], [1, 5]]), (rank, found)
    for found in check_outcomes(spawn(_exchanges, world=2, args=("a little late",), timeout_s=60)):
        assert found == [("words", [[0, 1], [1, 1]]), ("words", [[0, 5], [1, 5]])], found


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_behind_its_peers_raises_how_far_and_the_peers_exchange_again(world):
    """The last rank's exchange of call 4 meets the others' of call 5: it is one call behind and
    raises PeerMismatchError with ``behind`` 1 (a layer then takes part in the missed op call); the
    others, at the highest seq, post their exchange again, which meets its next one (call 5): they
    return those words, and nothing was lost on any rank."""
    *ahead, last = check_outcomes(spawn(_exchanges, world=world, args=("behind",), timeout_s=60))
    want = ("words", [[r, 5] for r in range(world)])
    assert ahead == [[want]] * (world - 1), ahead
    assert last[0][:2] == ("PeerMismatchError", 1) and "1 call(s) behind" in last[0][2], last
    assert last[1] == want, last


def test_an_ipc_window_frees_its_own_allocation_only_once_every_peer_unmapped_it(monkeypatch):
    """Guards freeing an exported allocation while a peer still maps it (undefined in CUDA IPC; a rank
    that closed its op early while a peer still calls and writes into its window): the bookkeeping of
    ``IpcWindow`` close with the driver's calls replaced, two ranks' windows in one process over one
    store. Freed at once, rank 0's allocation would be gone while rank 1 maps it."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import cco.window as W
    from cco.cuda import memops

    freed, unmapped = [], []
    monkeypatch.setattr(memops, "mem_free", freed.append)
    monkeypatch.setattr(memops, "ipc_close", unmapped.append)
    monkeypatch.setattr(W, "_UNFREED", [])
    comm = SimpleNamespace(store=dist.HashStore())

    def window(rank: int):  # what IpcWindow.__init__ leaves after mapping: own 10 + rank, the peer's at 20 + rank
        w = object.__new__(W.IpcWindow)
        w.comm, w.rank, w.world, w._closed, w._peers = comm, rank, 2, False, []
        w._own, w._opened, w._unmapped_key = 10 + rank, [20 + rank], "cco/ipc/test/unmapped/"
        return w

    first, second = window(0), window(1)
    first.close()
    assert unmapped == [20] and freed == []  # rank 1 still maps rank 0's allocation: kept
    second.close()
    assert unmapped == [20, 21] and sorted(freed) == [10, 11]  # every mapping gone: both freed
    assert W._UNFREED == []
