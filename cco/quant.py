"""fp8 quantization formats and the fp32 reference GEMM every kernel is checked against.

Three recipes, all with OCP ``float8_e4m3fn`` values (max 448):

==========  ==============================  ==============================  =====================
quant       A scale                         B scale                         applied
==========  ==============================  ==============================  =====================
ptpc        fp32 [M]       (per row)        fp32 [N]       (per row)        epilogue
blockscale  fp32 [M, K/128] column-major    fp32 [N/128, K/128]             per 128-wide K block
mxfp8       e8m0 [M, K/32]                  e8m0 [N, K/32]                  per 32-wide K group
==========  ==============================  ==============================  =====================

The blockscale A scale is column-major (``stride == (1, M)``) because the kernel reads one K block's
scales for a column of rows at a time; ``cco.validate`` rejects the row-major tensor of the same shape
instead of guessing. mxfp8 scales are powers of two stored as ``torch.float8_e8m0fnu``.

Everything here is plain torch and runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cco.layout import QUANTS
from cco.preshuffle import mark_layout

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_BLOCK = 128  # blockscale: A 1x128, B 128x128
MX_GROUP = 32  # mxfp8: one e8m0 scale per 32 values along K
_E8M0_BIAS = 127
_TINY = 1e-12  # keeps an all-zero row/block from producing a zero scale


def check_quant(quant: str, *, fn: str = "cco") -> str:
    if quant not in QUANTS:
        raise ValueError(f"{fn}: quant={quant!r} is not supported; pass one of {', '.join(QUANTS)}")
    return quant


# --------------------------------------------------------------------------------------------------
# e8m0 helpers
# --------------------------------------------------------------------------------------------------
def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents e -> e8m0 tensor holding 2**e (biased by 127, no mantissa)."""
    bits = (exp.to(torch.int32) + _E8M0_BIAS).clamp(0, 254).to(torch.uint8)
    return bits.view(E8M0)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """e8m0 (or its raw uint8 bits) -> fp32 powers of two."""
    bits = s.view(torch.uint8) if s.dtype == E8M0 else s
    return torch.exp2(bits.to(torch.float32) - _E8M0_BIAS)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


# --------------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------------
def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1).clamp_min(_TINY) / FP8_MAX
    return _to_fp8(x / scale[:, None]), scale.float()


