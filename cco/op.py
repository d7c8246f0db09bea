"""GemmAllReduceOp: fp8 GEMM + all-reduce of the partial products of tensor-parallel ranks; and the
call machinery every collective pattern shares (:class:`CollectiveGemmOp`: construction, seq,
checks, rejected calls, the collective call, ``check``, the self test, ``close``), on which
``cco.reduce_scatter.GemmReduceScatterOp`` and ``cco.all_gather.AllGatherGemmOp`` run too. The
contracts below hold for every pattern (``cco.layout.PATTERNS``); each op states its output.

Unfused equivalent, on every rank::

    partial = reference_gemm(a, unshuffle_b(b_pre), a_scale, b_scale, quant)   # bf16 [M, N]
    out = all_reduce(partial, op=SUM)                                            # bf16 [M, N]

``mode="fused"`` overlaps the scatter with the GEMM: tiles are written straight into a symmetric
window and each completed (dest, chunk) slice moves while later tiles are computed::

    GEMM     |c0:d1 d2 .. d0|c1:d1 d2 .. d0|c2 ...|
    scatter        |c0 -> owners |c1 -> owners |c2 ...|
    reduce+gather                                      |c0 c1 c2 ...|

With ``transport="lsa"`` on CUDA one kernel does it all: its epilogue stores each tile into its
owner, reduces the own tiles as the peers' tiles land and stores the results into every peer;
``transport="auto"`` (the CUDA default) takes that kernel at small M and the copy engines above.

``mode="split"`` runs the same GEMM and the same transfers one after the other (the baseline);
``mode="gemm-only"`` returns the local partial without communication. With one rank (world 1) the
all-reduce is the identity: ``fused`` and ``split`` calls run the plain GEMM into the output and touch
no window (with ``gather_dtype="fp8"`` too: nothing is gathered, so nothing is rounded to fp8).
mori's arm names (``gemm-only``, ``split-sdma``, ``fused-sdma``, ``split-lsa``, ``fused-lsa``) are
accepted as modes.

Contracts:
- Collective: every rank calls ``__call__`` (and ``self_test``) in the same order with the same M.
  A failed call still counts: each rank makes the same sequence of calls, failed or not.
- Output: a new bf16 ``[M, N]`` tensor per call, identical on every rank; it never aliases the window.
- Errors instead of hangs, on every backend: a call's waits share a deadline (``deadline_s``);
  passing it raises :class:`CommTimeoutError` on every live rank, naming the rank, the peer, the
  chunk (where it can be told) and the call's seq. The CPU backend waits on the host and raises in
  the call. On CUDA and gfx950 the call is asynchronous: a watchdog thread per op
  (``cco.cuda.watchdog``) releases its device-side waits once the deadline passes, so nothing stays
  blocked on the GPU and the CUDA context stays usable; the output of the released call is NaN
  (never an earlier call's numbers), the op is failed from then on, and the error is raised by
  ``check()`` (which synchronizes) and by every later call. A call captured in a CUDA graph is
  watched at every replay alike (its device work writes the watchdog's marks): after a replay,
  ``check()`` synchronizes the caller's current stream and waits until the replayed call has left
  (bounded by the deadline), then raises what it recorded; nothing else on the host sees a replay
  (replayed on another stream: synchronize that one first). A peer's watchdog tells this rank's, so
  a rank whose own waits were fine fails its next call too. Read an output on the host (``.cpu()``)
  after ``check()``: a read before it returns by the deadline too, but while it waits in the driver
  the release's NaN fill cannot land, so on the copy-engine path only this rank's own columns of
  the released output are NaN (the rest may hold stale bytes); ``check()`` raises either way
  (docs/experiments.md, "Faults and deadlines on the GPU"). Close a failed op and build a new one
  (and a new communicator if a rank died); its window stays mapped until the process exits (a peer
  late for the failed call may still write into it).
- Rejected inputs: a call whose inputs fail validation (TypeError / ValueError naming the argument)
  is still a collective call: it consumes a seq on every rank. The rejecting rank takes part (it
  publishes a "rejected" (seq, M) stamp where its M would go, and on CUDA runs the call on NaN data
  with its peers' M, so every word a peer waits on is released and consumed once) and raises its
  own error; every peer raises :class:`PeerRejectedError` naming that rank and its reason. The
  ranks stay in step and the next call works on every rank. So does a call whose own work fails
  on one rank after the checks and before the call takes its seq (its output's allocation): that
  rank takes part as a rejected call too (before, its next call took the seq and paired with its
  peers' call: a result of two calls; tests/python/cco/test_local_failures.py).
- Mismatched M: a rank whose M differs from its peers' makes every rank raise
  :class:`PeerMismatchError` naming both Ms (each rank's chunks carry its (seq, M) stamp, and a
  failing rank still delivers the chunks it completed). CPU: raised by the call. CUDA: the call's
  output is NaN and the error is raised by ``check()`` and by the first call issued once the host
  knows it (that call takes part in the collective first, so the ranks stay in step, and raises
  instead of returning); where the ranks' Ms give different chunk counts, a wait passes its
  deadline and the op is failed as above.
- Recovery (CPU backend): call ``seq`` starts on a rank (publishes anything, starts its deadline)
  only once every peer has left call ``seq - 1``, waiting up to ``2 * deadline_s`` for that; and a
  rank that fails a call leaves it only once every peer that entered it has left it too (up to
  ``deadline_s`` more; a peer that never entered the call or whose process exited is not waited
  for). So no rank's next call overwrites the stamps, flags or data a slower peer still reads to
  reach its own verdict, and a peer still timing out the previous call does not eat into the next
  call's deadline. After any failed call in which every rank stayed alive and reached the call
  within its deadline (a mismatched M, a lost put, rejected inputs), the next call works on every
  rank, whether the peers returned or raised the failed one. Later than that, the ranks fail calls
  until they are back in step; a rank that died leaves the op unusable: rebuild it (and the
  communicator).
- Graph safety: no host-side reset runs between calls or graph replays. Waits compare flags against
  the call's seq, so a word left by an earlier (even failed) call never completes a later one. The
  CPU backend never resets a word (counter targets grow by a known amount per call); the CUDA
  backend zeroes each counter at call start and each flag right after its single waiter reads it,
  inside the captured work, because a stream wait's target is baked into a captured CUDA graph.
- Cleanup: ``close()`` (idempotent, not collective) or ``with``; it does not close ``comm``. Close
  on every rank at the same point: a peer's later call waits out its deadline, and its
  ``CommTimeoutError`` then carries a note naming the rank that closed and its last call (the rank
  leaves it in the store at close: ``cco.transport.reasons.PeerNotes``), not only "stalled, died or
  lost a put".
"""

