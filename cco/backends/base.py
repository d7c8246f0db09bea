"""The backend interface: what a device backend executes for :class:`cco.op.GemmAllReduceOp`.

Interface changes (kept backward compatible once published):
- v1 (2026-11-30): first version.
- v1.1 (2026-11-30): ``check()`` added (default: nothing to check); the op calls it after
  ``self_test`` transfers and from ``GemmAllReduceOp.check()``. Asynchronous backends raise there
  what their device-side protocol recorded (e.g. a peer's (seq, M) stamp that did not match).
- v1.2 (2026-11-30): protocol step 6 (``header[LEFT]``, enter/leave ordering of calls that can fail
  part-way); a failed call still delivers the chunks it completed. No method changed.
- v1.3 (2026-12-01): step 1's header words are written by backends whose peers read them (CPU);
  the GPU backends' peers check the (seq, M) stamp of step 3 only. No method changed.
- v1.4 (2026-12-02): ``gemm_out`` (the op's eager plain calls; default: ``gemm`` into a new tensor),
  which a backend may override to let its GEMM allocate the output.
- v1.5 (2026-12-02): ``reject()`` (a rank whose inputs failed validation still takes part in the
  call: step 7), ``raise_failed()`` / ``raise_deferred()`` (asynchronous backends raise a failure
  the device recorded from the next call too), ``retains_window`` (a failed GPU op keeps its window
  mapped after ``close()``), the ``notes`` constructor argument (rejection reasons).
- v1.6 (2026-12-02): ``plain_launcher()`` (the plain GEMM with the weight bound, for the op's eager
  plain calls; default None: ``gemm_out``).
- v1.7 (2026-12-02): patterns (``cco.layout.PATTERNS``, ``config.pattern``; ``patterns`` lists those
  a backend runs, ``config_error`` refuses the rest). Reduce-scatter: ``fused`` / ``split`` /
  ``all_reduce_window`` run steps 1-4 and write the reduced own slice into ``out`` (no step 5);
  slices follow ``plan.origins`` / ``plan.slice_m`` (by rows for scatter_dim 0). All-gather:
  ``all_gather_gemm``, ``gather_inputs_window``. A pattern without a gather phase ends each call
  with ``gather_flags[src, 0] = seq`` put into every peer and a wait for every peer's: a rank whose
  own share was complete must not return while a peer fails the call (its put to that peer lost).
- v1.8 (2026-12-03): no method changed: ``_scale_rows`` (rows of an all-gathered scale slot) moved
  here from the CPU backend, which the CUDA backend's all-gather reads alike.
- v1.9 (2026-12-04): ``vendor_weight()`` (the weight as the vendor GEMM holds it, per weight; default
  None), which the layers' decode path reads for mxfp8's rows (``GemmAllReduceOp.vendor_weight``).

Division of work. The op owns everything that is the same on every device: public validation
(``cco.validate``), the layout (``cco.layout``: config, window regions, chunk rows, tile table,
cumulative counter targets), the communicator, the symmetric window, the call sequence number,
deadlines, the cross-rank M check's bookkeeping, and ``self_test()`` orchestration. A backend only
*executes* one call on its device, given a :class:`cco.layout.CallPlan`.

Protocol every backend follows (see ``cco.layout`` for the regions):

1. ``header[SEQ, M] = (seq, m)`` (indices ``layout.HEADER_*``) in the own window, before any tile of
   call ``seq`` is published (CPU backend; no GPU peer reads these words, see v1.3).
2. GEMM tiles go, in ``plan.tiles`` order, to ``partial[dest]`` (dma) or straight into
   ``recv[rank]`` of the owner ``dest`` (lsa); after a tile's stores are complete, one
   ``counters[dest, chunk] += 1`` (release). A chunk is complete at ``plan.target(dest, chunk)``.
3. Scatter: the transport puts each completed (dest, chunk) into ``recv[rank]`` of ``dest``; before
   the first chunk's flag it writes ``scatter_m[rank]`` = the call's (seq, tag, m) stamp
   (``transport.base.stamp_of_plan``: the caller's tag tells the layers sharing one op apart) in the
   peer, then ``scatter_flags[rank, chunk] = seq`` (release) after the data.
4. Reduce (owner): wait ``scatter_flags[src, c] >= seq`` for every src, check that ``scatter_m[src]``
   is its own stamp (raise ``cco.transport.protocol.PeerMismatchError`` otherwise), sum
   ``partial[rank] + recv[src]`` in fp32 in ``layout.reduce_order``; round to bf16 (or e4m3 + one
   fp32 scale per row and 128 columns for ``gather_dtype="fp8"``).
5. Gather: put the reduced chunk into ``gather[rank]`` of every rank (self included), then
   ``gather_flags[rank, c] = seq``. Every rank waits ``gather_flags[owner, c] >= seq`` for all
   owners and chunks and assembles ``out``.
6. Leave: ``header[LEFT] = seq`` once the call reads nothing more (returned or failed). A backend
   whose calls can fail part-way (the CPU backend: host-side deadlines) enters call ``seq`` only
   after every peer's ``header[LEFT] >= seq - 1`` and, on failure, leaves only after every peer's
   ``header[LEFT] >= seq`` (both bounded; the contract is in ``cco.op`` "Recovery"). A backend whose
   device-side protocol always runs a call to its end (CUDA) gets the same order from its streams.
7. Rejected call: a rank whose inputs fail validation publishes, instead of steps 2-5, the stamp
   ``transport.base.stamp_rejected(seq)`` (M = 0) where step 3 puts its (seq, M) stamp, and
   releases every wait its peers make on it for that call (CPU: the chunk-0 scatter flag, the
   only one a peer reads before checking the stamp; CUDA: a whole call run on NaN data with the
   peer's M, so every consumed word is consumed). A peer that finds the stamp raises
   ``PeerRejectedError`` naming the rank and its reason (``cco.transport.reasons``).

No host-side reset runs between calls: waits compare flags against the call's seq. The CPU backend
never resets a word (cumulative counter targets); the CUDA backend consumes them (zeroes counters at
call start, each flag right after its single waiter), which keeps a captured graph's baked wait
targets valid under replay. Steps
3-5 may be fused with the GEMM at any granularity (a backend that reduces and gathers chunk c while
the GEMM still produces chunk c+1 approaches the floor of DESIGN section 4; the scatter-then-reduce-
then-gather order above is the baseline). What is fixed is the data each region holds when its flag
is released, because peers running another backend of the same protocol read it.

Every wait has a deadline (``self.deadline_s`` seconds per call) and raises
``cco.transport.protocol.CommTimeoutError`` naming the rank, region, chunk and seq it waited for:
on the host (CPU backend), or through a watchdog that releases the device's waits (CUDA and HIP:
``cco.cuda.watchdog``).
"""

