"""What the tensor-parallel layers share: ``_ParallelLinear``, the base of ``RowParallelLinear``
(``cco.nn.linear``) and ``ColumnParallelLinear`` (``cco.nn.column``), which add only their forward
and backward.

Both hold one rank's weight shard ``W_r [N, K]`` (row-parallel: N = out_features, K =
in_features_per_rank; column-parallel: N = out_features_per_rank, K = in_features) and multiply by
it through one fused op. The base holds, once for both:

- construction, collective over the group: the arguments checked, then agreed on every rank
  (``Communicator.agree``: ranks with different arguments all raise ``ArgumentMismatchError``, a
  rank that rejects its own makes its peers raise ``PeerRejectedError``) before anything is built;
  one verdict for the whole group on the fused path (a rank whose backend refuses makes every rank
  run unfused); the op acquired from the pool; the fp8 weight buffers, bias and master weight;
  the dual op of a sequence-parallel ``backward="fp8"`` (``cco.nn.sequence``);
- the weight: ``load_weight`` (a float shard), ``load_fp8`` (an fp8 shard and its scales),
  ``load_checkpoint`` (the whole fp8 checkpoint weight, sharded along the layer's split
  dimension), padded to the backend's shape, quantized and laid out once; ``quantized_weight`` /
  ``dequantized_weight``; ``train()`` (``eval()`` refreshes the fp8 weight from a master weight);
- the blank check: a layer whose weight was never written would return zeros, so its first call
  raises instead, on every rank of a collective call (``_require_loaded``);
- lifetime and repr: ``close``, ``window_bytes``, ``extra_repr``.
"""

from __future__ import annotations

import functools
import logging

import torch

from cco import layout, library
from cco import quant as Q
from cco.comm import Communicator
from cco.nn import checkpoint as C
from cco.nn import sequence
from cco.nn.collectives import step_name
from cco.nn.pool import DEFAULT_POOL, WindowPool, group_plan, header_seq, layer_tag
from cco.preshuffle import preshuffle_b, unshuffle_b

log = logging.getLogger("cco.nn")
MODES = ("fused", "split", "unfused")
# the activations a layer takes (and quantizes itself); fp8 or integer rows are refused, not read as values
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def quantize_activation(x: torch.Tensor, quant: str, *, k_padded: int, m_padded: int | None = None):
    """The layers' activation quantizer on ``x``'s device: Triton on GPUs (NVIDIA and ROCm), torch on
    the CPU; ``(e4m3 [m_padded, k_padded], scale)`` in the layout of ``quant``, rows past M zero."""
    if x.is_cuda:  # (not x.device.type: a device object per call; the import bound once, below)
        return _on_gpu()(x, quant, k_padded=k_padded, m_padded=m_padded)
    from kernels_fused.cpu.quantize import quantize_activation as on_cpu
    if m_padded is not None and m_padded != x.shape[0]:
        x = torch.nn.functional.pad(x, (0, 0, 0, m_padded - x.shape[0]))
    return on_cpu(x, quant, k_padded=k_padded)


@functools.cache
def _on_gpu():
    """The Triton activation quantizer (imported at the first GPU call: a CPU job needs no Triton)."""
    from kernels_fused.hopper.quantize import quantize_activation as on_gpu
    return on_gpu


def tracing() -> bool:
    """Whether something records the calls being made: torch.compile / torch.export, a dispatch mode
    on the stack (make_fx, FakeTensorMode), a functorch transform, ``torch.jit.trace``."""
    return (torch.compiler.is_compiling() or bool(torch._C._len_torch_dispatch_stack())
            or torch._C._functorch.maybe_current_level() is not None or torch._C._get_tracing_state() is not None)


def untraced(x: torch.Tensor) -> bool:
    """Whether nothing records a call on ``x``: a plain tensor (not a FakeTensor, a functional or
    proxy tensor, a DTensor or another subclass) and not :func:`tracing`. There the layers' forward
    calls their body directly instead of their ``torch.ops.cco`` op: the dispatcher and the op's
    autograd wrapper cost an eager decode-sized call tens of microseconds of host time (docs/decode.md)."""
    return type(x) is torch.Tensor and not tracing()


def decode_gemm_for(layer):
    """The decode GEMM (``kernels_fused.hopper.decode.decode_gemm``: the activations quantized inside
    the GEMM's one launch) where ``layer``'s calls can take it, else None: calls that need no
    communication (one rank, or a column-parallel layer's local GEMM) on an NVIDIA GPU with the
    fused path's row-major weight."""
    local = not (layer.sequence_parallel or layer._collective)
    if not (local and layer.op is not None and layer.device.type == "cuda" and not getattr(torch.version, "hip", None)
            and layer.weight_layout == "row-major"):
        return None
    from kernels_fused.hopper.decode import decode_gemm
    return decode_gemm


def _check_arguments(fn: str, sizes: dict, *, mode, quant, backward, deadline_s, options: dict,
                     world: int, sequence_parallel: bool) -> None:
    """Arguments no backend could take, whatever the shape (``options``: the op's transport,
    gather_dtype, chunks as passed): a ValueError at construction on every rank, never a reason to
    run unfused (only a backend's refusal of the shape is one)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{fn}: {name}={value!r} must be a positive int")
    if sequence_parallel and sizes["m_max"] < world:  # a sequence-parallel call has world x its rows per rank
        raise ValueError(f"{fn}: m_max={sizes['m_max']} is smaller than the group's {world} ranks; a sequence-parallel "
                         f"call takes every rank's tokens (at least one each), so no call would fit: pass m_max >= "
                         f"{world}")
    if mode not in MODES:
        raise ValueError(f"{fn}: mode={mode!r} is not supported; pass one of {', '.join(MODES)}")
    Q.check_quant(quant, fn=fn)
    sequence.check_backward(backward, fn)
    if backward != "bf16" and not sequence_parallel:  # (taken and dropped before: a silent no-op)
        raise ValueError(f"{fn}: backward={backward!r} fuses a sequence-parallel layer's backward collective (the "
                         f"all-gather or reduce-scatter of its gradients); without sequence_parallel=True the backward "
                         f"runs in bf16: pass backward='bf16', or sequence_parallel=True")
    check_op_options(fn, deadline_s=deadline_s, **options)
    if sequence_parallel and options.get("gather_dtype", "bf16") != "bf16":
        raise ValueError(f"{fn}: gather_dtype={options['gather_dtype']!r} sets the all-reduce's gather phase; with "
                         f"sequence_parallel=True the layer ends in a reduce-scatter, which gathers nothing: leave "
                         f"gather_dtype at 'bf16'")


def check_op_options(fn: str, *, transport, gather_dtype, chunks, deadline_s) -> None:
    """The op's options as a layer (or a plan's ``FusedOptions``) passes them on: a ValueError
    naming ``fn`` for a value no backend takes."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
        raise ValueError(f"{fn}: deadline_s={deadline_s!r} must be > 0 seconds")
    try:
        layout.check_call_options(transport=transport, gather_dtype=gather_dtype, chunks=chunks)
    except ValueError as err:
        raise ValueError(f"{fn}: {err}") from None