from __future__ import annotations

import functools
import secrets
import weakref

import torch

from cco import layout
from cco.backends.base import KEPT_WEIGHTS
from cco.preshuffle import LAYOUT_MARK
from cco.transport.protocol import (CommTimeoutError, PeerMismatchError, PeerRejectedError, SelfTestError,
                                    TransferError)
from cco.transport.reasons import PeerNotes, note_closed_peers
from cco.validate import check_operands
from cco.window import open_window

DEFAULT_DEADLINE_S = 60.0  # per call; generous because a GPU backend's first call may JIT-compile
_FN = "GemmAllReduceOp"
# windows of closed ops whose backend must keep them mapped (a failed GPU call: a late peer may
# still write into them); they are released when the process exits
_RETAINED_WINDOWS: list = []
# operand signatures (dtypes, shapes, strides, devices) an op remembers as accepted, plain calls'
# plans it keeps (one per M), and collective calls' shapes (one per M: what a plan takes from M
# alone): an eager call must not pay the full checks and a plan every time (docs/hopper_gemm.md: the
# host time of an eager call)
ACCEPTED_SIGNATURES = 16
PLAIN_PLANS = 64
CALL_SHAPES = 64


class _KeptLaunches:
    """What a plain call (gemm-only, or one rank) needs beyond its GEMM, or a collective call
    beyond its plan (the backend's ``fused_launcher``: the lsa kernel's launch at world >= 2), kept
    per weight while the weight is the same: per activation layout, the backend's launch with the
    weight bound (``Backend.plain_launcher``; where it has none, ``gemm_out`` with the plan of the
    call's M bound; a collective call's kept launch runs the op's call machinery around it,
    ``CollectiveGemmOp._kept_collective``). The weight is "the same" while the caller passes the same two tensor objects with the
    same version counters (every in-place change of data or metadata bumps them) and addresses
    (``t.data = other`` bumps no counter but moves the bytes: the aliases held here keep the old
    ones taken). So an eager call at decode sizes pays one small tuple's lookup, not the full
    checks, the rule and the weight's key (docs/hopper_gemm.md).

    One entry per weight (up to ``KEPT_WEIGHTS``): the layers of one shape share one op
    (``cco.nn.WindowPool``), and a model calls them in turn, so an op that kept only the last weight
    would miss on every call of a decode step (docs/decode.md). An entry lives as long as its weight
    tensor objects: it holds them weakly and is dropped when either dies (a trainable layer's
    weight, quantized afresh every step, leaves no entries behind), so an ``id`` in the key always
    names the live tensor it was taken from. It holds what its launches bound (mxfp8 on Hopper: the
    weight's bf16 copy, ``kernels_fused.hopper.vendor.prepare_weight``).

    The lookup is keyed by the activations' shapes and strides only, and the entry holds the dtypes
    and the device that passed the checks, compared by identity and equality: hashing a dtype or a
    device costs more than the rest of the lookup (~0.3 us of ~1 us on a CPU host)."""

    def __init__(self, backend, device: torch.device):
        self.backend, self.device = backend, device
        # (id(b_pre), id(b_scale)) -> (weight, by_layout): weight = (weak references to b_pre and
        # b_scale, their versions and addresses, aliases, the backend's plain_epoch); by_layout:
        # _activation_layout -> (a dtype, a_scale dtype, launch)
        self.weights: dict = {}

    def clear(self) -> None:
        self.weights = {}

    def _holds(self, w, b_pre, b_scale) -> bool:
        """Whether the kept weight ``w`` is these weight tensors, unchanged since, under the backend's
        current ``plain_epoch``."""
        return w[0]() is b_pre and w[1]() is b_scale and b_pre._version == w[2] and b_scale._version == w[3] and \
            b_pre.data_ptr() == w[4] and b_scale.data_ptr() == w[5] and w[7] == self.backend.plain_epoch

    def launch_for(self, a, b_pre, a_scale, b_scale):
        """The kept launch of an accepted call like this one, or None. (``_holds`` and
        ``_activation_layout`` written out: each frame costs an eager call ~0.2 us on an H200 host;
        tests/python/cco/test_plain_launches.py holds both copies to the same cases.)"""
        entry = self.weights.get((id(b_pre), id(b_scale)))
        if entry is None:
            return None
        w = entry[0]
        if not (w[0]() is b_pre and w[1]() is b_scale and b_pre._version == w[2] and b_scale._version == w[3]
                and b_pre.data_ptr() == w[4] and b_scale.data_ptr() == w[5] and w[7] == self.backend.plain_epoch):
            return None
        try:
            kept = entry[1].get((a.shape, a.stride(), a_scale.shape, a_scale.stride()))
            if kept is None or a.dtype is not kept[0] or a_scale.dtype is not kept[1] or \
                    a.device != self.device or a_scale.device != self.device:
                return None
        except AttributeError:  # not a tensor: the full checks say which argument
            return None
        return kept[2]

    def known(self, b_pre, b_scale) -> bool:
        """Whether this weight was kept before and is unchanged since; if not, it is kept from now on
        (with no launch yet). A caller for whom keeping a launch costs more than one call (a
        collective call's bound launch) keeps one only for a weight that comes back: a trainable
        layer's weight, quantized afresh for each call, never does."""
        return self._entry(b_pre, b_scale)[1]

    def keep(self, a, b_pre, a_scale, b_scale, launch) -> None:
        """Keep ``launch(a, a_scale)`` for calls like this accepted one (its operands passed ``_check``)."""
        by_layout = self._entry(b_pre, b_scale)[0][1]
        if len(by_layout) >= ACCEPTED_SIGNATURES:
            by_layout.clear()
        by_layout[_activation_layout(a, a_scale)] = (a.dtype, a_scale.dtype, launch)

    def _entry(self, b_pre, b_scale) -> tuple:
        """(this weight's entry, whether it was kept and unchanged): a new entry where it had none or
        it changed (its other Ms' launches were the old weight's)."""
        key = (id(b_pre), id(b_scale))
        entry = self.weights.get(key)
        if entry is not None and self._holds(entry[0], b_pre, b_scale):
            return entry, True
        return self._new_entry(key, b_pre, b_scale, replaces=entry is not None), False

    def _new_entry(self, key, b_pre, b_scale, *, replaces: bool):
        """A new entry for this weight at ``key``, in place of a changed one where it ``replaces``
        one, else in a new place (the oldest weight's where ``KEPT_WEIGHTS`` are kept)."""
        if not replaces and len(self.weights) >= KEPT_WEIGHTS:
            self.weights.pop(next(iter(self.weights)))
        weights = self.weights

        def drop(_, key=key):  # either weight tensor died: its entry (and what it bound) goes
            weights.pop(key, None)
        weight = (weakref.ref(b_pre, drop), weakref.ref(b_scale, drop), b_pre._version, b_scale._version,
                  b_pre.data_ptr(), b_scale.data_ptr(), (b_pre.detach(), b_scale.detach()), self.backend.plain_epoch)
        entry = weights[key] = (weight, {})
        return entry