from __future__ import annotations

import abc
import weakref
from typing import TYPE_CHECKING, ClassVar

from cco import layout

if TYPE_CHECKING:  # keep this module importable without torch-heavy or device imports
    import torch

    from cco.comm import Communicator
    from cco.layout import CallPlan, OpConfig
    from cco.window import Window


def row_major_readings(partial: "torch.Tensor", cfg: "OpConfig") -> tuple["torch.Tensor", "torch.Tensor"]:
    """How a producer of whole rows (the vendor GEMM per chunk, and the CPU model of it) reads the
    partial region ``partial`` (``[W, rows, n_slice]``): ``[m_max_padded, N]`` row-major, which it
    writes, and the ``[W, rows, n_slice]`` planes of that reading the transfers take
    (``cco.layout.partial_strides``)."""
    return (partial.view(partial.shape[1], cfg.n),  # (m_max_padded rows; none where nothing is published)
            partial.as_strided(partial.shape, layout.partial_strides(cfg, by_rows=True)))


def weight_stamp(sources) -> tuple:
    """What says a tensor is unchanged since a value was derived from it: each tensor's address,
    version counter and strides (the callers validated the shapes). Flat and short: an eager call
    pays for it."""
    key = ()
    for t in sources:
        key += (t.data_ptr(), t._version, t.stride())
    return key


