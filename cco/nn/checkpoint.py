"""fp8 checkpoints as they ship, read into cco's weight formats and sharded for tensor parallelism.

A checkpoint holds one linear's weight as ``<prefix>.weight`` (OCP ``float8_e4m3fn`` ``[N, K]``) and
its scales beside it. The formats read here, and the cco quant (``cco.quant``) each one is:

=================================  ========================  =====================================  ==========
source                             scale key                 scale dtype and shape                  quant
=================================  ========================  =====================================  ==========
deepseek-v3                        ``weight_scale_inv``      fp32 ``[ceil(N/128), ceil(K/128)]``    blockscale
deepseek-v3:ue8m0 (V3.1)           ``weight_scale_inv``      the same, every value a power of two   blockscale
deepseek-v3:per-tensor             ``weight_scale_inv``      fp32 ``[]``                            ptpc
deepseek-v4                        ``scale``                 e8m0 (or fp32 powers of two),          blockscale
                                                             ``[ceil(N/128), ceil(K/128)]``
deepseek-v4:mx                     ``scale``                 e8m0 ``[N, ceil(K/32)]``               mxfp8
compressed-tensors:FP8_DYNAMIC     ``weight_scale``          fp32/bf16/fp16 ``[N, 1]`` or ``[N]``   ptpc
compressed-tensors:FP8             ``weight_scale``          fp32/bf16/fp16 ``[]`` (per tensor)     ptpc
compressed-tensors:FP8_BLOCK       ``weight_scale``          fp32/bf16/fp16 ``[ceil(N/128),         blockscale
                                                             ceil(K/128)]``
compressed-tensors:MXFP8           ``weight_scale``          uint8 (e8m0 bits) or e8m0              mxfp8
                                                             ``[N, ceil(K/32)]``
=================================  ========================  =====================================  ==========

Every scale is a multiplier (``w = q * scale``), ``weight_scale_inv`` included. Scales convert to
cco's layout exactly (bf16/fp16/e8m0 values are all fp32 values; a per-tensor scale is the same
scale on every row). Static activation scales (``input_scale``, ``activation_scale``) are not read:
the layer quantizes its activations per call in its own format.

Not served, with an error that says so: ``float8_e4m3fnuz`` weights (not OCP e4m3: the same bits
are half the value), e5m2 weights, packed 4-bit weights (MXFP4, NVFP4), block sizes other than
128x128, group sizes other than 32, per-group float scales.

Tensor parallelism (:func:`shard_fp8_weight`): a rank's shard is made of whole scale blocks (128
for block scales, 32 along K for mxfp8, any width for per-row scales), ``width = ceil(blocks /
world) * block`` columns (rows) per rank; rank ``r`` holds ``[r * width, min((r + 1) * width,
size))``, so the last rank's shard may be shorter and end in the tensor's ragged last block: the
layer pads it with zero weights. Where ``ceil(size / world)`` is whole blocks (every shipped
checkpoint at the usual TP sizes) this is ``torch.chunk``'s split, which DTensor's ``Shard`` and
vLLM use; elsewhere the two differ and the caller slices its activations by :func:`shard_width`.

Pure torch; no framework import. Unfused equivalent of a loaded layer: ``x @ dequantize(w).T``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from cco import quant as Q

_FN_READ = "read_fp8_weight"
_FN_SHARD = "shard_fp8_weight"
_FN_CONVERT = "convert_fp8_weight"
_SCALE_KEYS = ("weight_scale_inv", "weight_scale", "scale")  # beside "<prefix>.weight", in this order
_E8M0_NAN = 0xFF  # the one e8m0 code that is not a power of two
_E8M0_EXP = (-127, 127)  # exponents e8m0 holds
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)
_FNUZ = tuple(getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))
_SUPPORTED = ("supported: float8_e4m3fn weights with deepseek-v3 weight_scale_inv (fp32 128x128 blocks, ue8m0 "
              "values included), deepseek-v4 scale (e8m0 128x128 blocks or [N, K/32] groups), "
              "compressed-tensors weight_scale (FP8 per tensor, FP8_DYNAMIC [N, 1], FP8_BLOCK 128x128, "
              "MXFP8 uint8 [N, K/32])")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8Weight:
    """One linear's fp8 weight in cco's layout: ``w = dequantize(self)``, fp32 ``[N, K]``.

    ``qweight``: float8_e4m3fn ``[N, K]`` row-major. ``scale``: ``quant``'s B scale (``cco.quant``),
    whose last block may be partial: ptpc fp32 ``[N]``, blockscale fp32 ``[ceil(N/128), ceil(K/128)]``,
    mxfp8 float8_e8m0fnu ``[N, ceil(K/32)]``. ``source``: the checkpoint format it came from."""

    qweight: torch.Tensor
    scale: torch.Tensor
    quant: str
    source: str

    def __post_init__(self):
        Q.check_quant(self.quant, fn="Fp8Weight")
        if not isinstance(self.qweight, torch.Tensor) or self.qweight.dim() != 2 or self.qweight.dtype != Q.FP8:
            got = f"{self.qweight.dtype} {list(self.qweight.shape)}" if isinstance(self.qweight, torch.Tensor) \
                else type(self.qweight).__name__
            raise ValueError(f"Fp8Weight: qweight must be float8_e4m3fn [N, K], got {got}")
        n, k = self.qweight.shape
        shape, dtype = scale_shape(n, k, self.quant)
        if not isinstance(self.scale, torch.Tensor) or tuple(self.scale.shape) != shape or self.scale.dtype != dtype:
            got = f"{self.scale.dtype} {list(self.scale.shape)}" if isinstance(self.scale, torch.Tensor) \
                else type(self.scale).__name__
            raise ValueError(f"Fp8Weight: scale for quant={self.quant!r} and qweight [{n}, {k}] must be {dtype} "
                             f"{list(shape)}, got {got}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)


def scale_shape(n: int, k: int, quant: str) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of ``quant``'s B scale for a weight ``[n, k]`` (last block partial)."""
    return {"ptpc": ((n,), torch.float32),
            "blockscale": ((_cdiv(n, Q.SCALE_BLOCK), _cdiv(k, Q.SCALE_BLOCK)), torch.float32),
            "mxfp8": ((n, _cdiv(k, Q.MX_GROUP)), Q.E8M0)}[quant]