def _activation_layout(a, a_scale) -> tuple:
    """The activations' shapes and strides: the part of their signature that is cheap to hash."""
    return a.shape, a.stride(), a_scale.shape, a_scale.stride()


def _signature(a, b_pre, a_scale, b_scale) -> tuple:
    """What ``_check``'s verdict depends on, for each operand (AttributeError: not a tensor; no
    types: the checks take any torch.Tensor subclass alike, and an eager collective call pays for
    each item)."""
    return (a.dtype, a.shape, a.stride(), a.device, a_scale.dtype, a_scale.shape, a_scale.stride(), a_scale.device,
            b_pre.dtype, b_pre.shape, b_pre.stride(), b_pre.device,
            b_scale.dtype, b_scale.shape, b_scale.stride(), b_scale.device)


def select_backend(device: torch.device):
    """The backend class for ``device``: CPU reference, NVIDIA (Triton), or gfx950 (FlyDSL)."""
    device = torch.device(device)
    if device.type == "cpu":
        from cco.backends.cpu import CpuBackend
        return CpuBackend
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        if arch != "gfx950":
            raise ValueError(f"{_FN}: ROCm device {device} is {arch}; the fused kernel targets gfx950 (MI355X)")
        from cco.backends.gfx950 import Gfx950Backend  # its kernel needs flydsl
        return Gfx950Backend
    if device.type == "cuda":
        from cco.backends.cuda import CudaBackend  # needs triton
        return CudaBackend
    raise ValueError(f"{_FN}: device {device} is not supported; use a CPU, NVIDIA or gfx950 device")


def _configure(comm, fn: str, pattern: str, a: dict):
    """(backend class, :class:`cco.layout.OpConfig`) for the constructor's arguments ``a`` on
    ``comm``'s device, or the error (ValueError / TypeError / NotImplementedError: a backend that
    does not run the pattern) that names the argument at fault."""
    backend_cls = select_backend(comm.device)
    block_m, block_n = backend_cls.tile(a["quant"])
    chunks = a["chunks"]
    try:
        config = layout.build_config(
            n=a["n"], k=a["k"], m_max=a["m_max"], world=comm.world, quant=a["quant"], mode=a["mode"],
            transport=a["transport"], gather_dtype=a["gather_dtype"],
            chunks=backend_cls.default_chunks if chunks is None else chunks, block_m=block_m, block_n=block_n,
            default_transport=backend_cls.default_transport, weight_layout=a["weight_layout"], pattern=pattern)
    except ValueError as err:
        raise ValueError(f"{fn}: {err}") from None
    refused = backend_cls.config_error(config)  # before a window is opened for it
    if refused is not None:
        raise type(refused)(f"{fn}: {refused}")
    if not a["deadline_s"] > 0:
        raise ValueError(f"{fn}: deadline_s={a['deadline_s']!r} must be > 0 seconds")
    return backend_cls, config


# the errors of a collective call that name ranks, peers and steps but not the op (the self test's
# and the argument checks' errors start with the op's name)
_TRANSPORT_ERRORS = (CommTimeoutError, PeerMismatchError, TransferError)


