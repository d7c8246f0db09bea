"""The unfused collectives of sequence parallelism along tokens (rows, dim 0), on a torch.distributed
group: what the layers run where the fused ops do not (``mode="unfused"``, a backend that refuses)
and in their backward.

Rank ``r`` of ``W`` holds rows ``r*M/W .. (r+1)*M/W`` of the flattened ``[M, features]`` activations
(Megatron's convention). Tensors are 2-D and contiguous here; callers flatten (``flat_rows``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def flat_rows(x: torch.Tensor, features: int) -> torch.Tensor:
    """``x [..., features]`` as the rows a layer's call quantizes: ``[tokens, features]``, unit
    column stride."""
    x2 = x.reshape(-1, features)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def all_gather_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[m, c] -> [W * m, c]``: every rank's rows in rank order. fp8 (and e8m0) tensors travel as
    their bytes (collective backends do not reduce them, and byte copies are exact)."""
    if world == 1:
        return x.clone()
    x = x.contiguous()
    wire = x.view(torch.uint8) if x.element_size() == 1 and x.dtype != torch.uint8 else x
    out = torch.empty(world * wire.shape[0], *wire.shape[1:], dtype=wire.dtype, device=wire.device)
    dist.all_gather_into_tensor(out, wire, group=group)
    return out.view(x.dtype) if wire is not x else out


def reduce_scatter_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[M, c] -> [M / W, c]``: the sum over the ranks of each rank's ``x``, rows of this rank's
    share (M a multiple of W). Summed in ``x``'s dtype (pass fp32 for an fp32 sum)."""
    if world == 1:
        return x.clone()
    x = x.contiguous()
    out = torch.empty(x.shape[0] // world, *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def backward_step(*, input_grad: bool, weight_grad: bool) -> int:
    """The header's ``step`` of a backward that runs collectives (``_agree_rows``): which gradients
    it computes, since each adds its own collective (0 is a forward)."""
    return 1 + 2 * bool(input_grad) + bool(weight_grad)


def step_name(code: int) -> str:
    if code == 0:
        return "a forward"
    grads = [name for name, bit in (("the input's", 2), ("the weight's", 1)) if (code - 1) & bit]
    return f"a backward ({' and '.join(grads) or 'no'} gradient{'s' if len(grads) > 1 else ''})"
