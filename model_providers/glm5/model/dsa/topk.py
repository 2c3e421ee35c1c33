"""Deterministic top-k: the same scores always give the same indices, ties broken by position
(lower first). GLM-5's report: a non-deterministic top-k collapsed RL training in a few steps."""

from __future__ import annotations

import torch

from model_providers.glm5.model.dsa.kernels.dsa_cpu import cpu_kernel

_LOW31 = 0x7FFFFFFF


def topk_indices(scores: torch.Tensor, k: int, fused: bool = False) -> torch.Tensor:
    """Indices [..., k] of the k largest entries of ``scores`` [..., L] (fp32, k <= L), ascending
    in position. Entries equal to the k-th largest value are taken lowest position first; NaN
    scores (diverged weights) rank as -inf instead of breaking the selection.

    One top-k over unique integer keys, with no tie pass and no host sync: a score's fp32 bits
    mapped to an integer of the same order (negative floats' bits reversed; -0.0 becomes +0.0
    first, so they tie) in the high 32 bits, ``L - 1 - position`` in the low 32, so equal
    scores rank lowest position first.

    ``fused``: the fused CPU kernel's radix select, with the same result (the caller checked it is
    built and ``scores`` is on the CPU)."""
    if fused:
        return cpu_kernel().topk(scores.float().contiguous(), k)
    length = scores.shape[-1]
    s = torch.nan_to_num(scores.float(), nan=float("-inf")).add_(0.0)
    key = s.view(torch.int32).to(torch.int64)
    key.bitwise_xor_((key >> 63) & _LOW31)  # order-preserving for negative floats
    key.bitwise_left_shift_(32).bitwise_or_(
        torch.arange(length - 1, -1, -1, device=scores.device))
    return key.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