class CollectiveGemmOp:
    """The call machinery every pattern shares (``cco.layout.PATTERNS``): construction (config,
    backend, window), the call sequence, operand checks, rejected calls, the collective call with
    its counter bookkeeping, ``check``, the self test's scaffolding, ``close``. A pattern's op
    (:class:`GemmAllReduceOp`, ``cco.reduce_scatter.GemmReduceScatterOp``,
    ``cco.all_gather.AllGatherGemmOp``) adds its public constructor, its output and its self-test
    probe; the layout and the backend read the pattern from ``config.pattern``.

    Contracts (collective order, rejected calls, mismatched M, recovery, graph safety, cleanup):
    the module docstring's, for every pattern alike."""

    _FN: str = "CollectiveGemmOp"  # the public class's name, which prefixes every error

    def __init__(self, comm, *, pattern: str, arguments: dict, faults=None, error: Exception | None = None):
        """``arguments``: the public constructor's arguments by name (n, k, m_max, quant, mode,
        transport, gather_dtype, chunks, deadline_s, weight_layout, and the pattern's own): the one
        place they are together, before any window is mapped (where the ranks agree on them).
        ``error``: the pattern's own refusal of its arguments, raised through the agreement as any
        other (a rank that raised before it would leave its peers waiting in it)."""
        fn = self._FN
        self.comm = comm
        self._closed = True
        self.arguments = dict(arguments)
        if error is None:
            try:
                backend_cls, self.config = _configure(comm, fn, pattern, self.arguments)
            except (TypeError, ValueError, NotImplementedError) as err:
                error = err
        # construction is collective: every rank agrees on the arguments before any window is mapped
        # (faults is a test's per-rank injection, not an argument of the collective)
        comm.agree(fn, {**self.arguments, "pattern": pattern}, error=error)
        deadline_s = self.arguments["deadline_s"]
        self.deadline_s = float(deadline_s)
        self.rank, self.world = comm.rank, comm.world
        self._seq = 0
        self._tag = 0  # the caller's tag of the call in progress (__call__'s ``tag``), stamped with its (seq, M)
        self._counter_base = layout.zero_counters(self.world)
        notes = None
        if self.world > 1 and self.config.mode != "gemm-only":  # the same key prefix on every rank
            notes = PeerNotes(comm, comm.broadcast_object(secrets.token_hex(8) if self.rank == 0 else None))
        self._notes = notes
        self._accepted: set = set()  # operand signatures that passed _check
        # gemm-only, or one rank (the collective is the identity): the plain GEMM writes ``out``
        self._plain = not self.config.publishes
        self._alone = self.world == 1 and self.config.mode != "gemm-only"  # a plain call that counts as a call
        self._plain_plans: dict = {}
        self._call_shapes: dict = {}  # M -> layout.call_shape, for a collective call's plan
        self.window = open_window(comm=comm, layout=self.config.window)
        try:
            self._backend = backend_cls(config=self.config, comm=comm, window=self.window,
                                        deadline_s=self.deadline_s, faults=faults, notes=notes)
        except BaseException:
            self.window.close()
            raise
        self._launches = _KeptLaunches(self._backend, comm.device)
        self._closed = False

    # ---- shape helpers ------------------------------------------------------------------------------
    def padded_m(self, m: int) -> int:
        """Rows the kernel computes for ``m`` rows (whole m-tiles)."""
        return layout.padded_m(m, self.config.block_m)

    def pad_rows(self, m: int) -> int:
        """Zero rows a caller may append to ``a`` so that M fills whole tiles (never required)."""
        return self.padded_m(m) - m

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def transport(self) -> str:
        return self.config.transport

    @property
    def pattern(self) -> str:
        return self.config.pattern

    @property
    def publishes(self) -> bool:
        """Whether calls move data between ranks (``cco.layout.publishes``): not with
        ``mode="gemm-only"`` nor with one rank, where the window maps no data planes and
        :meth:`self_test` has nothing to test."""
        return not self._plain

    @property
    def calls(self) -> int:
        """Collective calls so far (the seq of the last one)."""
        return self._seq

    # ---- the op -------------------------------------------------------------------------------------
    def _check(self, a, b_pre, a_scale, b_scale, fn: str) -> int:
        marked = getattr(b_pre, LAYOUT_MARK, None)  # (not part of the signature: kept per tensor object)
        if marked is not None and marked != self.config.weight_layout:
            raise ValueError(f"{fn}: b_pre is a {marked} weight (made by "
                             f"{'preshuffle_b' if marked == 'bpreshuffle' else 'quantize_b or unshuffle_b'}) but the "
                             f"op was built with weight_layout={self.config.weight_layout!r}; pass "
                             f"{'preshuffle_b(w)' if self.config.weight_layout == 'bpreshuffle' else 'the row-major weight'}"
                             f" or build the op with weight_layout={marked!r}")
        try:
            signature = _signature(a, b_pre, a_scale, b_scale)
        except AttributeError:  # not a tensor: the checks below say which argument
            signature = None
        if signature in self._accepted:
            return a.shape[0]
        shape = check_operands(a, b_pre, a_scale, b_scale, quant=self.config.quant, fn=fn)
        cfg = self.config
        if (shape.n, shape.k) != (cfg.n, cfg.k):
            raise ValueError(f"{fn}: b_pre is [N={shape.n}, K={shape.k}] but the op was built for "
                             f"n={cfg.n}, k={cfg.k}; build an op per weight shape")
        rows_error = layout.call_rows_error(cfg, shape.m)
        if rows_error is not None:
            raise ValueError(f"{fn}: {rows_error}")
        if a.device != self.comm.device:
            raise ValueError(f"{fn}: a is on {a.device} but the op runs on {self.comm.device}; move the operands")
        if signature is not None:
            if len(self._accepted) >= ACCEPTED_SIGNATURES:
                self._accepted.clear()
            self._accepted.add(signature)
        return shape.m

    def _plain_plan(self, m: int) -> layout.CallPlan:
        """The plan of a plain call with ``m`` rows, kept per M: it only supplies the tile walk (a
        plain call publishes nothing, so its seq and counter targets are never read)."""
        plan = self._plain_plans.get(m)
        if plan is None:
            if len(self._plain_plans) >= PLAIN_PLANS:
                self._plain_plans.pop(next(iter(self._plain_plans)))
            plan = self._plain_plans[m] = layout.plan_call(self.config, m=m, seq=1, rank=self.rank,
                                                           counter_base=layout.zero_counters(self.world))
        return plan

    def _plain_call(self, a, b_pre, a_scale, b_scale, m: int) -> torch.Tensor:
        """Nothing is published. One rank: the collective is the identity, so the plain GEMM writes
        ``out`` (a call all the same). ``m``: the checked operands' rows."""
        launch = self._backend.plain_launcher(b_pre, b_scale, m)
        if launch is None:
            backend, plan, weight = self._backend, self._plain_plan(m), weakref.ref(b_pre)

            def launch(a, a_scale):  # kept only while b_pre and b_scale are these very tensors (held
                return backend.gemm_out(a, weight(), a_scale, b_scale, plan=plan)  # weakly: see _KeptLaunches)
        self._launches.keep(a, b_pre, a_scale, b_scale, launch)
        self._seq += self._alone
        return launch(a, a_scale)

    def _call(self, a, b_pre, a_scale, b_scale, run):
        """One call without a kept plain launch (a pattern's ``__call__`` looks that up first, inline:
        an eager call pays for every frame): the plain GEMM (gemm-only, one rank), or
        ``run(a, b_pre, a_scale, b_scale, m)`` (the pattern's collective body, which calls
        :meth:`_collective`) once the operands passed the checks; a rank whose operands fail them
        still takes part (:meth:`_reject`) and raises its error."""
        if self._closed:
            raise RuntimeError(f"{self._FN}.__call__: the op is closed; build a new {self._FN}")
        collective = not self._plain
        if collective:
            self._raise_failed()
        try:
            m = self._check(a, b_pre, a_scale, b_scale, f"{self._FN}.__call__")
            if not layout.valid_tag(self._tag):
                raise ValueError(f"{self._FN}.__call__: tag={self._tag!r} must be an int in 0..{layout.CALL_TAGS - 1}")
        except (TypeError, ValueError) as err:
            if collective:  # still a collective call: the peers fail it too and stay in step
                self._reject(err)
            raise
        if self._plain:
            return self._plain_call(a, b_pre, a_scale, b_scale, m)
        return self._run_call(run, a, b_pre, a_scale, b_scale, m)

    def _run_call(self, run, a, b_pre, a_scale, b_scale, m: int):
        """``run(a, b_pre, a_scale, b_scale, m)``, a collective call's body on operands that passed
        the checks (:meth:`_call`, or a kept launch's own test of them), and what it deferred."""
        seq = self._seq
        try:
            out = run(a, b_pre, a_scale, b_scale, m)
        except Exception as err:
            if self._seq == seq:
                # this rank's own work failed before the call took its seq (the output's allocation,
                # on this rank alone): take part in the call as a rejected one, or this rank's next
                # call would take this seq and pair with the peers' this one (a result of two calls)
                self._reject(err)
            self._note_error(err)
            raise
        self._backend.raise_deferred()
        return out

    def _raise_failed(self) -> None:
        """The backend's ``raise_failed`` (a failed op's error, at its next call), its error noted as
        :meth:`_note_error` notes it."""
        try:
            self._backend.raise_failed()
        except Exception as err:
            self._note_error(err)
            raise

    def _note_error(self, err: BaseException) -> None:
        """Where ``err`` is a timeout, say which peers had closed their op before this rank's calls
        (``PeerNotes.closed``): "stalled, died or lost a put" was all such a timeout could say. And
        where it is the transport's (a peer's mismatch or rejection, a timeout, a lost transfer), name
        this op: those errors name the rank, the peer and the step, and a job holds an op per weight
        shape. Once per error object (a failed op raises the same error again)."""
        note_closed_peers(err, self._notes, rank=self.rank, world=self.world, seq=self._seq, what=self._FN,
                          tag=self._tag)
        if isinstance(err, _TRANSPORT_ERRORS) and not getattr(err, "_cco_op_named", False):
            err._cco_op_named = True
            err.add_note(f"(raised by {self!r}; its last call: seq {self._seq}"
                         f"{f', layer tag {self._tag}' if self._tag else ''})")

    def note_layer_closed(self, tag: int) -> None:
        """Leave a note for the peers that this rank's caller ``tag`` (a ``cco.nn`` layer of the family
        sharing this op) is closed, the op staying open: a peer's later call of that layer waits out
        its deadline, and its ``CommTimeoutError`` then names this rank and the layer
        (:func:`note_closed_peers`). Local; best effort, bounded."""
        if self._notes is not None and not self._closed:
            self._notes.post_closed_layer(rank=self.rank, tag=tag, seq=self._seq)

    def reject(self, error: Exception) -> None:
        """Take part in this rank's next collective call as a rejected one: for a caller (a layer)
        whose own checks failed before it could call the op, so that its peers fail that call with
        :class:`PeerRejectedError` naming this rank and ``error`` instead of waiting it out or pairing
        it with this rank's next call. Nothing to do where no call is collective (``gemm-only``, one
        rank). The caller raises ``error`` itself afterwards."""
        if self._closed:
            raise RuntimeError(f"{self._FN}.reject: the op is closed; build a new {self._FN}")
        if not self._plain:
            self._reject(error)

    def _reject(self, err: Exception) -> None:
        """This rank's inputs to the next call failed validation with ``err``: take part in the call
        all the same (it consumes a seq on every rank), so every peer fails it with
        ``PeerRejectedError`` naming this rank and ``err``, instead of pairing its next call with
        this rank's next one. Whatever goes wrong on the way is added to ``err`` as a note."""
        seq = self._seq = self._seq + 1
        base = self._counter_base  # no tile of this call is written here: the counters stay put

        def plan_for(m: int) -> layout.CallPlan:
            return layout.plan_call(self.config, m=m, seq=seq, rank=self.rank, counter_base=base)

        try:
            self._backend.reject(seq=seq, error=err, plan_for=plan_for)
        except Exception as problem:  # the caller's own error stays the one raised
            err.add_note(f"{self._FN}: rank {self.rank} could not take part in call seq {seq} it rejected: "
                         f"{type(problem).__name__}: {problem}")

    def _collective(self, body, m: int, tag: int = 0):
        """Run one collective call with the next seq, stamped with the caller's ``tag``; on failure
        bring the own counters to the call's targets (no tile of it is in flight any more) so the
        next call's targets hold."""
        shape = self._call_shapes.get(m)
        if shape is None:  # what the plan takes from M alone, kept per M (layout.plan_call hashes the config)
            if len(self._call_shapes) >= CALL_SHAPES:
                self._call_shapes.clear()
            shape = self._call_shapes[m] = layout.call_shape(self.config, m, self.rank)
        plan = layout.plan_from(shape, seq=self._seq + 1, counter_base=self._counter_base, tag=tag)
        self._seq, self._counter_base = plan.seq, plan.counter_targets
        try:
            return body(plan)
        except BaseException:
            counters = self.window.words(self.config.window.counters, rank=self.rank)
            for dest in range(self.world):
                for chunk in range(layout.MAX_CHUNKS):
                    counters[layout.counter_index(dest, chunk)] = plan.counter_targets[dest][chunk]
            raise

    def check(self) -> None:
        """Wait for the calls issued so far and raise what an asynchronous backend recorded: a
        call released at its deadline (``CommTimeoutError``, the op is then failed), a peer's
        mismatched M (``PeerMismatchError``) or rejected inputs (``PeerRejectedError``). The wait is
        bounded by the deadline. The CPU backend raises inside the call itself. After :meth:`close`
        it raises ``RuntimeError`` (the backend that recorded the calls is gone: check before closing)."""
        if self._closed:
            raise RuntimeError(f"{self._FN}.check: the op is closed; call check() before close() to see what its "
                               f"calls recorded")
        try:
            self._backend.check()
        except Exception as err:
            self._note_error(err)
            raise

    def vendor_weight(self, b_pre, b_scale):
        """The weight ``(b_pre, b_scale)`` as the backend's vendor GEMM holds it, kept per weight
        (``Backend.vendor_weight``; None where there is none). Local, not a collective call, and
        unchecked: the caller's own weight of this op's shape (``cco.nn``'s decode path reads
        mxfp8's bf16 copy from it, the one the op's own calls read)."""
        return self._backend.vendor_weight(b_pre, b_scale)

    # ---- self test ----------------------------------------------------------------------------------
    def self_test(self, *, m: int | None = None) -> dict:
        """Prove bytes really move between ranks (collective).

        Every rank fills what its transfers send with a pattern that names (source, row, column,
        seq), poisons what it receives with NaN, then runs the op's transfers alone. It checks that
        every peer's data arrived bit-exact and (where the pattern reduces) that the output equals
        the pattern's exact sum. A transport that signals without moving data leaves NaN and fails;
        every rank raises :class:`SelfTestError` if any rank failed. Returns what was checked.

        ``m`` given: the path calls with ``m`` rows take. ``m=None``: every path the op can take
        (the most rows a call may pass, and under ``transport="auto"`` on CUDA also the most rows
        the lsa kernel takes), one collective run each; the result lists them under ``"runs"``.

        An op that moves nothing (``mode="gemm-only"``, or one rank: :attr:`publishes` false) raises
        ``RuntimeError`` saying so; code that runs at any TP size calls ``if op.publishes:
        op.self_test()``.
        """
        fn = f"{self._FN}.self_test"
        if not self.publishes:  # (the same on every rank: agreed at construction)
            why = "mode 'gemm-only'" if self.config.mode == "gemm-only" else "one rank (world 1)"
            raise RuntimeError(f"{fn}: {why} moves no data and maps no data planes; there is nothing to test")
        error = None
        if self._closed:
            error = RuntimeError(f"{fn}: the op is closed")
        elif m is not None:
            # (past m_max call_rows_error says so itself)
            why = (layout.call_rows_error(self.config, m) if isinstance(m, int) and m >= 1
                   else layout.call_rows_allowed(self.config))
            if why is not None:
                error = ValueError(f"{fn}: m={m} must be rows a call may pass: {why}")
        try:
            self._agree_self_test(fn, m, error)
            rows = [m] if m is not None else [self._probe_rows(r) for r in self._backend.path_rows()]
            runs = [self._self_test_rows(r, fn) for r in rows]
        except Exception as err:
            self._note_error(err)
            raise
        return {**runs[0], "runs": runs}

    def _agree_self_test(self, fn: str, m, error: Exception | None) -> None:
        """The self test is collective from its first step: every rank's ``m`` (0: every path) and its
        own refusal (``error``) exchanged first, bounded by ``deadline_s``, so that one rank's bad
        ``m`` or closed op fails the test on every rank (``PeerRejectedError``), ranks asking for
        different ``m`` raise ``PeerMismatchError`` on every rank, and a peer that is not in a self
        test at all (it made a call) makes this rank raise ``CommTimeoutError`` after ``deadline_s``
        instead of waiting in the test's barrier for good."""
        every = self.comm.gather_words([m if isinstance(m, int) and m > 0 else 0, error is not None], seq=self._seq,
                                       timeout_s=self.deadline_s, what=f"{fn}: the ranks' arguments")
        if error is not None:
            raise error
        refused = [r for r, (_, bad) in enumerate(every) if bad]
        if refused:
            raise PeerRejectedError(f"{fn}: rank(s) {refused} refused their self_test arguments (each raised its own "
                                    f"error); rank {self.rank} raises too")
        if len({m_r for m_r, _ in every}) > 1:
            raise PeerMismatchError(f"{fn}: the ranks asked for different m: " + ", ".join(
                f"{m_r or 'None'} on rank {r}" for r, (m_r, _) in enumerate(every)) + "; pass the same m on every rank")

    def _probe_rows(self, rows: int) -> int:
        """The most rows a call may pass up to ``rows`` (a backend's path rows are the op's m_max)."""
        return layout.most_call_rows(self.config.pattern, rows, self.world)

    def _self_test_rows(self, m: int, fn: str) -> dict:
        self._raise_failed()
        seq = self._seq + 1
        self._probe_prepare(m, seq)
        # no peer writes into a received region before it is poisoned: a barrier bounded by deadline_s
        # (a stalled peer raises CommTimeoutError here, not after the group's own timeout)
        self.comm.gather_words([seq], seq=self._seq, timeout_s=self.deadline_s,
                               what=f"{fn}: the peers' poisoned windows")
        problems = []
        result = None
        try:
            result = self._collective(lambda plan: self._probe_run(plan), m)
            self._backend.check()
        except Exception as err:  # still reach the verdict exchange below, or peers would block in it
            problems.append(f"rank {self.rank}: transfers raised {type(err).__name__}: {err}")
        if not problems:
            problems += self._probe_problems(m, seq, result)
        # every rank raises if any rank failed: who failed in a bounded exchange, what they found (text)
        # only then, from peers that have just answered
        flags = self.comm.gather_words([len(problems)], seq=self._seq, timeout_s=self.deadline_s,
                                       what=f"{fn}: the verdicts")
        if any(count for count, in flags):
            failed = [p for v in self.comm.all_gather_object(problems) for p in v]
            raise SelfTestError(f"{fn}: transport {self.config.transport!r} did not move the bytes:\n"
                                + "\n".join(failed))
        return {"seq": seq, "m": m, "world": self.world, "transport": self.config.transport, "mode": self.config.mode,
                "pattern": self.config.pattern, **self._probe_report(m)}

    def _probe_prepare(self, m: int, seq: int) -> None:
        """Fill what this rank's transfers send with ``probe_pattern``, poison what it receives."""
        cfg, w = self.config, self.config.window
        rows = layout.slice_rows(cfg, m)
        partial = self.window.tensor(w.partial, rank=self.rank)
        recv = self.window.tensor(w.recv, rank=self.rank)
        for dest in range(self.world):
            partial[dest][:rows] = probe_pattern(self.rank, dest, rows, cfg.n_slice, seq, partial.device)
        recv.fill_(float("nan"))
        if recv.device.type == "cuda":
            torch.cuda.synchronize(recv.device)  # the poison must be in memory before peers may copy in

    def _probe_run(self, plan: layout.CallPlan):
        """The transfers alone, on what ``_probe_prepare`` wrote; returns the call's output."""
        out = self._out_maker(plan.m)()
        self._backend.all_reduce_window(out=out, plan=plan)
        return out

    def _probe_problems(self, m: int, seq: int, out) -> list[str]:
        cfg, problems = self.config, []
        rows = layout.slice_rows(cfg, m)
        recv = self.window.tensor(cfg.window.recv, rank=self.rank)
        for src in range(self.world):
            if src == self.rank:
                continue
            expect = probe_pattern(src, self.rank, rows, cfg.n_slice, seq, out.device)
            if not torch.equal(recv[src][:rows], expect):
                bad = int((recv[src][:rows] != expect).sum())  # NaN poison compares unequal
                problems.append(f"rank {self.rank}: {bad} of {rows * cfg.n_slice} elements from rank {src} "
                                f"did not arrive")
        owners = range(self.world) if cfg.pattern_spec.gather else (self.rank,)
        expect = torch.cat([sum(probe_pattern(s, d, rows, cfg.n_slice, seq, out.device).float()
                                for s in range(self.world)) for d in owners], dim=1)
        err = (out.float() - expect).abs()
        tol = expect.abs() / 8 if cfg.pattern_spec.gather and cfg.gather_dtype == "fp8" else torch.zeros_like(expect)
        if not bool((err <= tol).all()):  # NaN compares False: missing bytes fail here too
            problems.append(f"rank {self.rank}: the reduced output differs from the exact sum in "
                            f"{int((~(err <= tol)).sum())} of {out.numel()} elements")
        return problems

    def _probe_report(self, m: int) -> dict:
        cfg = self.config
        moved = (self.world - 1) * layout.slice_rows(cfg, m) * cfg.n_slice * 2  # scatter bytes received here
        what = "all-reduced output equals the exact sum" if cfg.pattern_spec.gather else \
            "reduced slice equals the exact sum"
        gather = {"gather_dtype": cfg.gather_dtype} if cfg.pattern_spec.gather else {}  # (the all-reduce's alone)
        return {**gather, "scatter_bytes_received": moved, "checked": f"recv slots bit-exact from every peer; {what}"}

    # ---- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the backend and the window (local, idempotent); ``comm`` stays open. A peer that
        calls the op after this times out, its error naming this rank as closed (``PeerNotes``).
        It waits for the calls in flight (bounded by the deadline) but raises nothing they recorded:
        call :meth:`check` first to see it."""
        if self._closed:
            return
        self._closed = True
        if self._notes is not None:
            self._notes.post_closed(rank=self.rank, seq=self._seq)
        self._launches.clear()
        self._backend.close()
        if self._backend.retains_window:
            _RETAINED_WINDOWS.append(self.window)
        else:
            self.window.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        c = self.config
        gather = f", gather_dtype={c.gather_dtype!r}" if c.pattern_spec.gather else ""  # (a constructor argument
        # of the all-reduce alone: the other patterns gather no output)
        return (f"{self._FN}(rank={self.rank}/{self.world}, n={c.n}, k={c.k}, m_max={c.m_max}, quant={c.quant!r}, "
                f"mode={c.mode!r}, transport={c.transport!r}{gather}, chunks={c.chunks}{self._repr_extra()})")

    def _repr_extra(self) -> str:
        return ""


class ScatterGemmOp(CollectiveGemmOp):
    """The patterns whose GEMM tiles are scattered to the owner of their output slice and reduced
    there (all-reduce, reduce-scatter): one call body, the pattern's output shape."""

    def __call__(self, a, b_pre, a_scale, b_scale, *, tag: int = 0) -> torch.Tensor:
        """bf16 output of this rank's ``a [M, K] @ unshuffle(b_pre) [N, K].T`` summed over the ranks: the
        whole ``[M, N]`` (all-reduce) or this rank's share (reduce-scatter, ``layout.out_shape``).
        ``tag`` (0 .. ``layout.CALL_TAGS - 1``): the caller, where several share the op (``cco.nn``'s
        layers of one family: ``cco.nn.pool.layer_tag``); peers whose call of the same seq has another
        tag fail it as they fail other rows (``PeerMismatchError``)."""
        self._tag = tag
        # a call like an accepted one: its kept launch (a plain GEMM's, or a collective call's around
        # the backend's bound launch, which counts its own seq: _alone is 0 there; a closed op keeps none)
        launch = self._launches.launch_for(a, b_pre, a_scale, b_scale)
        if launch is not None and layout.valid_tag(tag):  # (else _call rejects it)
            self._seq += self._alone
            return launch(a, a_scale)
        return self._call(a, b_pre, a_scale, b_scale, self._reduce_call)

    def _reduce_call(self, a, b_pre, a_scale, b_scale, m: int) -> torch.Tensor:
        """The collective body of the scatter patterns (all-reduce, reduce-scatter): the backend's
        fused or split call into a new output of the pattern's shape. A fused call on a weight that
        came back keeps the backend's launch for the calls like it (:meth:`_kept_collective`) and
        runs through it itself."""
        backend, new_out = self._backend, self._out_maker(m)
        out = new_out()
        fused = self.config.mode == "fused"
        run = backend.fused if fused else backend.split
        body = lambda plan: run(a, b_pre, a_scale, b_scale, out=out, plan=plan)  # noqa: E731
        # (keeps_fused first: a call no launch is kept for leaves its weight unremembered)
        if fused and backend.keeps_fused(m) and self._launches.known(b_pre, b_scale):
            kept = backend.fused_launcher(a, b_pre, a_scale, b_scale, out=out)
            if kept is not None:  # kept for the calls like it, and this call runs through it
                self._launches.keep(a, b_pre, a_scale, b_scale, self._kept_collective(kept, m, new_out))
                body = functools.partial(kept, a, a_scale, out)  # (then its plan)
        self._collective(body, m, self._tag)
        return out

    def _out_maker(self, m: int):
        """``new_out()``: a fresh bf16 output of a call of ``m`` rows, the pattern's shape (a partial:
        no Python frame per call)."""
        return functools.partial(torch.empty, *layout.out_shape(self.config, m), dtype=torch.bfloat16,
                                 device=self.comm.device)

    def _kept_collective(self, kept, m: int, new_out):
        """A kept launch of a collective call (``_KeptLaunches.launch_for`` found the weight and the
        activation layout of a call that passed the checks): the call machinery of :meth:`_call`
        (a failed op raises, the seq and the counters advance, a failure before the seq is taken is
        a rejected call, the deferred error is raised) around the backend's bound launch ``kept(a,
        a_scale, out, plan)``, without the checks, the rule and the operands' preparation. It holds
        the op weakly: the op holds it (``_KeptLaunches``), and a cycle would outlive the op's last
        reference until a garbage collection."""
        backend, op = self._backend, weakref.ref(self)

        def body(a, _b, a_scale, _s, m):
            out = new_out()
            op()._collective(functools.partial(kept, a, a_scale, out), m, op()._tag)
            return out

        def launch(a, a_scale):
            try:  # (inline, not _raise_failed: an eager call pays for every frame)
                backend.raise_failed()
            except Exception as err:
                op()._note_error(err)
                raise
            return op()._run_call(body, a, None, a_scale, None, m)
        return launch


