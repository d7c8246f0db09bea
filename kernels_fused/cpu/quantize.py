"""Activation quantizer of the CPU backend: ``cco.quant.quantize_a`` on ``x`` zero-padded to
``k_padded`` columns, in plain torch (the reference formulas themselves; the Triton quantizer of
``kernels_fused.hopper.quantize`` gives the same bytes on the GPUs)."""

from __future__ import annotations

import torch

from cco.quant import quantize_a


def quantize_activation(x: torch.Tensor, quant: str, *,
                        k_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q e4m3 [M, k_padded], scale)`` in the layout of ``quant``; columns past K
    are zeros before quantization (they add nothing against zero weight columns)."""
    k = x.shape[-1]
    k_padded = k if k_padded is None else k_padded
    if k_padded < k:
        raise ValueError(f"quantize_activation: k_padded={k_padded} must be >= K={k}")
    if k_padded != k:
        x = torch.nn.functional.pad(x, (0, k_padded - k))
    return quantize_a(x, quant)