def block_of(quant: str, dim: int) -> int:
    """Rows (``dim=0``) or columns (``dim=1``) one scale covers in ``quant``: a shard starts on one."""
    return {"ptpc": (1, 1), "blockscale": (Q.SCALE_BLOCK, Q.SCALE_BLOCK), "mxfp8": (1, Q.MX_GROUP)}[quant][dim]


# --------------------------------------------------------------------------------------------------
# read
# --------------------------------------------------------------------------------------------------
def _keys(tensors):
    # a mapping's own key view (O(1) lookups), or the key set of a safe_open handle
    return tensors.keys() if isinstance(tensors, Mapping) else set(tensors.keys())


def _get(tensors, key: str) -> torch.Tensor:
    # a dict of tensors, or a safetensors `safe_open` handle (reads one tensor, not the file)
    return tensors[key] if isinstance(tensors, Mapping) else tensors.get_tensor(key)


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _config_expectation(config: dict | None, fn: str, name: str) -> tuple[str | None, str | None]:
    """(the scale layout the quantization_config promises or None, its scheme name); raises where the
    config names a scheme cco cannot serve."""
    if not config:
        return None, None
    method = config.get("quant_method")
    if method == "fp8":  # transformers' FineGrainedFP8Config: DeepSeek's checkpoints
        block = config.get("weight_block_size", [Q.SCALE_BLOCK, Q.SCALE_BLOCK])  # transformers' default
        if block is None:  # written out as null: one scale per tensor
            return "tensor", None
        if [int(b) for b in block] != [Q.SCALE_BLOCK, Q.SCALE_BLOCK]:
            raise ValueError(f"{fn}: {name}: quantization_config weight_block_size={list(block)} is not served; cco's "
                             f"block scales are {Q.SCALE_BLOCK}x{Q.SCALE_BLOCK} (quant='blockscale')")
        return "block", None
    if method == "compressed-tensors":
        specs = [g.get("weights") for g in (config.get("config_groups") or {}).values() if g.get("weights")]
        if len({repr(sorted(s.items())) for s in specs}) != 1:
            return None, None  # none, or several schemes: the tensors tell which this weight has
        w = specs[0]
        strategy = w.get("strategy")
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise ValueError(f"{fn}: {name}: the compressed-tensors scheme has weights num_bits={w.get('num_bits')}, "
                             f"type={w.get('type')!r}; cco serves 8-bit float (e4m3) weights only")
        if strategy == "tensor":
            return "tensor", "FP8"
        if strategy == "channel":
            return "channel", "FP8_DYNAMIC"
        if strategy == "block":
            block = w.get("block_structure") or [Q.SCALE_BLOCK, Q.SCALE_BLOCK]
            if [int(b) for b in block] != [Q.SCALE_BLOCK, Q.SCALE_BLOCK]:
                raise ValueError(f"{fn}: {name}: compressed-tensors block_structure={list(block)} is not served; cco's "
                                 f"block scales are {Q.SCALE_BLOCK}x{Q.SCALE_BLOCK}")
            return "block", "FP8_BLOCK"
        if strategy == "group":
            if w.get("group_size") != Q.MX_GROUP:
                raise ValueError(f"{fn}: {name}: compressed-tensors group_size={w.get('group_size')} is not served; "
                                 f"cco's group scales are mxfp8's (group_size={Q.MX_GROUP}, power-of-two scales)")
            return "group", "MXFP8"
        raise ValueError(f"{fn}: {name}: compressed-tensors weight strategy={strategy!r} is not served; served: "
                         f"tensor, channel, block ({Q.SCALE_BLOCK}x{Q.SCALE_BLOCK}), group ({Q.MX_GROUP}, mxfp8)")
    return None, None