def _quantize_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = x.shape
    g = x.view(rows, k // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(dim=2).clamp_min(_TINY)
    # smallest power of two that maps the group's amax inside the fp8 range (no saturation)
    exp = torch.ceil(torch.log2(amax / FP8_MAX))
    q = _to_fp8(g / torch.exp2(exp)[:, :, None]).view(rows, k)
    return q, e8m0_from_exponent(exp)


def _check_2d(x: torch.Tensor, name: str, k_multiple: int, fn: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if x.shape[1] % k_multiple:
        raise ValueError(f"{fn}: {name}.shape[1] (K) = {x.shape[1]} must be a multiple of {k_multiple}")


def quantize_a(x: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation [M, K] (any float dtype) -> (e4m3 [M, K], scale) in the layout of ``quant``."""
    check_quant(quant, fn="quantize_a")
    x = x.float()
    if quant == "ptpc":
        _check_2d(x, "x", 1, "quantize_a")
        return _quantize_rows(x)
    if quant == "mxfp8":
        _check_2d(x, "x", MX_GROUP, "quantize_a")
        return _quantize_mx(x)
    _check_2d(x, "x", SCALE_BLOCK, "quantize_a")
    m, k = x.shape
    q, s = _quantize_rows(x.reshape(m * (k // SCALE_BLOCK), SCALE_BLOCK))
    s = s.view(m, k // SCALE_BLOCK)
    return q.view(m, k), s.t().contiguous().t()  # column-major [M, K/128]


def _quantize_b(w: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_quant(quant, fn="quantize_b")
    w = w.float()
    if quant == "ptpc":
        _check_2d(w, "w", 1, "quantize_b")
        return _quantize_rows(w)
    if quant == "mxfp8":
        _check_2d(w, "w", MX_GROUP, "quantize_b")
        return _quantize_mx(w)
    _check_2d(w, "w", SCALE_BLOCK, "quantize_b")
    n, k = w.shape
    if n % SCALE_BLOCK:
        raise ValueError(f"quantize_b: blockscale needs N % {SCALE_BLOCK} == 0, got N={n}")
    blocks = w.view(n // SCALE_BLOCK, SCALE_BLOCK, k // SCALE_BLOCK, SCALE_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(_TINY) / FP8_MAX  # [N/128, K/128]
    q = _to_fp8(blocks / scale[:, None, :, None]).view(n, k)
    return q, scale.float()


# --------------------------------------------------------------------------------------------------
# dequantize
# --------------------------------------------------------------------------------------------------
def quantize_b(w: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [N, K] (any float dtype) -> (e4m3 [N, K] row-major, scale) in the layout of ``quant``;
    the weight is marked row-major (``cco.preshuffle.LAYOUT_MARK``)."""
    q, scale = _quantize_b(w, quant)
    return mark_layout(q, "row-major"), scale


def dequantize_a(q: torch.Tensor, scale: torch.Tensor, quant: str) -> torch.Tensor:
    """Inverse of :func:`quantize_a`, in fp32."""
    check_quant(quant, fn="dequantize_a")
    x = q.float()
    m, k = x.shape
    if quant == "ptpc":
        return x * scale.float().reshape(m, 1)
    if quant == "mxfp8":
        return (x.view(m, k // MX_GROUP, MX_GROUP) * e8m0_to_float(scale)[:, :, None]).view(m, k)
    return (x.view(m, k // SCALE_BLOCK, SCALE_BLOCK) * scale.float()[:, :, None]).view(m, k)


def dequantize_b(q: torch.Tensor, scale: torch.Tensor, quant: str) -> torch.Tensor:
    """Inverse of :func:`quantize_b`, in fp32."""
    check_quant(quant, fn="dequantize_b")
    x = q.float()
    n, k = x.shape
    if quant == "ptpc":
        return x * scale.float().reshape(n, 1)
    if quant == "mxfp8":
        return (x.view(n, k // MX_GROUP, MX_GROUP) * e8m0_to_float(scale)[:, :, None]).view(n, k)
    blocks = x.view(n // SCALE_BLOCK, SCALE_BLOCK, k // SCALE_BLOCK, SCALE_BLOCK)
    return (blocks * scale.float()[:, None, :, None]).view(n, k)


# --------------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------------
def reference_gemm_fp32(a_q, b_q, a_scale, b_scale, quant: str) -> torch.Tensor:
    """fp32 ``dequant(A) @ dequant(B).T`` [M, N]: sum partials of several ranks with this."""
    return dequantize_a(a_q, a_scale, quant) @ dequantize_b(b_q, b_scale, quant).t()


def reference_gemm(a_q, b_q, a_scale, b_scale, quant: str) -> torch.Tensor:
    """The trusted reference: fp32 math, output rounded to bf16 [M, N]."""
    return reference_gemm_fp32(a_q, b_q, a_scale, b_scale, quant).to(torch.bfloat16)


def count_mismatches(out: torch.Tensor, ref: torch.Tensor, *, rel: float = 0.05) -> int:
    """Elements of ``out`` that are non-finite or off by more than ``rel`` against ``ref``.

    Element-wise on purpose: a band of rows read from a stale K tile can sit near the fp8 noise floor,
    where a relative-L2 gate over the whole output misses it. The floor ``rel * 0.1 * mean|ref|`` keeps
    elements whose reference is ~0 (cancellation) from counting rounding noise as corruption.
    """
    out = out.float()
    ref = ref.float()
    floor = rel * 0.1 * ref.abs().mean()
    bad = ~torch.isfinite(out) | ((out - ref).abs() > rel * ref.abs() + floor)
    return int(bad.sum())


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# Accepted relative-L2 error of a kernel against reference_gemm (same fp32 math, other summation
# order): one bf16 rounding of the output dominates (2**-9 ~ 2e-3 relative per element, ~1e-3 rms).
REL_L2_TOL = {"ptpc": 3e-3, "blockscale": 3e-3, "mxfp8": 3e-3}
# An fp8 gather adds one e4m3 rounding of the reduced output (~2.5e-2 rms).
REL_L2_TOL_FP8_GATHER = 4e-2
GATHER_TINY = 1e-30  # an all-zero group keeps a positive scale: dequantization gives exact zeros


def quantize_gather(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 gather's format: fp32 [R, C] -> (e4m3 [R, C], fp32 [R, ceil(C / group)]), one scale
    ``max|x| / 448`` per row and ``group`` columns (the last group may be narrower)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scale = padded.abs().amax(dim=2).clamp_min(GATHER_TINY) / FP8_MAX
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, groups * group)[:, :cols], scale


def dequantize_gather(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of :func:`quantize_gather`, in fp32."""
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]


# --------------------------------------------------------------------------------------------------
# test problems
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """Quantized operands of one rank: ``a`` [M, K], ``b`` [N, K] (not preshuffled), their scales."""

    quant: str
    a: torch.Tensor
    b: torch.Tensor
    a_scale: torch.Tensor
    b_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.a.shape[0], self.b.shape[0], self.a.shape[1]

    def reference(self) -> torch.Tensor:
        return reference_gemm(self.a, self.b, self.a_scale, self.b_scale, self.quant)

    def reference_fp32(self) -> torch.Tensor:
        return reference_gemm_fp32(self.a, self.b, self.a_scale, self.b_scale, self.quant)


def random_problem(m: int, n: int, k: int, quant: str, *, seed: int, device="cpu") -> Problem:
    """Random operands with row-to-row and block-to-block magnitude spread (never zeros), so a wrong
    scale, a wrong row or a stale K tile changes the result visibly."""
    check_quant(quant, fn="random_problem")
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-3, 4, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-3, 4, (1, k), generator=g).float())
    a_q, a_s = quantize_a(a, quant)
    b_q, b_s = quantize_b(w, quant)
    if quant == "blockscale":
        a_s = a_s.t().contiguous()  # keep the column-major layout across .to(device)
        return Problem(quant, a_q.to(device), b_q.to(device), a_s.to(device).t(), b_s.to(device))
    return Problem(quant, a_q.to(device), b_q.to(device), a_s.to(device), b_s.to(device))
