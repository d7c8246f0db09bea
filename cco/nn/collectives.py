"""The unfused collectives of sequence parallelism along tokens (rows, dim 0), on a torch.distributed
group: what the layers run where the fused ops do not (``mode="unfused"``, a backend that refuses)
and in their backward.

Rank ``r`` of ``W`` holds rows ``r*M/W .. (r+1)*M/W`` of the flattened ``[M, features]`` activations
(Megatron's convention). Tensors are 2-D and contiguous here; callers flatten (``flat_rows``).

A layer runs its own work of a call (flatten, quantize, the GEMM, and the collectives' outputs:
``gathered_rows``, ``scattered_rows``) before the call's header and its collectives after it, back
to back: an allocation that failed on one rank between them would leave its peers in a collective
that this rank's next call joins.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# The tensor collectives by their current names: torch 2.13 renamed them (the old names warn on every
# call), torch 2.11 (the GPU machines') has only the old ones. Same arguments, same result.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def flat_rows(x: torch.Tensor, features: int) -> torch.Tensor:
    """``x [..., features]`` as the rows a layer's call quantizes: ``[tokens, features]``, unit
    column stride."""
    x2 = x.reshape(-1, features)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def gathered_rows(x: torch.Tensor, world: int) -> torch.Tensor:
    """The output of :func:`all_gather_rows` of ``x [m, c]``: ``[W * m, c]``, x's dtype, uninitialized
    (allocated by the caller before the call's header, with the rest of its own work)."""
    return torch.empty(world * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)


def scattered_rows(x: torch.Tensor, world: int) -> torch.Tensor:
    """The output of :func:`reduce_scatter_rows` of ``x [M, c]``: ``[M / W, c]``, uninitialized."""
    return torch.empty(x.shape[0] // world, *x.shape[1:], dtype=x.dtype, device=x.device)


def all_gather_rows(x: torch.Tensor, group, world: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[m, c] -> [W * m, c]``: every rank's rows in rank order (into ``out``, :func:`gathered_rows`,
    where given). fp8 (and e8m0) tensors travel as their bytes (collective backends do not reduce
    them, and byte copies are exact)."""
    if world == 1:
        return x.clone()
    x = x.contiguous()
    out = gathered_rows(x, world) if out is None else out
    if x.element_size() == 1 and x.dtype != torch.uint8:
        _all_gather_single(out.view(torch.uint8), x.view(torch.uint8), group=group)
    else:
        _all_gather_single(out, x, group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group, world: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, c] -> [M / W, c]``: the sum over the ranks of each rank's ``x``, rows of this rank's
    share (M a multiple of W; into ``out``, :func:`scattered_rows`, where given). Summed in ``x``'s
    dtype (pass fp32 for an fp32 sum)."""
    if world == 1:
        return x.clone()
    x = x.contiguous()
    out = scattered_rows(x, world) if out is None else out
    _reduce_scatter_single(out, x, group=group)
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