def config_quant(config: dict | None) -> str | None:
    """The cco quant a checkpoint's ``quantization_config`` stores its fp8 weights in: transformers'
    ``fp8`` (block scales: blockscale; ``weight_block_size`` null: ptpc) or compressed-tensors with
    one 8-bit float weight scheme. None for any other config (or several schemes: the tensors tell).
    Raises ValueError for an fp8 scheme cco cannot serve (another block or group size)."""
    if not config:
        return None
    if config.get("quant_method") == "compressed-tensors":
        specs = [g.get("weights") or {} for g in (config.get("config_groups") or {}).values()]
        if not specs or any(w.get("num_bits") != 8 or w.get("type") != "float" for w in specs):
            return None  # int4/int8 or mixed schemes: not fp8 as cco reads it
    layout, _ = _config_expectation(config, "config_quant", "quantization_config")
    return _LAYOUT_QUANT.get(layout)


_LAYOUT_QUANT = {"tensor": "ptpc", "channel": "ptpc", "block": "blockscale", "group": "mxfp8"}


def _layout(scale: torch.Tensor, n: int, k: int) -> str | None:
    shape = tuple(scale.shape)
    if scale.numel() == 1 and len(shape) <= 2:
        return "tensor"
    if shape in ((n,), (n, 1)):
        return "channel"
    if shape == (_cdiv(n, Q.SCALE_BLOCK), _cdiv(k, Q.SCALE_BLOCK)):
        return "block"
    if shape == (n, _cdiv(k, Q.MX_GROUP)):
        return "group"
    return None