# weights an op keeps something for (its plain launches, a vendor GEMM's copy of the weight): every
# layer of its shape in a large model (the layers of one shape share one op, cco.nn.WindowPool)
KEPT_WEIGHTS = 512


class WeightDerived:
    """One value derived per weight (a tuple of tensors, such as ``(b_pre, b_scale)``), up to
    ``kept`` weights: the layers of one shape share one op and a model calls them in turn, so a
    store of the last weight alone would derive anew on every call. A
    value is reused while the caller passes the same tensor objects with the same version counters,
    addresses and strides. An entry lives as long as its tensor objects do (they are held weakly;
    it goes when either dies), so an ``id`` in the key always names the live tensor it came from
    and a replaced weight leaves nothing behind (the fault that asked for this: a rank rejected a
    call and ran it on a zero weight of its own making, and its next good call got a new weight at
    that address, version 0, and the zero weight's copy). It also holds aliases of their bytes (not
    the caller's objects), so that ``t.data = other`` (no counter moves) cannot put another
    tensor's bytes at a kept address. The oldest entry goes first past ``kept``."""

    def __init__(self, kept: int = KEPT_WEIGHTS):
        self._kept = kept
        self._entries: dict = {}  # (id, ...) -> (weak references, stamp, value, aliases)
        # the entry the last call returned, tried first: a layer calling with its own weight again
        # (mxfp8's decode calls read its bf16 copy on every eager call) then pays for the stamp
        # alone, not for the key and the dict (~1 us of an eager call's host time, docs/decode.md).
        # Dropped with its entry, so it holds nothing the store has let go.
        self._last = None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, sources, derive, *, keep=lambda: True, refresh=None):
        """``derive()``'s value for ``sources``: the kept one if they are its tensors, unchanged;
        else a new one, kept if ``keep()`` (asked on a miss only). ``refresh(value)``: where the
        kept value's own tensors changed (written in place, given new bytes), it is brought up to
        date in place and stays the kept value, rather than replaced by a new one: a CUDA graph
        captured over it keeps reading live memory, which the next eager call has refreshed (a
        replaced value would be freed under the graph)."""
        stamp = weight_stamp(sources)
        last = self._last
        if last is not None and last[1] == stamp and _same(last[0], sources):
            return last[2]
        key = tuple(map(id, sources))
        entry = self._entries.get(key)
        same = entry is not None and _same(entry[0], sources)
        if same and entry[1] == stamp:
            self._last = entry
            return entry[2]
        if same and refresh is not None and keep():
            value = refresh(entry[2])
            self._entries[key] = self._last = (entry[0], stamp, value, tuple(t.detach() for t in sources))
            return value
        value = derive()
        if keep():
            entries = self._entries
            entries.pop(key, None)
            while len(entries) >= self._kept:
                entries.pop(next(iter(entries)))

            def drop(_, key=key, store=self):  # either tensor died: its entry goes (only if it is still this one's)
                entry = entries.get(key, (None,))
                if entry[0] is refs:
                    del entries[key]
                    if store._last is entry:
                        store._last = None
            refs = tuple(weakref.ref(t, drop) for t in sources)
            entries[key] = self._last = (refs, stamp, value, tuple(t.detach() for t in sources))
        return value


def _same(refs, sources) -> bool:
    """Whether the weak references ``refs`` name the tensor objects ``sources``, in order."""
    for ref, t in zip(refs, sources):
        if ref() is not t:
            return False
    return True