class GemmAllReduceOp(ScatterGemmOp):
    """Fused fp8 GEMM + all-reduce over the ranks of ``comm``.

    Arguments (all but ``comm`` keyword-only):
      comm:         a :class:`cco.comm.Communicator`; the op runs on ``comm.device``.
      n, k:         weight shape per rank: ``b_pre`` is ``[n, k]`` (k is this rank's K slice).
      m_max:        the most rows a call may pass; sizes the window.
      quant:        "ptpc" | "blockscale" | "mxfp8" (scale layouts in ``cco.quant``).
      mode:         "fused" | "split" | "gemm-only", or a mori arm name ("fused-sdma", ...).
      transport:    "dma" (copier / copy engines) | "lsa" (producer stores into the peer) | "auto" (the
                    backend picks per call: on CUDA lsa at small M, dma above; elsewhere dma).
                    Default: auto on CUDA, dma elsewhere.
      gather_dtype: "bf16", or "fp8" (e4m3 + one fp32 scale per row and 128 columns; half the gather
                    bytes, ~10x the error).
      chunks:       row chunks per call (1..8), or their relative sizes (a tuple such as
                    ``(1, 2, 2, 1)``: small first and last chunks); None: the backend's default.
      weight_layout: "bpreshuffle" (``b_pre`` from ``preshuffle_b``), or "row-major" where the backend
                    reads that as is (``Backend.weight_layouts``; CUDA): no unshuffle per call.
      deadline_s:   seconds one call may wait on peers in total before raising.
      faults:       a :class:`cco.transport.FaultPlan` to inject lost puts or a silent transport (tests).
    """

    _FN = _FN

    def __init__(self, comm, *, n: int, k: int, m_max: int, quant: str = "ptpc", mode: str = "fused",
                 transport: str | None = None, gather_dtype: str = "bf16", chunks: int | tuple[int, ...] | None = None,
                 deadline_s: float = DEFAULT_DEADLINE_S, faults=None, weight_layout: str = "bpreshuffle"):
        super().__init__(comm, pattern="all-reduce", faults=faults, arguments=dict(
            n=n, k=k, m_max=m_max, quant=quant, mode=mode, transport=transport, gather_dtype=gather_dtype,
            chunks=chunks, deadline_s=deadline_s, weight_layout=weight_layout))



def probe_pattern(src: int, dest: int, rows: int, cols: int, seq: int, device="cpu") -> torch.Tensor:
    """bf16 ``[rows, cols]``: ``(src + 1) * 2**e`` with ``e = (row + col + dest + seq) % 4``. Each
    value names its source; any sum over sources is exact in bf16 (at most 36 * 8 for 8 ranks)."""
    r = torch.arange(rows, device=device).view(rows, 1)
    c = torch.arange(cols, device=device).view(1, cols)
    return ((src + 1) * torch.exp2(((r + c + dest + seq) % 4).float())).to(torch.bfloat16)