def _e8m0_bits(scale: torch.Tensor) -> torch.Tensor | None:
    """uint8 e8m0 codes of a scale tensor: e8m0 and uint8 as stored, floats when every value is a
    power of two e8m0 holds (else None)."""
    if scale.dtype in (Q.E8M0, torch.uint8):
        return scale.view(torch.uint8)
    mant, exp = torch.frexp(scale.float())
    e = exp - 1  # x = 0.5 * 2**exp = 2**(exp - 1) where the mantissa is exactly one half
    if not bool(((mant == 0.5) & (e >= _E8M0_EXP[0]) & (e <= _E8M0_EXP[1])).all()):
        return None
    return (e + 127).to(torch.uint8)


def read_fp8_weight(tensors: Mapping[str, torch.Tensor], name: str, *, config: dict | None = None) -> Fp8Weight:
    """The fp8 weight ``tensors[name]`` and its scale, found beside it, in cco's layout.

    ``tensors``: a mapping of checkpoint keys to tensors (``safetensors.torch.load_file``) or a
    ``safetensors.safe_open`` handle. ``name``: the weight's key (``"...down_proj.weight"``); its
    scale is ``<prefix>.weight_scale_inv``, ``<prefix>.weight_scale`` or ``<prefix>.scale``.
    ``config``: the checkpoint's ``quantization_config`` where known; it is checked against what
    the tensors hold. The format comes from the scale's key, dtype and shape (module docstring).
    Raises ValueError naming the key, what was found and what is supported."""
    fn = _FN_READ
    keys = _keys(tensors)
    if name not in keys:
        raise ValueError(f"{fn}: no tensor {name!r} in the checkpoint ({len(keys)} keys); pass the weight's key, "
                         f"e.g. 'model.layers.0.mlp.down_proj.weight'")
    w = _get(tensors, name)
    if w.dtype in _FNUZ:
        raise ValueError(f"{fn}: {name} is {_describe(w)}: fnuz is not OCP e4m3 (other bias, no negative zero: the "
                         f"same bits decode to half the value); cco serves float8_e4m3fn. Use the checkpoint's OCP "
                         f"(float8_e4m3fn) release, or dequantize it and load the float weight with load_weight")
    if w.dtype != Q.FP8:
        if w.dtype.is_floating_point and w.element_size() > 1:
            what = "a float weight: load it with RowParallelLinear.load_weight"
        elif w.dtype in (torch.uint8, torch.int8):
            what = "packed 4-bit values (MXFP4 / NVFP4) or an int8 weight, not served"
        else:
            what = "not OCP e4m3"
        raise ValueError(f"{fn}: {name} is {_describe(w)}, {what}; {_SUPPORTED}")
    if w.dim() != 2:
        raise ValueError(f"{fn}: {name} is {_describe(w)}; a linear's weight is 2-D [N, K]")
    prefix = name[:-len(".weight")] if name.endswith(".weight") else name
    found = [key for key in (f"{prefix}.{s}" for s in _SCALE_KEYS) if key in keys]
    if not found:
        raise ValueError(f"{fn}: {name} is float8_e4m3fn but none of its scales is in the checkpoint (looked for "
                         f"{', '.join(f'{prefix}.{s}' for s in _SCALE_KEYS)}); {_SUPPORTED}")
    if len(found) > 1:
        raise ValueError(f"{fn}: {name} has several scales ({', '.join(found)}); cannot tell which one the checkpoint "
                         f"means; remove the stale one")
    key = found[0]
    scale = _get(tensors, key)
    n, k = w.shape
    layout = _layout(scale, n, k)
    expected, scheme = _config_expectation(config, fn, name)
    if scale.dtype in (Q.E8M0, torch.uint8) and layout in ("tensor", "channel"):
        # a one-block weight's e8m0 scale [1, 1] (or a one-row one's [1, G]) is block or group scales:
        # the config's, else the key's convention (compressed-tensors' uint8 scales are MXFP8 groups)
        shapes = {"block": (_cdiv(n, Q.SCALE_BLOCK), _cdiv(k, Q.SCALE_BLOCK)), "group": (n, _cdiv(k, Q.MX_GROUP))}
        order = [expected] if expected in shapes else []
        order += ["group", "block"] if key.endswith(".weight_scale") else ["block", "group"]
        layout = next((o for o in order if tuple(scale.shape) == shapes[o]), layout)
    seen = f"{name} {_describe(w)} with {key} {_describe(scale)}"
    if layout is None:
        raise ValueError(f"{fn}: {seen}: the scale's shape is none of [] (per tensor), [{n}, 1] (per row), "
                         f"[{_cdiv(n, Q.SCALE_BLOCK)}, {_cdiv(k, Q.SCALE_BLOCK)}] (128x128 blocks), "
                         f"[{n}, {_cdiv(k, Q.MX_GROUP)}] (groups of 32); {_SUPPORTED}")
    if expected is not None and expected != layout and not _same_map(expected, layout, n, k):
        raise ValueError(f"{fn}: {seen}: quantization_config promises {expected} scales but the tensor's shape is "
                         f"{layout} scales; check that config is this checkpoint's")
    if scale.dtype in _FLOAT_SCALES:
        if layout == "group":  # a float group scale is mxfp8 only where every value is a power of two
            bits = _e8m0_bits(scale)
            if bits is None:
                raise ValueError(f"{fn}: {seen}: per-group float scales that are not all powers of two are not "
                                 f"served (mxfp8 needs power-of-two scales); {_SUPPORTED}")
            return Fp8Weight(qweight=w.contiguous(), scale=bits.view(Q.E8M0).contiguous(), quant="mxfp8",
                             source=_source(key, "group", scheme))
        s = scale.float().reshape(-1) if layout != "block" else scale.float()
        if layout == "tensor":
            s = s.expand(n)
        s = s.contiguous()
        bad = int((~torch.isfinite(s)).sum())
        if bad:  # (as the e8m0 NaN code below: every output that reads such a block would be NaN)
            raise ValueError(f"{fn}: {seen}: {bad} of the scale's {s.numel()} values are NaN or infinite; the "
                             f"checkpoint is damaged")
        source = _source(key, layout, scheme)
        if key.endswith(".weight_scale_inv") and layout == "block" and _e8m0_bits(s) is not None:
            source = "deepseek-v3:ue8m0"
        return Fp8Weight(qweight=w.contiguous(), scale=s.clone(), quant="ptpc" if layout in ("tensor", "channel")
                         else "blockscale", source=source)
    if scale.dtype in (Q.E8M0, torch.uint8) and layout in ("block", "group"):
        bits = scale.view(torch.uint8)
        if bool((bits == _E8M0_NAN).any()):
            raise ValueError(f"{fn}: {seen}: the scale holds the e8m0 NaN code 0xFF; the checkpoint is damaged")
        source = _source(key, layout, scheme)
        if key.endswith(".weight_scale_inv") and layout == "block":
            source = "deepseek-v3:ue8m0"
        if layout == "group":
            return Fp8Weight(qweight=w.contiguous(), scale=bits.contiguous().view(Q.E8M0), quant="mxfp8", source=source)
        return Fp8Weight(qweight=w.contiguous(), scale=Q.e8m0_to_float(bits).contiguous(), quant="blockscale",
                         source=source)
    raise ValueError(f"{fn}: {seen}: a {layout} scale of dtype {scale.dtype} is not served (fp32, bf16 or fp16 "
                     f"for tensor, row and block scales; e8m0 or uint8 for block and group scales); {_SUPPORTED}")


