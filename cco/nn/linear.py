"""``RowParallelLinear``: the tensor-parallel layer that ends in an all-reduce, on the fused op.

Unfused equivalent, on every rank ``r`` of the group (``x_r`` this rank's K slice of the input,
``W_r`` its ``[out_features, in_features_per_rank]`` weight shard)::

    y = all_reduce(x_r @ W_r.T) + bias                 # bf16 [..., out_features], the same on every rank

computed as the op computes it: ``x_r`` and ``W_r`` in fp8 (``quant``), each rank's partial product
in fp32 rounded to bf16, the partials summed in fp32, rounded to bf16.

What the layer does once, at load (``load_weight`` from a bf16/fp32 shard, ``load_fp8`` from an fp8
checkpoint shard with its scales): pads the shard with zeros to the shape the backend runs
(``cco.shapes.layer_shape``: per-rank columns a whole number of the backend's tiles, K whole 128-wide
tiles), quantizes it, and lays it out in the order the backend's kernel reads (``bpreshuffle`` for the
gfx950 kernel and the CPU reference, row-major for the Triton kernels). Per call: flattens the
leading dimensions, quantizes the activations on their device in one kernel that also writes the
zero K padding (Triton on GPUs, torch on the CPU), runs the op (calls of more than ``m_max`` rows in
pieces of ``m_max``), drops the padded output columns, adds the bias. blockscale calls on NVIDIA are
quantized into zero rows up to a multiple of 4 (what cuBLAS's blockwise GEMM takes; the output keeps
the caller's rows). An eager inference call that nothing traces (:func:`untraced`, no gradient to
record) runs this body directly; everything else goes through ``torch.ops.cco.row_parallel_linear``.

Where the fused op cannot run (a backend that refuses the shape even padded, a device it does not
run on, ``mode="unfused"``), the layer runs the unfused equivalent above (a GEMM of the same
quantized operands, then ``torch.distributed.all_reduce`` on the group), says why in ``repr`` and in
a warning of the ``cco.nn`` logger, and every rank of the group takes the same path.

Autograd (training): the backward needs no communication. The output is replicated, so each rank
already holds the whole ``grad_y``; with straight-through quantization::

    grad_x_r = grad_y @ W_r          # W_r: the weight the forward used, dequantized to bf16
    grad_W_r = grad_y.T @ x_r        # only with trainable=True: a bf16 master weight
    grad_bias = grad_y.sum(leading)  # the same on every rank

in bf16 matmuls (fp32 accumulation). A trainable layer requantizes its master weight in every
training forward; ``eval()`` refreshes the stored fp8 weight from it.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from cco import library, shapes
from cco import quant as Q
from cco.comm import Communicator
from cco.nn import checkpoint as C
from cco.nn import sequence
from cco.nn.pool import DEFAULT_POOL, WindowPool
from cco.op import DEFAULT_DEADLINE_S, GemmAllReduceOp
from cco.preshuffle import preshuffle_b, unshuffle_b

log = logging.getLogger("cco.nn")
MODES = ("fused", "split", "unfused")
_FN = "RowParallelLinear"
_E8M0_ONE = 127  # e8m0 bits of 2**0: the scale of the zero padding of an mxfp8 weight


def quantize_activation(x: torch.Tensor, quant: str, *, k_padded: int, m_padded: int | None = None):
    """The layer's activation quantizer on ``x``'s device: Triton on GPUs (NVIDIA and ROCm), torch on
    the CPU; ``(e4m3 [m_padded, k_padded], scale)`` in the layout of ``quant``, rows past M zero."""
    if x.device.type == "cuda":
        from kernels_fused.hopper.quantize import quantize_activation as on_gpu
        return on_gpu(x, quant, k_padded=k_padded, m_padded=m_padded)
    from kernels_fused.cpu.quantize import quantize_activation as on_cpu
    if m_padded is not None and m_padded != x.shape[0]:
        x = torch.nn.functional.pad(x, (0, 0, 0, m_padded - x.shape[0]))
    return on_cpu(x, quant, k_padded=k_padded)


def _check_arguments(*, in_features_per_rank, out_features, m_max, mode, quant) -> None:
    for name, value in (("in_features_per_rank", in_features_per_rank), ("out_features", out_features),
                        ("m_max", m_max)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{_FN}: {name}={value!r} must be a positive int")
    if mode not in MODES:
        raise ValueError(f"{_FN}: mode={mode!r} is not supported; pass one of {', '.join(MODES)}")
    Q.check_quant(quant, fn=_FN)


def untraced(x: torch.Tensor) -> bool:
    """Whether nothing records a call on ``x``: a plain tensor (not a FakeTensor, a functional or
    proxy tensor, a DTensor or another subclass), outside torch.compile / torch.export, with no
    dispatch mode on the stack (make_fx, FakeTensorMode), no functorch transform, no
    ``torch.jit.trace``. There the layer's forward calls its body directly instead of
    ``torch.ops.cco.row_parallel_linear``: the dispatcher and the op's autograd wrapper cost an
    eager decode-sized call tens of microseconds of host time (docs/decode.md)."""
    return (type(x) is torch.Tensor and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
            and torch._C._functorch.maybe_current_level() is None and torch._C._get_tracing_state() is None)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class RowParallelLinear(torch.nn.Module):
    """Row-parallel linear layer: ``y = all_reduce(x_shard @ W_shard.T) + bias`` through cco.

    Arguments (all but the sizes keyword-only):
      in_features_per_rank: K of this rank's input slice and weight shard.
      out_features:  N, the layer's output features (every rank returns all of them).
      group:         a torch.distributed group (the tensor-parallel group; None: the world) or a
                     :class:`cco.comm.Communicator`. Construction is collective over it.
      quant:         "ptpc" | "blockscale" | "mxfp8" (``cco.quant``).
      bias:          add a bf16 bias of ``out_features`` after the all-reduce.
      m_max:         rows (tokens) one op call takes; sizes the shared window. Calls with more rows
                     run in pieces of ``m_max``.
      mode:          "fused" | "split" (the op's modes) | "unfused" (GEMM + all_reduce, the fallback).
      transport, gather_dtype, chunks, deadline_s: the op's (``cco.op.GemmAllReduceOp``).
      trainable:     keep a bf16 master weight (a Parameter) and compute its gradient.
      pool:          the :class:`cco.nn.WindowPool` whose ops this layer shares (default: the process's).
      backward:      with sequence_parallel: "bf16" (the all-gather of grad_y unfused, in bf16) or "fp8"
                     (fused into grad_y @ W_r by ``AllGatherGemmOp``, e4m3 gradients); ``cco.nn.sequence``.
      sequence_parallel: return this rank's rows ``r*M/W..(r+1)*M/W`` of the output (``[M/W, ...,
                     out_features]``, the first input dimension the tokens) through the fused
                     reduce-scatter (``cco.reduce_scatter``) instead of every row; ``cco.nn.sequence``.

    The weight is blank until :meth:`load_weight`, :meth:`load_fp8`, :meth:`load_checkpoint` or
    ``load_state_dict``: a call before that raises on every rank (it would return zeros).

    fp8 checkpoints (:meth:`load_checkpoint`, ``cco.nn.checkpoint``): the whole weight as it ships,
    ``<prefix>.weight`` e4m3 ``[out_features, K]`` with its scale beside it: DeepSeek-V3
    ``weight_scale_inv`` (fp32 128x128 blocks, power-of-two ones too) and V4 ``scale`` (e8m0) load
    into a ``quant="blockscale"`` layer; compressed-tensors ``weight_scale`` per tensor or per row
    (FP8, FP8_DYNAMIC) into ``"ptpc"``, 128x128 (FP8_BLOCK) into ``"blockscale"``, uint8 ``[N, K/32]``
    (MXFP8) into ``"mxfp8"``. Another quant only where the scales convert exactly (power-of-two block
    scales into mxfp8, a per-tensor scale into blockscale); anything else raises, naming the quant to build
    (or ``requantize=True``, lossy). Each rank takes whole scale blocks of K: build the layer with
    ``in_features_per_rank = cco.nn.shard_width(w, world=world, dim=1)``, ``ceil(K / world)``
    wherever that is whole blocks; the last rank's shard may be shorter, padded with zeros (its
    input's missing columns must be zeros too). ``float8_e4m3fnuz`` is refused.
    """

    _SHARD = "[out_features, in_features_per_rank]"  # the weight shard's dimensions, for errors

    def __init__(self, in_features_per_rank: int, out_features: int, *, group=None, quant: str = "ptpc",
                 bias: bool = False, m_max: int = 4096, mode: str = "fused", transport: str | None = None,
                 gather_dtype: str = "bf16", chunks=None, deadline_s: float = DEFAULT_DEADLINE_S,
                 trainable: bool = False, pool: WindowPool | None = None, sequence_parallel: bool = False,
                 backward: str = "bf16"):
        super().__init__()
        self.sequence_parallel = bool(sequence_parallel)  # the reduce-scatter along tokens: cco.nn.sequence
        self._pool = pool or DEFAULT_POOL
        self.comm = self._pool.communicator(group)
        error = None
        try:
            _check_arguments(in_features_per_rank=in_features_per_rank, out_features=out_features, m_max=m_max,
                             mode=mode, quant=quant)
        except (TypeError, ValueError) as err:
            error = err
        # construction is collective: every rank of the group agrees on the arguments first
        self.comm.agree(_FN, dict(in_features_per_rank=in_features_per_rank, out_features=out_features, quant=quant,
                                  bias=bias, m_max=m_max, mode=mode, transport=transport, gather_dtype=gather_dtype,
                                  chunks=chunks, deadline_s=deadline_s, trainable=trainable,
                                  sequence_parallel=sequence_parallel, backward=backward), error=error)
        self.in_features_per_rank, self.out_features = in_features_per_rank, out_features
        self.quant, self.m_max, self.mode = quant, m_max, mode
        self.device = self.comm.device
        # the group the unfused path all-reduces on: the caller's, whose backend carries the device's
        # tensors (NCCL on NVIDIA); the communicator's bootstrap group where a Communicator was given
        self._reduce_group = self.comm.group if group is None or isinstance(group, Communicator) else group
        op_options = dict(quant=quant, mode="fused" if mode == "unfused" else mode, transport=transport,
                          gather_dtype=gather_dtype, chunks=chunks)
        try:
            weight_layout = shapes.backend_class(device=self.device).weight_layouts[0]
        except ValueError:  # no backend runs on this device: layer_shape says why, the layer falls back
            weight_layout = "row-major"
        op_class, shape_options = GemmAllReduceOp, op_options
        if self.sequence_parallel:
            op_class, op_options, shape_options = sequence.reduce_scatter_options(op_options)
        plan = shapes.layer_shape(out_features, in_features_per_rank, self.comm.world, m_max=m_max,
                                  device=self.device, weight_layout=weight_layout, **shape_options)
        reason = "mode='unfused' was asked for" if mode == "unfused" else plan.reason
        # one verdict for the whole group: a rank whose backend refuses makes every rank fall back
        verdicts = self.comm.all_gather_object(reason)
        refused = [f"rank {r}: {why}" for r, why in enumerate(verdicts) if why is not None]
        self.fallback_reason = None if not refused else (reason if len(set(verdicts)) == 1 else "; ".join(refused))
        self.shape = plan
        self.n_padded, self.k_padded = plan.n_padded, plan.k_padded
        self.op = None
        self._row_multiple = 1  # rows a call is padded to a multiple of (zero rows, see _rows)
        if self.fallback_reason is None:
            self.weight_layout = weight_layout
            if quant == "blockscale" and not self.sequence_parallel and self.device.type == "cuda" and not getattr(torch.version, "hip", None):
                from kernels_fused.hopper.vendor import BLOCKWISE_ROW_MULTIPLE
                self._row_multiple = BLOCKWISE_ROW_MULTIPLE
            self.op = self._pool.acquire(self.comm, op_class=op_class, n=self.n_padded, k=self.k_padded, m_max=m_max,
                                         deadline_s=deadline_s, weight_layout=weight_layout, **op_options)
        else:
            self.weight_layout = "row-major"  # no kernel reads it: the unfused GEMM's own layout
            log.warning("%s", f"{self._name()}: runs unfused (GEMM + all_reduce): {self.fallback_reason}")
        if plan.padding:
            log.info("%s", f"{self._name()}: weight padded with zeros, {plan.padding}")

        w_q, w_s = self._zero_weight()
        self.register_buffer("qweight", w_q)
        self.register_buffer("weight_scale", w_s)
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=torch.bfloat16, device=self.device))
        self.weight = None
        if trainable:
            self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features_per_rank, dtype=torch.bfloat16,
                                                         device=self.device))
        # versions of the blank weight: any write (load_weight, load_fp8, load_state_dict, an in-place
        # init of the master weight) moves one, so "loaded" costs no flag that a loader could forget
        self._blank = (self.qweight._version, None if self.weight is None else self.weight._version)
        self._loaded = False
        # sequence parallel, backward="fp8": the all-gather of grad_y fused into grad_y @ W_r (cco.nn.sequence)
        self._dual = sequence.make_dual(self, backward, gathers=True, n=in_features_per_rank, k=out_features,
                                        mode=op_options["mode"], transport=transport, chunks=chunks,
                                        deadline_s=deadline_s, fn=_FN)
        self._handle = library.register(self)
        self._closed = False

    def _name(self) -> str:
        return (f"{_FN}({self.in_features_per_rank} -> {self.out_features}, {self.quant}, rank "
                f"{self.comm.rank}/{self.comm.world})")

    # ---- weights --------------------------------------------------------------------------------
    def _zero_weight(self):
        return self._laid_out(torch.zeros(self.out_features, self.in_features_per_rank, device=self.device))

    def _laid_out(self, w: torch.Tensor):
        """A float shard [out_features, in_features_per_rank] -> (fp8 weight, scale): padded,
        quantized and laid out as this layer's path reads it."""
        w = torch.nn.functional.pad(w.float(), (0, self.k_padded - w.shape[1], 0, self.n_padded - w.shape[0]))
        q, s = Q.quantize_b(w, self.quant)
        return self._arrange(q), s

    def _arrange(self, q: torch.Tensor) -> torch.Tensor:
        return preshuffle_b(q) if self.weight_layout == "bpreshuffle" else q

    def _row_major(self, q: torch.Tensor) -> torch.Tensor:
        return unshuffle_b(q) if self.weight_layout == "bpreshuffle" else q

    @torch.no_grad()
    def load_weight(self, w: torch.Tensor) -> None:
        """Load this rank's float weight shard ``[out_features, in_features_per_rank]`` (bf16, fp16
        or fp32): padded, quantized (``cco.quant.quantize_b``) and laid out once. Not collective."""
        self._check_shape(w, "w", (self.out_features, self.in_features_per_rank), "load_weight")
        if not w.dtype.is_floating_point or w.element_size() == 1:
            raise TypeError(f"{type(self).__name__}.load_weight: w must be a bf16, fp16 or fp32 shard, got {w.dtype}; "
                            f"load an fp8 checkpoint shard with load_fp8(w_q, w_scale)")
        q, s = self._laid_out(w.to(self.device))
        self.qweight.copy_(q)
        self.weight_scale.copy_(s)
        if self.weight is not None:
            self.weight.copy_(w)

    @torch.no_grad()
    def load_fp8(self, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
        """Load an fp8 checkpoint shard: ``w_q`` e4m3 ``[out_features, in_features_per_rank]`` row-major
        and its scales in ``quant``'s layout (``cco.quant``; blockscale and mxfp8 scales may cover a
        last partial block: ``[ceil(N/128), ceil(K/128)]``, ``[N, ceil(K/32)]``). Padded with zero
        weights whose scales are one, laid out once. Not collective."""
        fn = f"{type(self).__name__}.load_fp8"  # ColumnParallelLinear shares the weight methods
        n, k = self.out_features, self.in_features_per_rank
        self._check_shape(w_q, "w_q", (n, k), "load_fp8")
        if w_q.dtype != Q.FP8:
            raise TypeError(f"{fn}: w_q must be torch.float8_e4m3fn, got {w_q.dtype}; quantize a float shard with "
                            f"load_weight(w) instead")
        cdiv = lambda a, b: -(-a // b)  # noqa: E731
        want = {"ptpc": ((n,), torch.float32),
                "blockscale": ((cdiv(n, Q.SCALE_BLOCK), cdiv(k, Q.SCALE_BLOCK)), torch.float32),
                "mxfp8": ((n, cdiv(k, Q.MX_GROUP)), Q.E8M0)}[self.quant]
        if tuple(w_scale.shape) != want[0] or w_scale.dtype != want[1]:
            raise ValueError(f"{fn}: w_scale for quant={self.quant!r} must be {want[1]} {list(want[0])}, got "
                             f"{w_scale.dtype} {list(w_scale.shape)}")
        pad_k, pad_n = self.k_padded - k, self.n_padded - n
        q = torch.nn.functional.pad(w_q.to(self.device).view(torch.uint8), (0, pad_k, 0, pad_n)).view(Q.FP8)
        s = w_scale.to(self.device)
        if self.quant == "ptpc":
            s = torch.nn.functional.pad(s, (0, pad_n), value=1.0)
        else:
            full = self.weight_scale.shape
            one = 1.0 if self.quant == "blockscale" else _E8M0_ONE
            raw = s if self.quant == "blockscale" else s.view(torch.uint8)
            raw = torch.nn.functional.pad(raw, (0, full[1] - raw.shape[1], 0, full[0] - raw.shape[0]), value=one)
            s = raw if self.quant == "blockscale" else raw.view(Q.E8M0)
        self.qweight.copy_(self._arrange(q))
        self.weight_scale.copy_(s)
        if self.weight is not None:
            self.weight.copy_(self.dequantized_weight().to(self.weight.dtype))

    @torch.no_grad()
    def load_checkpoint(self, tensors, name: str, *, rank: int | None = None, world: int | None = None,
                        config: dict | None = None, requantize: bool = False) -> None:
        """Load this rank's K shard of the fp8 checkpoint weight ``tensors[name]`` (the whole
        ``[out_features, K]`` weight, its scale beside it): read (:func:`cco.nn.checkpoint.read_fp8_weight`),
        converted to the layer's ``quant`` where that is exact, sharded on K over ``rank``/``world``
        (default: the layer's group) in whole scale blocks, padded, :meth:`load_fp8`. Not collective.

        The layer must be built with ``in_features_per_rank`` = the shard width
        (:func:`cco.nn.checkpoint.shard_width`: ``ceil(K / world)`` wherever that is whole blocks) and
        the checkpoint's quant, or one its scales convert to exactly. Otherwise ValueError says what to
        build; ``requantize=True`` instead dequantizes the weight and quantizes it again in the layer's
        quant (lossy: a second fp8 rounding), rank ``r`` taking columns ``[r * in_features_per_rank,
        ...)``."""
        fn = f"{_FN}.load_checkpoint"
        rank = self.comm.rank if rank is None else rank
        world = self.comm.world if world is None else world
        n, k = self.out_features, self.in_features_per_rank
        w = C.read_fp8_weight(tensors, name, config=config)
        if w.shape[0] != n:
            raise ValueError(f"{fn}: {name} has {w.shape[0]} output features but the layer has out_features={n}")
        try:
            w = C.convert_fp8_weight(w, self.quant)
        except ValueError as err:
            if not requantize:
                raise ValueError(f"{fn}: {name} is a {w.source} checkpoint ({w.quant} scales) and the layer was built "
                                 f"with quant={self.quant!r} ({err}). Build the layer with "
                                 f"quant={w.quant!r} (RowParallelLinear(..., quant={w.quant!r})), or pass "
                                 f"requantize=True to quantize the dequantized weight again as {self.quant} "
                                 f"(lossy: a second fp8 rounding)") from None
            k_total = w.shape[1]
            start, stop = rank * k, min((rank + 1) * k, k_total)
            if not 0 <= rank < world or k_total > world * k or start >= stop:
                raise ValueError(f"{fn}: K={k_total} over world={world} does not fit in_features_per_rank={k} on "
                                 f"rank {rank}; build the layer with in_features_per_rank={-(-k_total // world)}")
            part = C.dequantize(w)[:, start:stop]
            self.load_weight(torch.nn.functional.pad(part, (0, k - (stop - start))))
            return
        width = C.shard_width(w, world=world, dim=1)
        if width != k:
            block = C.block_of(w.quant, 1)
            raise ValueError(f"{fn}: {name}'s K={w.shape[1]} over world={world} in whole {w.quant} blocks of {block} "
                             f"gives shards {width} wide, but the layer has in_features_per_rank={k}; build it with "
                             f"in_features_per_rank={width} (the last rank's shard is padded with zeros"
                             f"{', and so is its input' if width * world > w.shape[1] else ''})")
        shard = C.pad_fp8_weight(C.shard_fp8_weight(w, rank=rank, world=world, dim=1), n=n, k=k)
        self.load_fp8(shard.qweight, shard.scale)

    def _check_shape(self, t, arg: str, shape, verb: str) -> None:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{type(self).__name__}.{verb}: {arg} must be this rank's shard {list(shape)} "
                             f"({self._SHARD}), got {got}")

    def dequantized_weight(self, qweight: torch.Tensor | None = None,
                           scale: torch.Tensor | None = None) -> torch.Tensor:
        """The weight the forward multiplies by, fp32 ``[out_features, in_features_per_rank]``."""
        qweight = self.qweight if qweight is None else qweight
        scale = self.weight_scale if scale is None else scale
        w = Q.dequantize_b(self._row_major(qweight), scale, self.quant)
        return w[:self.out_features, :self.in_features_per_rank]

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 weight, scale) the forward multiplies by, padded and laid out: the stored ones, or in
        training the master weight quantized afresh (it changes every step)."""
        if self.weight is not None and self.training:
            with torch.no_grad():  # its gradient comes from the op's backward (straight through)
                return self._laid_out(self.weight)
        return self.qweight, self.weight_scale

    def train(self, mode: bool = True):
        super().train(mode)
        if not mode and self.weight is not None:  # eval(): the stored fp8 weight follows the master
            with torch.no_grad():
                q, s = self._laid_out(self.weight)
                self.qweight.copy_(q)
                self.weight_scale.copy_(s)
        return self

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[..., out_features]``, the same on every rank of the group, for this rank's input
        slice ``x [..., in_features_per_rank]`` (any float dtype). Collective: every rank calls it
        with the same leading shape."""
        if x.shape[-1] != self.in_features_per_rank:
            err = ValueError(f"{_FN}: x has {x.shape[-1]} features in its last dimension but the layer takes "
                             f"in_features_per_rank={self.in_features_per_rank}; pass this rank's slice of the input")
            if self.op is not None:  # still this rank's share of the collective call: the peers fail it too
                self.op.reject(err)
            raise err
        qweight, scale = self.quantized_weight()
        if self.sequence_parallel:
            return sequence.row_parallel_forward(self, x, qweight, scale)
        # an eager inference call (no gradient to record, nothing tracing it) skips the registered op,
        # whose result it is, bit for bit; compile, export and autograd go through the op
        if not (torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)
                                             or (self.weight is not None and self.weight.requires_grad))) \
                and untraced(x):
            return self._cco_forward(x, qweight, scale, self.bias)
        return torch.ops.cco.row_parallel_linear(x, qweight, scale, self.bias, self.weight, self._handle,
                                                 self.out_features)

    def _cco_forward(self, x, qweight, scale, bias) -> torch.Tensor:
        """The body of ``torch.ops.cco.row_parallel_linear`` (real tensors, outside the compiler)."""
        if self._closed:
            raise RuntimeError(f"{self._name()}: the layer is closed; build a new one")
        if self.sequence_parallel:
            return sequence.row_parallel_body(self, x, qweight, scale, bias, quantize_activation)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features_per_rank)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m, n = x2.shape[0], self.out_features
        if m <= self.m_max and m > 0:
            out = self._rows(x2, qweight, scale)
            out = out if self.n_padded == n else out[:, :n].contiguous()
        else:  # no rows (every rank alike: nothing to reduce), or more than one call takes
            out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
            for r0 in range(0, m, self.m_max):
                out[r0:r0 + self.m_max] = self._rows(x2[r0:r0 + self.m_max], qweight, scale)[:, :n]
        if bias is not None:
            out += bias
        return out.view(*lead, n)

    def _weight_written(self) -> bool:
        return self.qweight._version != self._blank[0] or (
            self.weight is not None and self.weight._version != self._blank[1])

    def _require_loaded(self) -> None:
        """Raise on every rank of the group if any rank's weight was never written (a blank layer
        would return zeros). Fused: the blank rank rejects its share of the call, so its peers fail
        it with PeerRejectedError; unfused: the ranks agree first, since their next step is an
        all_reduce that a raising rank would leave its peers waiting in."""
        written = self._weight_written()
        if self.op is None and self.comm.world > 1:
            blank = [r for r, ok in enumerate(self.comm.all_gather_object(written)) if not ok]
        else:
            blank = [] if written else [self.comm.rank]
        if not blank:
            self._loaded = True
            return
        err = RuntimeError(f"{self._name()}: called before its weight was loaded (rank(s) {blank} hold the blank "
                           f"weight, which would return zeros); call load_weight(w_shard) or load_fp8(w_q, w_scale) "
                           f"(or load_state_dict) on every rank before the first forward")
        if not written and self.op is not None:
            self.op.reject(err)
        raise err

    def _rows(self, x2, qweight, scale) -> torch.Tensor:
        """bf16 [rows, n_padded]: one collective call."""
        if not self._loaded:
            self._require_loaded()
        m = x2.shape[0]
        if self.op is not None:
            # cuBLAS's blockwise GEMM takes a multiple of 4 rows only: quantize into zero rows up to one
            # (no copy; every rank pads alike) rather than fall back to the own kernel at decode sizes
            rows = self._rows_for(m)
            a, a_scale = quantize_activation(x2, self.quant, k_padded=self.k_padded, m_padded=rows)
            out = self.op(a, qweight, a_scale, scale)
            return out if rows == m else out[:m]
        a, a_scale = quantize_activation(x2, self.quant, k_padded=self.k_padded)
        partial = Q.reference_gemm(a, self._row_major(qweight), a_scale, scale, self.quant).float()
        dist.all_reduce(partial, group=self._reduce_group)
        return partial.to(torch.bfloat16)

    def _rows_for(self, m: int) -> int:
        """Rows the op runs for a call of ``m`` rows: ``m`` padded with zero rows to a multiple of
        ``_row_multiple`` while that stays within ``m_max``."""
        rows = -(-m // self._row_multiple) * self._row_multiple
        return rows if rows <= self.m_max else m

    def _cco_backward(self, grad, x, qweight, scale, *, input_grad: bool, weight_grad: bool, bias_grad: bool):
        """(grad_x, grad_master_weight, grad_bias) for ``grad`` of the output: no communication
        (sequence parallel: the all-gather of ``grad`` along tokens first, ``cco.nn.sequence``)."""
        if self._dual is not None:
            return sequence.row_parallel_fp8_backward(self, grad, x, qweight, scale, input_grad=input_grad,
                                                      weight_grad=weight_grad, bias_grad=bias_grad,
                                                      quantize=quantize_activation)
        if self.sequence_parallel:
            grad = sequence.gather_output_grad(self, grad)
        g = grad.reshape(-1, self.out_features).to(torch.bfloat16)
        grad_x = grad_w = grad_b = None
        if input_grad:
            w = self.dequantized_weight(qweight, scale).to(torch.bfloat16)
            grad_x = (g @ w).view(x.shape).to(x.dtype)
        if weight_grad:
            grad_w = g.t() @ x.reshape(-1, self.in_features_per_rank).to(torch.bfloat16)
        if bias_grad:
            grad_b = g.float().sum(0)
        return grad_x, grad_w, grad_b

    # ---- lifetime ---------------------------------------------------------------------------------
    @property
    def window_bytes(self) -> int:
        """Bytes of the window this layer's op holds (shared with its family), 0 when unfused."""
        return 0 if self.op is None else self.op.config.window.nbytes

    def close(self) -> None:
        """Release the shared op (the last layer of a family frees its window). Idempotent; local."""
        self._closed = True
        library.unregister(self._handle)
        if self._dual is not None:
            self._dual.close()
        if self.op is not None:
            self._pool.release(self.op)
            self.op = None

    def extra_repr(self) -> str:
        path = "fused" if self.fallback_reason is None else f"unfused ({self.fallback_reason})"
        s = (f"in_features_per_rank={self.in_features_per_rank}, out_features={self.out_features}, "
             f"quant={self.quant!r}, rank={self.comm.rank}/{self.comm.world}, backend={self.shape.backend}, "
             f"path={path}, bias={self.bias is not None}, trainable={self.weight is not None}")
        if self.shape.padding:
            s += f", padded {self.shape.padding}"
        if self.op is not None:
            s += (f", m_max={self.m_max}, window {_mib(self.window_bytes)} shared by "
                  f"{self._pool.users(self.op)} layer(s)")
        return s