class Backend(abc.ABC):
    """One device's executor of the op's calls. Constructed by the op, once per op.

    Arguments (keyword-only):
      config:     the op's :class:`cco.layout.OpConfig` (shape, quant, mode, transport, gather dtype,
                  chunks, tile sizes, window layout).
      comm:       the :class:`cco.comm.Communicator` (rank, world, device, gloo group).
      window:     the op's symmetric :class:`cco.window.Window`; ``window.tensor(region, rank=r)``
                  is a typed view of rank r's region (peer views are the transport's targets).
      deadline_s: seconds one call's waits may take in total before one raises.
      faults:     optional :class:`cco.transport.FaultPlan` (tests: lost puts, a silent engine).
                  A backend that cannot inject faults raises ValueError when one is passed.
      notes:      optional :class:`cco.transport.reasons.PeerNotes`: where a rejecting rank
                  leaves its reason and a peer reads it (None: peers name the rank, not the reason).

    Backend modules: ``cco.backends.cpu.CpuBackend``, ``cco.backends.cuda.CudaBackend``,
    ``cco.backends.gfx950.Gfx950Backend``; the op picks one by device (``cco.op.select_backend``).

    Calls are collective: every rank calls the same method with the same ``plan.seq`` and M.
    ``out`` is a caller-owned contiguous bf16 ``[M, N]`` tensor on the backend's device; the backend
    writes every element of it and never keeps a reference to it after returning.
    """

    name: ClassVar[str] = "base"
    # tile sizes this backend's kernel walks; the op passes them to layout.build_config
    block_m: ClassVar[int | None] = None
    block_n: ClassVar[int | None] = None
    # what transport=None means on this backend ("auto": the backend picks per call, see CudaBackend)
    default_transport: ClassVar[str] = "dma"
    # what chunks=None means on this backend (a count, or relative sizes: layout.chunk_tiles)
    default_chunks: ClassVar[int | tuple[int, ...]] = layout.DEFAULT_CHUNKS
    # weight layouts (layout.WEIGHT_LAYOUTS) the backend takes as ``b_pre``; the first is the one its
    # kernel reads as is (a layer lays its weight out in it once, at load)
    weight_layouts: ClassVar[tuple[str, ...]] = ("bpreshuffle",)
    # the collective patterns (layout.PATTERNS) this backend runs; the op refuses the others at
    # construction (config_error), so a layer falls back to its unfused path on every rank alike
    patterns: ClassVar[tuple[str, ...]] = ("all-reduce",)

    @classmethod
    def tile(cls, quant: str) -> tuple[int | None, int | None]:
        """(block_m, block_n) of the layout for ``quant`` (the op passes them to layout.build_config;
        None: the layout's default): the tile the backend's fused kernel walks."""
        return cls.block_m, cls.block_n

    @classmethod
    def config_error(cls, cfg: "OpConfig") -> Exception | None:
        """None when this backend runs ``cfg`` (a configuration ``layout.build_config`` accepted),
        else the error (message without a prefix) its construction raises, with the fix. The one
        place a backend's own refusals live: its ``__init__``, ``GemmAllReduceOp`` (before it opens a
        window) and ``cco.supports`` all ask it."""
        if cfg.pattern not in cls.patterns:
            return NotImplementedError(
                f"the {cls.name} backend does not run the {cfg.pattern} pattern yet (it runs "
                f"{', '.join(cls.patterns)}); run it on the CPU reference backend, or unfused "
                f"({layout.PATTERNS[cfg.pattern].unfused} with torch.distributed)")
        if cfg.weight_layout not in cls.weight_layouts:
            return ValueError(f"weight_layout={cfg.weight_layout!r} is not read by the {cls.name} backend; pass "
                              f"one of {', '.join(cls.weight_layouts)}")
        return None

    def _refuse_config(self) -> None:
        """Raise :meth:`config_error`, prefixed by the backend's class name."""
        err = self.config_error(self.config)
        if err is not None:
            raise type(err)(f"{type(self).__name__}: {err}")

    # whether close() leaves the window mapped (a failed GPU op: a late peer may still write into it)
    retains_window: bool = False

    def __init__(self, *, config: "OpConfig", comm: "Communicator", window: "Window", deadline_s: float,
                 faults=None, notes=None):
        self.config = config
        self.comm = comm
        self.window = window
        self.deadline_s = deadline_s
        self.faults = faults
        self.notes = notes

    def _scale_rows(self, slot, r0: int, r1: int) -> "torch.Tensor":
        """All-gather: rows [r0, r1) of a scale slot of the window's ``a_scales`` region, as ``a_scale``
        holds them (blockscale: the slot is the transposed ``[K/128, rows]``, so this is a column-major
        ``[rows, K/128]`` view; ``layout.input_scale_shape``)."""
        return slot[:, r0:r1].t() if self.config.quant == "blockscale" else slot[r0:r1]

    def path_rows(self) -> list[int]:
        """Row counts that together take every transfer path of this backend (the self test runs
        one call per entry): one path here, so ``[m_max]``."""
        return [self.config.m_max]

    @classmethod
    def supports_device(cls, device: "torch.device") -> str | None:
        """``None`` when this backend can run on ``device``, else why not."""
        return None

    # ---- execution --------------------------------------------------------------------------------
    @abc.abstractmethod
    def gemm(self, a, b_pre, a_scale, b_scale, *, out: "torch.Tensor", plan: "CallPlan") -> None:
        """Plain local GEMM (mode ``gemm-only``): ``out = dequant(a) @ dequant(unshuffle(b_pre)).T``
        in bf16; no window, no communication, not collective."""

    # bumped by a setting that changes what plain_launcher returns: the op's kept launches retire
    plain_epoch = 0

    def plain_launcher(self, b_pre, b_scale, m: int):
        """``fn(a, a_scale) -> bf16 [M, N]``: the plain GEMM of ``m`` rows with this weight bound,
        which the op calls instead of :meth:`gemm_out` while the weight's tensors come back
        unchanged and ``plain_epoch`` stays (it checks both); None (the default): the op calls
        :meth:`gemm_out`."""
        return None

    def keeps_fused(self, m: int) -> bool:
        """Whether :meth:`fused_launcher` may keep a launch for fused calls of ``m`` rows now: the op
        asks this first, so a call no launch would be kept for (the default: none) leaves no trace of
        its weight in the op (a trainable layer's fresh weight each call)."""
        return False

    def fused_launcher(self, a, b_pre, a_scale, b_scale, *, out):
        """``fn(a, a_scale, out, plan)``: :meth:`fused` for calls like this accepted one (its operands
        passed the op's checks; ``out`` its output) with this weight bound, which the op calls
        instead while the weight's tensors come back unchanged and the activations keep this call's
        layout (``cco.op``'s kept launches check both); None (the default, and wherever
        :meth:`keeps_fused` is false): the op calls :meth:`fused`."""
        return None

    def vendor_weight(self, b_pre, b_scale):
        """The weight as this backend's vendor GEMM holds it, kept per weight (CUDA:
        ``kernels_fused.hopper.vendor.VendorWeight``, mxfp8's ``dense`` the bf16 copy its calls
        read), or None (the default: no vendor GEMM). The caller passes a weight of the op's shape."""
        return None

    def gemm_out(self, a, b_pre, a_scale, b_scale, *, plan: "CallPlan") -> "torch.Tensor":
        """:meth:`gemm` into a new bf16 ``[M, N]`` tensor on ``a``'s device, returned."""
        import torch

        out = torch.empty(plan.m, self.config.n, dtype=torch.bfloat16, device=a.device)
        self.gemm(a, b_pre, a_scale, b_scale, out=out, plan=plan)
        return out

    @abc.abstractmethod
    def fused(self, a, b_pre, a_scale, b_scale, *, out: "torch.Tensor", plan: "CallPlan") -> None:
        """Mode ``fused``: GEMM whose epilogue publishes tiles (protocol steps 1-2) while the transport
        scatters completed chunks (3); then reduce (4) and gather (5) into ``out``. Collective."""

    @abc.abstractmethod
    def split(self, a, b_pre, a_scale, b_scale, *, out: "torch.Tensor", plan: "CallPlan") -> None:
        """Mode ``split``: the whole GEMM into ``partial`` first, then :meth:`all_reduce_window`.
        Same bytes on the wire as ``fused``; the baseline that fused must beat. Collective."""

    @abc.abstractmethod
    def all_reduce_window(self, *, out: "torch.Tensor", plan: "CallPlan") -> None:
        """Protocol steps 1 and 3-5 on whatever ``partial`` already holds (rows ``< plan.m``), with
        counters brought to ``plan.counter_targets``. Used by ``split`` and by the op's
        ``self_test()``, which fills ``partial`` with a known pattern and checks what arrived in
        every rank's ``recv`` and ``out``. Collective."""

    def all_gather_gemm(self, a, b_pre, a_scale, b_scale, *, out: "torch.Tensor", plan: "CallPlan",
                        gathered=None) -> None:
        """Pattern ``all-gather``: put this rank's input rows ``a`` (and ``a_scale``) into
        ``a_rows[rank]`` / ``a_scales[rank]`` of every rank (chunk by chunk, each released by
        ``scatter_flags[rank, c] = seq``, chunk 0 after the (seq, M) stamp in ``scatter_m[rank]``),
        and compute ``out[src rows] = rows_src @ B.T`` for every source as its rows land, the own
        rows first (``plan.tiles``). Mode ``split`` waits for every rank's rows before the GEMM.
        ``gathered`` = (a_all, a_scale_all): also assemble the gathered input there. Collective."""
        raise NotImplementedError(f"{type(self).__name__} does not run the all-gather pattern")

    def gather_inputs_window(self, *, plan: "CallPlan") -> None:
        """The all-gather's transfers alone, on what ``a_rows[rank]`` / ``a_scales[rank]`` hold
        (rows ``< plan.m``): the self test's run. Collective."""
        raise NotImplementedError(f"{type(self).__name__} does not run the all-gather pattern")

    @abc.abstractmethod
    def reject(self, *, seq: int, error: Exception, plan_for) -> None:
        """Protocol step 7: take part in call ``seq``, whose inputs this rank rejected with
        ``error`` (the op raises it after this returns), so that every peer fails the same call
        with :class:`PeerRejectedError` and the ranks stay in step. ``plan_for(m)`` is the
        :class:`CallPlan` of call ``seq`` with ``m`` rows (a backend that must mirror a peer's
        call learns the peer's M from its stamp). Problems on the way (a peer that is not there)
        are added to ``error`` as notes, not raised. Collective."""

    def raise_failed(self) -> None:
        """Before a call: raise if the op can run no more calls (an asynchronous backend whose
        call passed its deadline: its words are no longer in step with the peers'). Synchronous
        backends raise inside the failed call and have nothing to add here."""

    def raise_deferred(self) -> None:
        """After a call was issued (it took part in the collective, so the ranks stay in step):
        raise the error an earlier call recorded on the device, once the host knows it (a peer's
        mismatched M or rejected inputs). Synchronous backends have nothing to add here."""

    def check(self) -> None:
        """Wait for the calls issued so far and raise any error their device-side protocol recorded
        (:class:`cco.transport.protocol.PeerMismatchError` for a peer's mismatched (seq, M),
        ``PeerRejectedError``, ``CommTimeoutError`` for a call the watchdog released).
        Synchronous backends raise inside the call and have nothing to add here."""

    def close(self) -> None:
        """Release streams, threads and device buffers the backend owns (not the window or the
        communicator: the op owns those). Idempotent."""