def _same_map(a: str, b: str, n: int, k: int) -> bool:
    """Two layouts whose shapes coincide (one row, one block) describe the same scale map."""
    one = {"tensor": True, "channel": n == 1, "block": n <= Q.SCALE_BLOCK and k <= Q.SCALE_BLOCK,
           "group": n == 1 and k <= Q.MX_GROUP}
    return one[a] and one[b]


def _source(key: str, layout: str, scheme: str | None) -> str:
    if key.endswith(".weight_scale_inv"):
        return "deepseek-v3" if layout != "tensor" else "deepseek-v3:per-tensor"
    if key.endswith(".scale"):
        return "deepseek-v4" if layout != "group" else "deepseek-v4:mx"
    return "compressed-tensors:" + (scheme or {"tensor": "FP8", "channel": "FP8_DYNAMIC", "block": "FP8_BLOCK",
                                               "group": "MXFP8"}[layout])


# --------------------------------------------------------------------------------------------------
# dequantize, convert
# --------------------------------------------------------------------------------------------------
def dequantize(w: Fp8Weight) -> torch.Tensor:
    """fp32 ``[N, K]``: ``qweight * scale`` with each scale over its block (a last partial one too)."""
    n, k = w.shape
    bn, bk = block_of(w.quant, 0), block_of(w.quant, 1)
    n_full, k_full = _cdiv(n, bn) * bn, _cdiv(k, bk) * bk
    q = torch.nn.functional.pad(w.qweight.view(torch.uint8), (0, k_full - k, 0, n_full - n)).view(Q.FP8)
    return Q.dequantize_b(q, w.scale, w.quant)[:n, :k]