def _master_mark(master: torch.Tensor) -> tuple[int, int]:
    """What marks a write of a trainable layer's master weight: its version (an in-place write, an
    optimizer step, load_state_dict) and its storage (``weight.data = new``). A write through
    ``weight.data.copy_(...)`` moves neither: call ``eval()`` after it (docs/guide.md)."""
    return master._version, master.data_ptr()


def close_layers(module: torch.nn.Module) -> int:
    """Close every cco layer in ``module``'s tree (``_ParallelLinear.close``: the last layer of a
    family frees its window); returns how many were open. Deleting a model does not free its
    windows: the pool holds each family's op until its last layer is closed. Call it on every rank
    at the same point (a layer closed on some ranks only makes the next build of its family raise
    on every rank), e.g. before dropping a model to load another."""
    layers = [m for m in module.modules() if isinstance(m, _ParallelLinear) and not m._closed]
    for layer in layers:
        layer.close()
    return len(layers)


def _mib(nbytes: int) -> str:
    """Bytes as MiB, or KiB below 64 KiB (a window that maps no data planes: a few KiB of words)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 64 << 10 else f"{nbytes / 2**10:.1f} KiB"


class _ParallelLinear(torch.nn.Module):
    """The shared body of the tensor-parallel layers (see the module). A subclass sets the class
    attributes below, builds through :meth:`_build`, and adds ``forward``, ``_check_call``,
    ``_cco_forward`` and ``_cco_backward`` (``cco.library``'s ops call :meth:`_op_forward`, which
    checks and calls ``_cco_forward``, and ``_cco_backward`` on the layer their handle names)."""

    _FN = "_ParallelLinear"
    _SHARD = "[N, K]"            # the weight shard's dimensions in the subclass's names, for errors
    _SHARD_DIM = 1               # the dimension of the whole weight the ranks split (1: K, 0: N)
    _PER_RANK = "K"              # the constructor argument of the split dimension
    _WHOLE = "N"                 # the constructor argument of the dimension every rank holds whole
    _DUAL_GATHERS = True         # the dual pattern of the backward: all-gather (else reduce-scatter)
    _COLLECTIVE_WITHOUT_SP = True  # a call is collective without sequence parallelism too
    _UNFUSED = ("", "")          # what runs unfused: (without, with) sequence parallelism, for the log

    def _build(self, *, n: int, k: int, sizes: dict, arguments: dict, group, cpu_group, quant: str, bias: bool,
               m_max: int, mode: str, transport, chunks, deadline_s: float, trainable: bool, pool: WindowPool | None,
               sequence_parallel: bool, backward: str, op_class, op_options: dict, shape_options: dict) -> None:
        """Construction, collective over ``group``: ``sizes`` (name -> value) checked and ``arguments``
        agreed on every rank before anything is built, then the verdict, the op, the buffers."""
        self.sequence_parallel = bool(sequence_parallel)
        self._pool = pool or DEFAULT_POOL
        self.comm = self._pool.communicator(group, cpu_group=cpu_group)
        error = None
        try:
            _check_arguments(self._FN, sizes, mode=mode, quant=quant, backward=backward, deadline_s=deadline_s,
                             options=dict(transport=transport, chunks=chunks,
                                          gather_dtype=arguments.get("gather_dtype", "bf16")),
                             world=self.comm.world, sequence_parallel=self.sequence_parallel)
        except (TypeError, ValueError) as err:
            error = err
        # construction is collective: every rank of the group agrees on the arguments first
        self.comm.agree(self._FN, arguments, error=error)
        self._tag = layer_tag(self.comm)  # (after the agreement: every rank takes it, or none)
        self.out_features, self.in_features_per_rank = n, k  # the shard [N, K], whatever the subclass calls them
        self.quant, self.m_max, self.mode = quant, m_max, mode
        self._deadline_s = deadline_s
        self.device = self.comm.device
        # the group the unfused path's collectives run on: the caller's, whose backend carries the
        # device's tensors (NCCL on NVIDIA); the communicator's bootstrap group where a Communicator was given
        self._group = self.comm.group if group is None or isinstance(group, Communicator) else group
        # one verdict for the whole group: a rank whose backend refuses makes every rank fall back
        plan, weight_layout, self.fallback_reason = group_plan(
            self.comm, n, k, m_max=m_max, unfused_reason="mode='unfused' was asked for" if mode == "unfused" else None,
            **shape_options)
        self.shape = plan
        self.n_padded, self.k_padded = plan.n_padded, plan.k_padded
        self.op = None
        if self.fallback_reason is None:
            self.weight_layout = weight_layout
            self.op = self._pool.acquire(self.comm, op_class=op_class, fn=self._FN, n=self.n_padded, k=self.k_padded,
                                         m_max=m_max, deadline_s=deadline_s, weight_layout=weight_layout, **op_options)
        else:
            self.weight_layout = "row-major"  # no kernel reads it: the unfused GEMM's own layout
            log.warning("%s", f"{self._name()}: runs unfused ({self._UNFUSED[self.sequence_parallel]}): "
                              f"{self.fallback_reason}")
        if plan.padding:
            log.info("%s", f"{self._name()}: weight padded with zeros, {plan.padding}")

        w_q, w_s = self._zero_weight()
        self.register_buffer("qweight", w_q)
        self.register_buffer("weight_scale", w_s)
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16, device=self.device))
        self.weight = None
        if trainable:
            self.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.bfloat16, device=self.device))
        # the master weight's mark (_master_mark) where the stored fp8 weight was quantized from it
        self._master_seen = None if self.weight is None else _master_mark(self.weight)
        # versions of the blank weight: any write (load_weight, load_fp8, load_state_dict, an in-place
        # init of the master weight) moves one, so "loaded" costs no flag that a loader could forget
        self._blank = (self.qweight._version, None if self.weight is None else self.weight._version)
        self._loaded = False
        # sequence parallel, backward="fp8": the dual collective fused with grad_y @ W_r (cco.nn.sequence)
        self._dual = sequence.make_dual(self, backward, gathers=self._DUAL_GATHERS, n=k, k=n,
                                        mode="fused" if mode == "unfused" else mode, transport=transport,
                                        chunks=chunks, deadline_s=deadline_s, fn=self._FN)
        self._handle = library.register(self)
        self._closed = False
        # calls of up to ``decode_rows`` rows run the decode GEMM (0: none); the rule's default per
        # quant and K (kernels_fused.hopper.decode.decode_max_m), or set by the caller where
        # decode_gemm_for offers the kernel. Bound once: an import per call costs a microsecond.
        self._decode_gemm = decode_gemm_for(self)
        # mxfp8's calls of 2+ rows pass the decode GEMM the weight's bf16 copy that the op's vendor GEMM
        # holds (decode.VENDOR_ROWS: its general path's launches, without its Python around them)
        self._dense_rows = self._decode_gemm is not None and quant == "mxfp8"
        # ... except its calls of 2..mx_rows_max rows, which read the fp8 weight itself through
        # mx_decode's kernel where that kernel suits the weight (asked once per weight version)
        self._mx_numel, self._mx_weights = 0, None
        self.decode_rows = 0
        if self._decode_gemm is not None:
            from kernels_fused.hopper.decode import decode_max_m, mx_rows_max
            self.decode_rows = min(decode_max_m(quant, self.k_padded), m_max)
            if self._dense_rows:
                from cco.backends.base import WeightDerived
                self._mx_numel = mx_rows_max(self.k_padded) * self.in_features_per_rank
                self._mx_weights = WeightDerived(kept=2)

    @property
    def decode_rows(self) -> int:
        """Calls of at most this many rows run the decode GEMM (0: none)."""
        return self._decode_rows

    @decode_rows.setter
    def decode_rows(self, rows: int) -> None:
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ValueError(f"{self._FN}: decode_rows={rows!r} must be an int >= 0")
        self._decode_rows = rows
        # forward's first test in elements (x.numel() <= this, for x [..., K]): no shape arithmetic per call
        self._decode_numel = rows * self.in_features_per_rank

    def _decode_call(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` is an eager call of at most ``decode_rows`` rows, which goes
        straight to :meth:`_decode`: ahead of the general path, whose checks, reshapes and lookups
        cost a decode call more host time than the decode GEMM's launch (docs/decode.md)."""
        return (type(x) is torch.Tensor and 0 < x.numel() <= self._decode_numel and x.dtype in ACTIVATION_DTYPES
                and x.ndim and x.shape[-1] == self.in_features_per_rank and self._eager(x))

    def _check_before_op(self, x) -> None:
        """Refuse here, on every rank of a collective call (:meth:`_check_call`), an input the
        registered op must not see: not a tensor (its schema would refuse it on this rank alone), or
        a plain tensor on another device than the layer's (the dispatcher would run that device's
        kernel: for meta the fake one, which takes no part in the collective). Traced inputs are
        checked where the op runs (:meth:`_op_forward`)."""
        if not isinstance(x, torch.Tensor) or (x.device != self.device and untraced(x)):
            self._check_call(x)

    def _check_input(self, x, *, features: int, name: str, hint: str, collective: bool) -> None:
        """Raise for an input no call takes (not a tensor, 0-d, not a float activation, another
        feature count, another device than the layer's); where the call is ``collective``, this rank
        still takes part in it as a rejected one first (``op.reject``), so that its peers fail the
        same call and every rank stays in step (a rank that raised without it would pair its next
        call with the peers' this one)."""
        err = None
        if not isinstance(x, torch.Tensor):
            err = TypeError(f"{self._FN}: x must be a torch.Tensor [..., {name}], got {type(x).__name__}")
        elif x.dim() == 0:
            err = ValueError(f"{self._FN}: x is a 0-d tensor; pass [..., {name}={features}]")
        elif x.dtype not in ACTIVATION_DTYPES:
            err = TypeError(f"{self._FN}: x is {x.dtype}; the layer takes float activations ("
                            f"{', '.join(str(d).removeprefix('torch.') for d in ACTIVATION_DTYPES)}) and quantizes "
                            f"them itself (rows already in fp8 with their scales go to the op: cco.GemmAllReduceOp "
                            f"and its siblings)")
        elif x.shape[-1] != features:
            err = ValueError(f"{self._FN}: x has {x.shape[-1]} features in its last dimension but the layer takes "
                             f"{name}={features}{hint}")
        elif x.device != self.device:
            err = ValueError(f"{self._FN}: x is on {x.device} but the layer (its weight, window and group) is on "
                             f"{self.device}; move x there first (x.to(layer.device))")
        if err is None:
            return
        if collective:
            self._refuse_call(err)
        raise err

    def _refuse_call(self, err: Exception, *, header: bool = False) -> None:
        """This rank's share of a collective call whose input it refused with ``err`` (or whose own
        work failed with it): the call's next collective step all the same, as a refusal. That is
        the op's rejected call, or the call's header with the rejection (:meth:`_agree_rows`, which
        raises ``err``): the header where the unfused path runs, or where the call starts with one
        (``header=True``: :meth:`_starts_with_header`)."""
        if header or self.op is None:
            self._agree_rows(0, error=err)
        else:
            self.op.reject(err)

    def _before_op(self, work):
        """``work()``: this rank's own work of a fused collective call before the op's call, the
        call's next collective step (flattening and quantizing the rows). Where it raises (an
        allocation that fails on this rank alone, say), this rank takes part in that op call as a
        rejected one first (``op.reject``; ``cco.nn.sequence.DualGemm`` does the same for the dual
        op): its peers fail the call with ``PeerRejectedError`` instead of pairing it with this
        rank's next call (a result of two calls, with no error), and the ranks stay in step."""
        try:
            return work()
        except Exception as err:
            self.op.reject(err)
            raise

    def _agreed(self, work, m: int, *, total: int | None = None, step: int = 0):
        """``work()``'s result, once the call's header (:meth:`_agree_rows` of ``m``, ``total``,
        ``step``) agreed on every rank: an unfused collective call's own work runs before its header,
        so that a failure of it on this rank alone travels in the header (this rank raises it, its
        peers ``PeerRejectedError``) rather than leaving the peers in the data collective, which
        this rank's next call would join."""
        result = error = None
        try:
            result = work()
        except Exception as err:
            error = err
        self._agree_rows(m, total=total, error=error, step=step)
        return result

    def _agree_rows(self, m: int, *, total: int | None = None, error: Exception | None = None,
                    step: int = 0) -> None:
        """The header of a layer's collective call that no op's stamps cover (the unfused path's
        calls, a call of no rows, a forward in pieces, the sequence-parallel backward's bf16
        collectives): every rank's ``m``, whether it refused its input and whether its weight is blank,
        exchanged on the communicator's CPU group (``Communicator.gather_words``: one gather of ten
        int64 per rank, bounded by ``deadline_s``) before the call's data collective, so that
        every rank reaches the same verdict. NCCL and gloo do not check a collective's sizes: a peer
        with other rows hangs or aborts the job (gloo: "Received data size doesn't match"), and a
        peer that raised before the collective pairs this call with its next one and returns its
        result. ``total``: the rows of the whole forward where it runs in pieces of ``m`` (compared
        too: pieces of one size in calls of different sizes would pair). Raises ``error`` (this
        rank's own) after the exchange; else ``PeerRejectedError`` where a peer refused,
        ``PeerMismatchError`` where the ranks' rows (or ``step``s) differ, on every rank; a peer
        that never comes (it called the op instead: a call of rows against one of none; it never
        ran its backward) raises ``CommTimeoutError`` after ``deadline_s``, as the op's waits do, and
        on the fused path first takes part in the op's next call as a rejected one (the peer's call,
        which then fails too, instead of pairing with this rank's next call). Its gather stays posted
        and meets the peers' next header: the exchange carries the call's seq, so the peers see this
        rank behind and post their header again, which this rank's next header meets
        (``Communicator.gather_words``). A header that meets the peers' header of a later call (their
        op call, which this rank's header did not meet, ended first) raises ``PeerMismatchError`` after
        taking part in the op calls this rank missed as rejected ones, and the next call is in step.
        ``step``: which collective call this is (:func:`backward_step`; 0: a forward). One rank:
        nothing to agree."""
        from cco.transport.protocol import CommTimeoutError, PeerMismatchError, PeerRejectedError

        comm = self.comm
        blank = not self._loaded and not self._weight_written()
        try:
            # the call's seq: the op's (its calls and the headers of its family's layers interleave
            # alike on every rank), else the count of the unfused headers on the communicator's group
            # (every unfused call has one); the layer's tag tells the layers of one count apart
            seq = self.op.calls if self.op is not None else header_seq(comm)
            every = comm.gather_words([m, m if total is None else total, error is not None, blank, step, self._tag],
                                      seq=seq, timeout_s=self._deadline_s, what=f"{self._name()}: this call's header")
        except PeerMismatchError as mismatch:
            # this rank's header met its peers' header of a later call: they made op calls this rank
            # missed (their call failed without it: an op call of rows against this rank's header of
            # none, ended at its deadline before this header's), and they post their header again for
            # this rank's next one. Take part in the missed calls as rejected ones, or the op seqs
            # stay apart and every later call fails
            for _ in range(getattr(mismatch, "behind", 0) if self.op is not None else 0):
                self.op.reject(mismatch)
            raise
        except CommTimeoutError as timeout:
            if self.op is not None:
                # the peer that never came is most likely in the op's call (it had rows where this rank
                # had none, one call where this one has pieces, its next forward where this one runs
                # a backward): take part in that call as a rejected one, or this rank's next call would
                # take its seq and pair with it, and both would return a mix of two calls
                self.op.reject(timeout)
            if error is not None:
                raise error from None
            raise
        if error is not None:
            raise error
        blank = [r for r, t in enumerate(every) if t[3]]
        if blank:  # (the unfused path's blank check: every rank raises)
            raise self._blank_error(blank)
        self._loaded = True
        rows = [(t[0], t[1]) for t in every]
        refused = [r for r, t in enumerate(every) if t[2]]
        if refused:
            raise PeerRejectedError(f"{self._name()}: rank(s) {refused} refused their input to this call (each raised "
                                    f"its own error); rank {comm.rank} raises too, and the ranks stay in step")
        tags = [t[5] for t in every]
        if len(set(tags)) > 1:
            raise PeerMismatchError(f"{self._name()}: the ranks called different layers: " + ", ".join(
                f"layer #{tag} on rank {r}" for r, tag in enumerate(tags)) + "; every rank must call the same layers "
                "in the same order")
        steps = [t[4] for t in every]
        if len(set(steps)) > 1:
            raise PeerMismatchError(f"{self._name()}: the ranks are in different calls: " + ", ".join(
                f"{step_name(code)} on rank {r}" for r, code in enumerate(steps)))
        if len(set(rows)) > 1:
            raise PeerMismatchError(f"{self._name()}: the ranks called with different rows: " + ", ".join(
                f"{m_r}{f' (a piece of {t_r})' if t_r != m_r else ''} on rank {r}" for r, (m_r, t_r) in enumerate(rows))
                + "; every rank must pass the same tokens")

    def _check_call(self, x) -> None:
        """Raise for an input no call takes, where the call is collective on every rank of it (the
        subclass's checks: :meth:`_check_input`, and with sequence parallelism the token rows)."""
        raise NotImplementedError

    def _op_forward(self, x, qweight, scale, bias) -> torch.Tensor:
        """The body of the layer's ``torch.ops.cco`` op (real tensors, at run time): the input checked
        here, where the call runs, as ``forward`` checks the calls it runs itself (a traced forward
        could not: a refusal there could not take part in the collective call, ``op.reject`` is not
        traced, and the peers would pair their call with this rank's next one); the stored fp8 weight
        brought to the master's where it moved (a traced ``quantized_weight`` cannot read its
        version); then :meth:`_cco_forward`."""
        self._check_call(x)
        if self._own_work(x, self._follow_if_moved):  # in place; the buffers are what an eval-mode trace passed
            qweight, scale = self._buffers["qweight"], self._buffers["weight_scale"]
        return self._cco_forward(x, qweight, scale, bias)

    def _own_work(self, x, fn):
        """``fn()``: this rank's own work before a call on ``x`` reaches its body (the master weight
        quantized afresh in training, or the stored fp8 weight brought to it: weight-sized
        allocations). Where it fails on a collective call, this rank takes the call's first
        collective step all the same, as a refusal (:meth:`_refuse_call`; the header where the call
        starts with one, :meth:`_starts_with_header`), so that its peers fail that call instead of
        pairing it with this rank's next one."""
        try:
            return fn()
        except Exception as err:
            if self._collective:
                m = x.numel() // self.in_features_per_rank if isinstance(x, torch.Tensor) else 0
                self._refuse_call(err, header=self._starts_with_header(m))
            raise

    @property
    def _collective(self) -> bool:
        """Whether a call on this layer is a collective one (every rank of the group takes part)."""
        return self.comm.world > 1 and (self.sequence_parallel or self._COLLECTIVE_WITHOUT_SP)

    def _starts_with_header(self, m: int) -> bool:
        """Whether a collective call of ``m`` rows starts with its header (:meth:`_agree_rows`), not
        with the op's call: the unfused path's calls, and the calls of no rows (and the layer's own
        other cases: subclasses)."""
        return self.op is None or m == 0

    def _eager(self, x: torch.Tensor) -> bool:
        """Whether a forward on ``x`` runs the layer's body directly (an inference call that nothing
        traces: no gradient to record, :func:`untraced`), not through its registered op, whose
        result it is bit for bit; compile, export and autograd go through the op."""
        return not (torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)
                                                 or (self.weight is not None and self.weight.requires_grad))) \
            and untraced(x)

    def _decode(self, x: torch.Tensor, qweight, scale, bias) -> torch.Tensor:
        """bf16 ``[..., N]`` (the bias added) for ``x [..., K]`` of at most ``decode_rows`` rows."""
        self._check_open()
        if not self._loaded:
            self._require_loaded()
        if self._decode_gemm is None:
            raise RuntimeError(f"{self._name()}: decode_rows={self.decode_rows} but the decode GEMM runs only on one "
                               f"rank's local GEMM on an NVIDIA GPU (set decode_rows = 0)")
        if self._dense_rows and x.numel() > self.in_features_per_rank:
            if x.numel() <= self._mx_numel and self._mx_suits(qweight, scale):  # the fp8 weight through mx_decode
                return self._decode_gemm(x, qweight, scale, self.quant, n=self.out_features, bias=bias,
                                         scales_checked=True)
            # mxfp8's bf16 copy of the weight, the one the op's own calls read (kept per weight, and
            # refreshed where the weight or its scales changed: cco.backends.base.WeightDerived)
            qweight = self.op.vendor_weight(qweight, scale).dense
        return self._decode_gemm(x, qweight, scale, self.quant, n=self.out_features, bias=bias)

    def _mx_suits(self, qweight, scale) -> bool:
        """Whether mx_decode's kernel takes this mxfp8 weight's decode rows
        (``kernels_fused.hopper.mx_decode.unsuited``: its scales checked, one wait for the device, and
        its build loaded), asked once per weight version; a weight that no longer suits after it was
        written in place is refused (:meth:`_mx_verdict`)."""
        return self._mx_weights.get((qweight, scale), lambda: self._mx_verdict(qweight, scale, False),
                                    refresh=lambda was: self._mx_verdict(qweight, scale, was))

    def _mx_verdict(self, qweight, scale, was: bool) -> bool:
        from kernels_fused.hopper.mx_decode import unsuited

        why = unsuited(qweight, scale)
        if why is not None and was:  # a graph captured over the kernel would replay it on this weight
            raise RuntimeError(f"{self._name()}: the weight was written in place and mxfp8's decode kernel no longer "
                               f"takes it ({why}); a CUDA graph captured over this layer's decode rows would read it "
                               f"through that kernel. Make the layers with CCO_DECODE_MX=0 to keep these rows on the "
                               f"weight's bf16 copy")
        if why is not None:
            log.info("%s: mxfp8's decode rows read the weight's bf16 copy (%s)", self._name(), why)
        return why is None

    def _name(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        return (f"{self._FN}({self.in_features_per_rank} -> {self.out_features}, {self.quant}{sp}, rank "
                f"{self.comm.rank}/{self.comm.world})")

    # ---- weights --------------------------------------------------------------------------------
    def _zero_weight(self):
        return self._laid_out(torch.zeros(self.out_features, self.in_features_per_rank, device=self.device))

    def _laid_out(self, w: torch.Tensor):
        """A float shard [N, K] -> (fp8 weight, scale): padded, quantized and laid out as this
        layer's path reads it."""
        w = torch.nn.functional.pad(w.float(), (0, self.k_padded - w.shape[1], 0, self.n_padded - w.shape[0]))
        q, s = Q.quantize_b(w, self.quant)
        return self._arrange(q), s

    def _arrange(self, q: torch.Tensor) -> torch.Tensor:
        return preshuffle_b(q) if self.weight_layout == "bpreshuffle" else q

    def _row_major(self, q: torch.Tensor) -> torch.Tensor:
        return unshuffle_b(q) if self.weight_layout == "bpreshuffle" else q

    @torch.no_grad()
    def load_weight(self, w: torch.Tensor) -> None:
        """Load this rank's float weight shard (bf16, fp16 or fp32; the shape in the layer's
        docstring): padded, quantized (``cco.quant.quantize_b``) and laid out once. Not collective."""
        self._check_shape(w, "w", (self.out_features, self.in_features_per_rank), "load_weight")
        if not w.dtype.is_floating_point or w.element_size() == 1:
            raise TypeError(f"{type(self).__name__}.load_weight: w must be a bf16, fp16 or fp32 shard, got {w.dtype}; "
                            f"load an fp8 checkpoint shard with load_fp8(w_q, w_scale)")
        q, s = self._laid_out(w.to(self.device))
        self.qweight.copy_(q)
        self.weight_scale.copy_(s)
        if self.weight is not None:
            self.weight.copy_(w)
            self._master_seen = _master_mark(self.weight)  # the stored weight is its quantization

    @torch.no_grad()
    def load_fp8(self, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
        """Load an fp8 checkpoint shard: ``w_q`` e4m3 row-major (the shard's shape) and its scales in
        ``quant``'s layout (``cco.quant``; blockscale and mxfp8 scales may cover a last partial block:
        ``[ceil(N/128), ceil(K/128)]``, ``[N, ceil(K/32)]``). Padded with zero weights whose scales
        are one, laid out once. Not collective."""
        fn = f"{type(self).__name__}.load_fp8"
        n, k = self.out_features, self.in_features_per_rank
        self._check_shape(w_q, "w_q", (n, k), "load_fp8")
        if w_q.dtype != Q.FP8:
            raise TypeError(f"{fn}: w_q must be torch.float8_e4m3fn, got {w_q.dtype}; quantize a float shard with "
                            f"load_weight(w) instead")
        shape, dtype = C.scale_shape(n, k, self.quant)
        if tuple(w_scale.shape) != shape or w_scale.dtype != dtype:
            raise ValueError(f"{fn}: w_scale for quant={self.quant!r} must be {dtype} {list(shape)}, got "
                             f"{w_scale.dtype} {list(w_scale.shape)}")
        shard = C.Fp8Weight(qweight=w_q.to(self.device), scale=w_scale.to(self.device), quant=self.quant,
                            source="shard")
        padded = C.pad_fp8_weight(shard, n=self.n_padded, k=self.k_padded)
        self.qweight.copy_(self._arrange(padded.qweight))
        self.weight_scale.copy_(padded.scale)
        if self.weight is not None:
            self.weight.copy_(self.dequantized_weight().to(self.weight.dtype))
            self._master_seen = _master_mark(self.weight)  # the checkpoint's fp8 bytes stay the stored ones

    @torch.no_grad()
    def load_checkpoint(self, tensors, name: str, *, rank: int | None = None, world: int | None = None,
                        config: dict | None = None, requantize: bool = False) -> None:
        """Load this rank's shard of the fp8 checkpoint weight ``tensors[name]`` (the whole ``[N, K]``
        weight, its scale beside it): read (:func:`cco.nn.checkpoint.read_fp8_weight`), converted to
        the layer's ``quant`` where that is exact, sharded along the layer's split dimension (K for
        the row-parallel layer, N for the column-parallel one) over ``rank``/``world`` (default: the
        layer's group) in whole scale blocks, padded, :meth:`load_fp8`. Not collective.

        The layer's per-rank size must be the shard width (:func:`cco.nn.checkpoint.shard_width`:
        ``ceil(size / world)`` wherever that is whole blocks) and its quant the checkpoint's, or one
        its scales convert to exactly. Otherwise ValueError says what to build; ``requantize=True``
        instead dequantizes the weight and quantizes it again in the layer's quant (lossy: a second
        fp8 rounding), rank ``r`` taking ``[r * per_rank, (r + 1) * per_rank)`` of the split dimension."""
        fn = f"{self._FN}.load_checkpoint"
        rank = self.comm.rank if rank is None else rank
        world = self.comm.world if world is None else world
        n, k = self.out_features, self.in_features_per_rank
        dim, whole_dim = self._SHARD_DIM, 1 - self._SHARD_DIM
        size, whole = (n, k)[dim], (n, k)[whole_dim]
        letter = "NK"[dim]
        w = C.read_fp8_weight(tensors, name, config=config)
        if w.shape[whole_dim] != whole:
            raise ValueError(f"{fn}: {name} has {w.shape[whole_dim]} {('output', 'input')[whole_dim]} features but the "
                             f"layer has {self._WHOLE}={whole}")
        try:
            w = C.convert_fp8_weight(w, self.quant)
        except ValueError as err:
            if not requantize:
                raise ValueError(f"{fn}: {name} is a {w.source} checkpoint ({w.quant} scales) and the layer was built "
                                 f"with quant={self.quant!r} ({err}). Build the layer with "
                                 f"quant={w.quant!r} ({self._FN}(..., quant={w.quant!r})), or pass "
                                 f"requantize=True to quantize the dequantized weight again as {self.quant} "
                                 f"(lossy: a second fp8 rounding)") from None
            total = w.shape[dim]
            start, stop = rank * size, min((rank + 1) * size, total)
            if not 0 <= rank < world or total > world * size or start >= stop:
                raise ValueError(f"{fn}: {letter}={total} over world={world} does not fit {self._PER_RANK}={size} on "
                                 f"rank {rank}; build the layer with {self._PER_RANK}={-(-total // world)}")
            part = C.dequantize(w).narrow(dim, start, stop - start)
            pad = [0, 0, 0, 0]
            pad[1 if dim == 1 else 3] = size - (stop - start)
            self.load_weight(torch.nn.functional.pad(part, pad))
            return
        width = C.shard_width(w, world=world, dim=dim)
        if width != size:
            block = C.block_of(w.quant, dim)
            ragged = width * world > w.shape[dim]
            raise ValueError(f"{fn}: {name}'s {letter}={w.shape[dim]} over world={world} in whole {w.quant} blocks of "
                             f"{block} gives shards {width} wide, but the layer has {self._PER_RANK}={size}; build it "
                             f"with {self._PER_RANK}={width} (the last rank's shard is padded with zeros"
                             f"{', and so is its input' if ragged and dim == 1 else ''})")
        shard = C.pad_fp8_weight(C.shard_fp8_weight(w, rank=rank, world=world, dim=dim), n=n, k=k)
        self.load_fp8(shard.qweight, shard.scale)

    def _check_shape(self, t, arg: str, shape, verb: str) -> None:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{type(self).__name__}.{verb}: {arg} must be this rank's shard {list(shape)} "
                             f"({self._SHARD}), got {got}")

    def dequantized_weight(self, qweight: torch.Tensor | None = None,
                           scale: torch.Tensor | None = None) -> torch.Tensor:
        """The weight the forward multiplies by, fp32 (the shard's shape)."""
        qweight = self.qweight if qweight is None else qweight
        scale = self.weight_scale if scale is None else scale
        w = Q.dequantize_b(self._row_major(qweight), scale, self.quant)
        return w[:self.out_features, :self.in_features_per_rank]

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 weight, scale) the forward multiplies by, padded and laid out: the stored ones, or in
        training the master weight quantized afresh (it changes every step). In eval mode the stored
        ones follow the master weight: requantized where it was written since (an optimizer step
        taken in eval mode, a state_dict loaded) and only then."""
        master = self._parameters.get("weight")  # (not nn.Module's attribute lookup: see below)
        if master is not None:
            if self.training:
                with torch.no_grad():  # its gradient comes from the op's backward (straight through)
                    return self._laid_out(master)
            if not tracing():  # (traced: _op_forward, at run time)
                self._follow_if_moved()
        buffers = self._buffers  # not nn.Module's attribute lookup: a microsecond of an eager decode call
        return buffers["qweight"], buffers["weight_scale"]

    def _follow_if_moved(self) -> bool:
        """In eval mode, :meth:`_follow_master` where the master weight was written since the stored
        fp8 weight was quantized from it; whether it did."""
        master = self._parameters.get("weight")
        if master is None or self.training or _master_mark(master) == self._master_seen:
            return False
        self._follow_master()
        return True

    @torch.no_grad()
    def _follow_master(self) -> None:
        """The stored fp8 weight and scale requantized from the master weight (trainable layers)."""
        q, s = self._laid_out(self.weight)
        self.qweight.copy_(q)
        self.weight_scale.copy_(s)
        self._master_seen = _master_mark(self.weight)

    def train(self, mode: bool = True):
        super().train(mode)
        if not mode and self.weight is not None:  # eval(): the stored fp8 weight follows the master
            self._follow_master()
        return self

    # ---- module conversions: .to(), .half(), .float(), .cuda(), ... ---------------------------------
    # The layer's four tensors (the fp8 weight, its scales, the bf16 bias and master weight) are what
    # its kernels read in those dtypes, on the device its group's window lives on. nn.Module's rule
    # would cast the e4m3 weight (a floating dtype) to bf16 under ``model.to(torch.bfloat16)`` and the
    # scales with it: the quantized weight lost, or a bf16 tensor handed to an fp8 kernel.
    _OWN_TENSORS = ("qweight", "weight_scale", "bias", "weight")

    def _apply(self, fn, recurse=True):
        """A dtype conversion leaves the layer's tensors as they are (it computes in fp8 and returns
        bf16 whatever its input's dtype); a move to another device raises (the op's window, the
        communicator and the kernels are bound to ``self.device``: build the layer there); anything
        else (the same device, ``share_memory``) applies as nn.Module applies it."""
        # what fn does to a tensor of each one's dtype and device, learnt on an empty one (no copy made)
        applied = [(t, fn(torch.empty(0, dtype=t.dtype, device=t.device))) for _, t in self._own_tensors()]
        for t, probe in applied:
            if probe.device != t.device:
                raise ValueError(f"{self._name()}: cannot move to {probe.device}: the layer is bound to {t.device} "
                                 f"(its group's window, communicator and kernels); build it on {probe.device} "
                                 f"instead (group and tensors there) and load its weight there")
        if all(probe.dtype == t.dtype for t, probe in applied):
            return super()._apply(fn, recurse)
        # a dtype conversion: the rest of the module (its children) converts, the layer's own tensors stay
        held = [(store, name, store.pop(name)) for store in (self._parameters, self._buffers)
                for name in self._OWN_TENSORS if store.get(name) is not None]
        try:
            return super()._apply(fn, recurse)
        finally:
            for store, name, t in held:
                store[name] = t

    def __deepcopy__(self, memo):
        raise TypeError(self._copy_refused("copied"))

    def __getstate__(self):  # pickle, copy.copy, torch.save(model)
        raise TypeError(self._copy_refused("pickled"))

    def _copy_refused(self, verb: str) -> str:
        # a copy would share (or lack) the group's communicator and window: one rank's copy calling
        # the op would pair with its peers' calls of the original layer
        return (f"{self._name()}: a tensor-parallel layer cannot be {verb}: it holds its group's communicator and the "
                f"window it shares with its family. Build another layer on every rank (construction is collective) "
                f"and load_state_dict(layer.state_dict()); save the weights with torch.save(model.state_dict())")

    def _own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t) for name in self._OWN_TENSORS
                if (t := self._parameters.get(name, self._buffers.get(name))) is not None]

    # ---- state_dict: the weight row-major, whatever this layer's backend reads ------------------------
    # nn.Module's per-module state_dict version: 2 saves ``qweight`` row-major (what load_fp8 takes, and
    # what a layer of any backend turns into its own layout on load), so a state_dict saved where the
    # backend reads bpreshuffle (the CPU reference, gfx950) loads right where it reads row-major (CUDA,
    # the unfused path), and back. Version 1 (earlier saves) stored the saving layer's layout, which the
    # state_dict does not name: such a ``qweight`` is loaded as it is, as before. A state_dict without
    # its metadata (a plain dict; safetensors keeps none) is read as version 2: every save since is one,
    # and a version-1 save kept by torch.save still names its version.
    _version = 2

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "qweight"
        if key not in destination:
            return
        master = self._parameters.get("weight")
        if master is not None and _master_mark(master) != self._master_seen:
            # a trainable layer's stored fp8 weight may lag its master (trained in train mode, where
            # each forward quantizes afresh): what it saves is the master's quantization
            with torch.no_grad():
                q, destination[prefix + "weight_scale"] = self._laid_out(master)
            destination[key] = self._row_major(q)
        elif self.weight_layout == "bpreshuffle":
            destination[key] = unshuffle_b(self.qweight.detach())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        refused = []
        for name in ("qweight", "weight_scale"):  # the quantized weight: its own dtype, never a cast of another
            key, own = prefix + name, self._buffers[name]
            t = state_dict.get(key)
            if isinstance(t, torch.Tensor) and t.dtype != own.dtype:
                error_msgs.append(f"{self._name()}: {key} is {t.dtype} in the state_dict but the layer's is {own.dtype} "
                                  f"(quant={self.quant!r}); a cast would not be its quantization (load a float "
                                  f"weight with load_weight, an fp8 one with its scales with load_fp8)")
                refused.append(key)
                del state_dict[key]
        key = prefix + "qweight"
        q = state_dict.get(key)
        if (self.weight_layout == "bpreshuffle" and local_metadata.get("version", self._version) >= 2
                and isinstance(q, torch.Tensor) and tuple(q.shape) == tuple(self.qweight.shape)):
            state_dict[key] = preshuffle_b(q.to(self.qweight.device))  # a shape torch refuses stays for its message
        # assign=True would put the state_dict's tensors in place of the layer's (another device, a
        # bf16 bias as fp32, and a weight the blank check takes for unwritten): copied into them instead
        local_metadata = {**local_metadata, "assign_to_params_buffers": False}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        missing_keys[:] = [k for k in missing_keys if k not in refused]  # reported as refused, not missing

    # ---- the blank check ---------------------------------------------------------------------------
    def _weight_written(self) -> bool:
        return self.qweight._version != self._blank[0] or (
            self.weight is not None and self.weight._version != self._blank[1])

    def _require_loaded(self) -> None:
        """Raise if this rank's weight was never written (a blank layer would return zeros); in a
        collective call on every rank of the group if any rank's was not. Fused: the blank rank
        rejects its share of the call, so its peers fail it with PeerRejectedError; unfused: the
        call's header (:meth:`_agree_rows`) carries it, and every rank raises. A local call (the
        column-parallel layer without sequence parallelism) raises on its own rank only."""
        written = self._weight_written()
        if written:
            self._loaded = True
            return
        collective = self._collective
        if collective and self.op is None:  # the unfused path agrees in its call's header
            raise AssertionError(f"{self._name()}: an unfused collective call checks its weight in _agree_rows")
        err = self._blank_error([self.comm.rank])
        if collective:
            self.op.reject(err)
        raise err

    def _blank_error(self, blank: list[int]) -> RuntimeError:
        return RuntimeError(f"{self._name()}: called before its weight was loaded (rank(s) {blank} hold the blank "
                            f"weight, which would return zeros); call load_weight(w_shard), load_fp8(w_q, w_scale), "
                            f"load_checkpoint(...) or load_state_dict on every rank before the first forward")

    # ---- lifetime ---------------------------------------------------------------------------------
    @property
    def window_bytes(self) -> int:
        """Bytes of the window this layer's op holds (shared with its family), 0 when unfused."""
        return 0 if self.op is None else self.op.config.window.nbytes

    @property
    def _reduce_group(self):
        """The group of the unfused path's collectives; a closed layer has none."""
        self._check_open()
        return self._group

    def close(self) -> None:
        """Release the shared op (the last layer of a family frees its window) and the layer's
        reference to its group (a destroyed group is freed once nothing holds it; docs/experiments.md,
        "the exit-time abort, its holders"). Idempotent; local."""
        self._closed = True
        self._group = None
        library.unregister(self._handle)
        if self._dual is not None:
            self._dual.close()
        if self.op is not None:
            self._pool.release(self.op)
            if self._pool.users(self.op):  # the family's other layers keep the op open: its peers'
                self.op.note_layer_closed(self._tag)  # timeouts on this layer's calls then name this rank
            self.op = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name()}: the layer is closed; build a new one")

    def _repr_sizes(self) -> str:
        raise NotImplementedError

    def extra_repr(self) -> str:
        path = "fused" if self.fallback_reason is None else f"unfused ({self.fallback_reason})"
        s = (f"{self._repr_sizes()}, quant={self.quant!r}, sequence_parallel={self.sequence_parallel}, "
             f"rank={self.comm.rank}/{self.comm.world}, backend={self.shape.backend}, path={path}, "
             f"bias={self.bias is not None}, trainable={self.weight is not None}")
        if self.shape.padding:
            s += f", padded {self.shape.padding}"
        if self.op is not None:
            s += (f", m_max={self.m_max}, window {_mib(self.window_bytes)} shared by "
                  f"{self._pool.users(self.op)} layer(s)")
        return s
