"""Input checks shared by every public entry point (the op, the kernel launchers, the benchmark).

Each error names the function, the argument, the value it got, what is allowed and what to pass
instead. Internal invariants use ``assert``; nothing a caller can pass does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cco.layout import K_ALIGN, K_MIN
from cco.quant import E8M0, FP8, MX_GROUP, SCALE_BLOCK, check_quant



@dataclass(frozen=True)
class GemmShape:
    m: int
    n: int
    k: int


def _name(t) -> str:
    return f"{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_fp8(t, arg: str, *, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.float8_e4m3fnuz:
        raise TypeError(
            f"{fn}: {arg} is float8_e4m3fnuz, which is not OCP e4m3 (exponent bias 8, no negative "
            f"zero): every value would be read 2x off. Convert with {arg}.float().to(torch.float8_e4m3fn)"
        )
    if t.dtype != FP8:
        raise TypeError(f"{fn}: {arg} must be torch.float8_e4m3fn, got {_name(t)}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {arg} must be contiguous (stride {t.stride()}); pass {arg}.contiguous()")


def check_k(k: int, *, fn: str, arg: str = "K") -> None:
    if k < K_MIN or k % K_ALIGN:
        raise ValueError(
            f"{fn}: {arg}={k} is not supported; K must be >= {K_MIN} and a multiple of {K_ALIGN} "
            f"(pad the reduction dimension with zeros to the next multiple of {K_ALIGN})"
        )


def _scale_dtype_ok(s: torch.Tensor, quant: str) -> bool:
    return s.dtype in (E8M0, torch.uint8) if quant == "mxfp8" else s.dtype == torch.float32


def _check_scale(s, arg: str, shape: tuple[int, ...], quant: str, *, fn: str) -> None:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got {type(s).__name__}")
    want = "float8_e8m0fnu (or its uint8 bits)" if quant == "mxfp8" else "float32"
    if not _scale_dtype_ok(s, quant):
        raise TypeError(f"{fn}: {arg} for quant={quant!r} must be {want}, got {s.dtype}")
    got = tuple(s.shape)
    if got != shape and not (len(shape) == 1 and got == (shape[0], 1)):
        raise ValueError(f"{fn}: {arg} for quant={quant!r} must have shape {list(shape)}, got {list(got)}")


def check_a_scale_layout(a_scale: torch.Tensor, m: int, *, fn: str) -> None:
    """blockscale A scales are [M, K/128] column-major; the row-major tensor of that shape is
    rejected rather than guessed (both are legal strides for the same shape)."""
    kb = a_scale.shape[1]
    if m > 1 and kb > 1 and a_scale.stride() != (1, m):
        raise ValueError(
            f"{fn}: a_scale for quant='blockscale' must be column-major [M, K/128] (stride (1, {m})), "
            f"got stride {a_scale.stride()}. A row-major scale is ambiguous; if yours is row-major, "
            f"pass a_scale.t().contiguous().t()"
        )


def check_operands(a, b_pre, a_scale, b_scale, *, quant: str, fn: str, n_multiple: int = 16) -> GemmShape:
    """Validate one GEMM's operands: A [M, K] and preshuffled B [N, K] in e4m3fn, scales in the
    layout of ``quant`` (see cco.quant), everything on one device. Returns the shape."""
    check_quant(quant, fn=fn)
    check_fp8(a, "a", fn=fn)
    check_fp8(b_pre, "b_pre", fn=fn)
    if a.dim() != 2 or b_pre.dim() != 2:
        raise ValueError(f"{fn}: a must be [M, K] and b_pre [N, K], got {list(a.shape)} and {list(b_pre.shape)}")
    (m, k), (n, kb) = a.shape, b_pre.shape
    if k != kb:
        raise ValueError(f"{fn}: a is [M, K={k}] but b_pre is [N, K={kb}]; the K dimensions must match")
    if m < 1:
        raise ValueError(f"{fn}: a has M={m} rows; M must be >= 1")
    check_k(k, fn=fn)
    step = max(n_multiple, SCALE_BLOCK) if quant == "blockscale" else n_multiple
    if n % step:
        raise ValueError(f"{fn}: N={n} must be a multiple of {step} for quant={quant!r} (pad the weight rows)")
    if quant == "ptpc":
        _check_scale(a_scale, "a_scale", (m,), quant, fn=fn)
        _check_scale(b_scale, "b_scale", (n,), quant, fn=fn)
    elif quant == "blockscale":
        _check_scale(a_scale, "a_scale", (m, k // SCALE_BLOCK), quant, fn=fn)
        check_a_scale_layout(a_scale, m, fn=fn)
        _check_scale(b_scale, "b_scale", (n // SCALE_BLOCK, k // SCALE_BLOCK), quant, fn=fn)
    else:
        _check_scale(a_scale, "a_scale", (m, k // MX_GROUP), quant, fn=fn)
        _check_scale(b_scale, "b_scale", (n, k // MX_GROUP), quant, fn=fn)
    devices = {t.device for t in (a, b_pre, a_scale, b_scale)}
    if len(devices) != 1:
        raise ValueError(f"{fn}: a, b_pre, a_scale and b_scale must be on one device, got {sorted(map(str, devices))}")
    return GemmShape(m, n, k)