def _cells(w: Fp8Weight) -> torch.Tensor:
    """fp32 ``[N, ceil(K/32)]``: the scale of each row's 32-wide K group, a refinement every quant's
    blocks are unions of (128 = 4 x 32)."""
    n, k = w.shape
    groups = _cdiv(k, Q.MX_GROUP)
    if w.quant == "ptpc":
        return w.scale.float()[:, None].expand(n, groups)
    if w.quant == "mxfp8":
        return Q.e8m0_to_float(w.scale)
    per = Q.SCALE_BLOCK // Q.MX_GROUP
    return w.scale.repeat_interleave(Q.SCALE_BLOCK, 0)[:n].repeat_interleave(per, 1)[:, :groups]


def convert_fp8_weight(w: Fp8Weight, quant: str) -> Fp8Weight:
    """``w`` with ``quant``'s scales, where that is exact: the same fp8 bytes, the same dequantized
    weight. Exact when ``w``'s scales are constant on ``quant``'s blocks (for mxfp8: and powers of
    two), e.g. power-of-two 128x128 block scales as mxfp8, a per-tensor scale as block scales.
    Raises ValueError saying why otherwise; never requantizes."""
    Q.check_quant(quant, fn=_FN_CONVERT)
    if quant == w.quant:
        return w
    n, k = w.shape
    cells = _cells(w)
    why = None
    if quant == "ptpc":
        scale = cells[:, 0].contiguous()
        if not torch.equal(cells, scale[:, None].expand_as(cells)):
            why = "its scales vary along K within a row"
    elif quant == "blockscale":
        per = Q.SCALE_BLOCK // Q.MX_GROUP
        scale = cells[::Q.SCALE_BLOCK, ::per].contiguous()
        again = scale.repeat_interleave(Q.SCALE_BLOCK, 0)[:n].repeat_interleave(per, 1)[:, :cells.shape[1]]
        if not torch.equal(cells, again):
            why = f"its scales vary within a {Q.SCALE_BLOCK}x{Q.SCALE_BLOCK} block"
    else:
        bits = _e8m0_bits(cells)
        scale = None if bits is None else bits.contiguous().view(Q.E8M0)
        if bits is None:
            why = "not every scale is a power of two in e8m0's range (2**-127 .. 2**127)"
    if why is not None:
        raise ValueError(f"{_FN_CONVERT}: a {w.source} weight ({w.quant}, [{n}, {k}]) has no exact {quant} form: {why}")
    return Fp8Weight(qweight=w.qweight, scale=scale, quant=quant, source=w.source)


# --------------------------------------------------------------------------------------------------
# shard
# --------------------------------------------------------------------------------------------------
def shard_width(w: Fp8Weight, *, world: int, dim: int) -> int:
    """Columns (``dim=1``) or rows (``dim=0``) of every rank's shard, padding included: whole scale
    blocks, ``ceil(blocks / world) * block`` (the whole size where ``world`` is 1)."""
    _check_split_args(world=world, rank=0, dim=dim)
    size, block = w.shape[dim], block_of(w.quant, dim)
    return size if world == 1 else _cdiv(_cdiv(size, block), world) * block


def _check_split_args(*, world, rank, dim) -> None:
    for arg, value in (("world", world), ("rank", rank), ("dim", dim)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{_FN_SHARD}: {arg}={value!r} must be an int")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{_FN_SHARD}: rank={rank}, world={world}: need world >= 1 and 0 <= rank < world")
    if dim not in (0, 1):
        raise ValueError(f"{_FN_SHARD}: dim={dim} must be 1 (K shards: row-parallel) or 0 (N shards: column-parallel)")


def shard_fp8_weight(w: Fp8Weight, *, rank: int, world: int, dim: int) -> Fp8Weight:
    """Rank ``rank``'s shard of ``w`` over ``world`` ranks along ``dim`` (1: K, row-parallel; 0: N,
    column-parallel), with the scales that cover it.

    Every shard starts on a scale block (128 for block scales, 32 along K for mxfp8, any row or
    column for per-row scales) and is :func:`shard_width` wide; the last rank's may be shorter and
    end in the tensor's ragged last block (the layer pads it with zeros). Raises ValueError where
    ``world`` leaves a rank without a block (say which size, world, block, and the largest world
    that works)."""
    _check_split_args(world=world, rank=rank, dim=dim)
    size, block = w.shape[dim], block_of(w.quant, dim)
    width = shard_width(w, world=world, dim=dim)
    blocks = _cdiv(size, block)
    used = _cdiv(size, width)  # ranks that hold any of it
    if used < world:
        what = "K" if dim == 1 else "N"
        idle = f"rank {used}" if used == world - 1 else f"ranks {used}..{world - 1}"
        best = max(v for v in range(1, world + 1) if _cdiv(size, _cdiv(blocks, v) * block) == v)
        raise ValueError(f"{_FN_SHARD}: {what}={size} is {blocks} block(s) of {block} ({w.quant}); world={world} "
                         f"leaves {idle} without any (shards of whole blocks are {width} wide); "
                         f"use a tensor-parallel world of at most {best} for this weight, or load it unsharded")
    start, stop = rank * width, min((rank + 1) * width, size)
    sb, eb = start // block, _cdiv(stop, block)  # scale blocks of the shard: its last may be ragged
    q = w.qweight[:, start:stop] if dim == 1 else w.qweight[start:stop]
    if w.quant == "ptpc":
        s = w.scale if dim == 1 else w.scale[start:stop]
    else:
        s = w.scale[:, sb:eb] if dim == 1 else w.scale[sb:eb]
    return Fp8Weight(qweight=q.contiguous(), scale=s.contiguous(), quant=w.quant, source=w.source)


def pad_fp8_weight(w: Fp8Weight, *, n: int, k: int) -> Fp8Weight:
    """``w`` padded with zero weights (scale one) to ``[n, k]``, ``n >= N`` and ``k >= K``."""
    n0, k0 = w.shape
    if n < n0 or k < k0:
        raise ValueError(f"pad_fp8_weight: [{n}, {k}] is smaller than the weight [{n0}, {k0}]")
    q = torch.nn.functional.pad(w.qweight.view(torch.uint8), (0, k - k0, 0, n - n0)).view(Q.FP8)
    shape, _ = scale_shape(n, k, w.quant)
    if w.quant == "ptpc":
        s = torch.nn.functional.pad(w.scale, (0, n - n0), value=1.0)
    else:
        one = 1.0 if w.quant == "blockscale" else 127  # e8m0 code of 2**0
        raw = w.scale if w.quant == "blockscale" else w.scale.view(torch.uint8)
        raw = torch.nn.functional.pad(raw, (0, shape[1] - raw.shape[1], 0, shape[0] - raw.shape[0]), value=one)
        s = raw if w.quant == "blockscale" else raw.view(Q.E8M0)
    return Fp8Weight(qweight=q, scale=s, quant=w.quant, source=w.source)
