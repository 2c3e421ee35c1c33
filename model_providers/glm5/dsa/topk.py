"""Deterministic top-k: the same scores always give the same indices, ties broken by position
(lower first). GLM-5's report: a non-deterministic top-k collapsed RL training in a few steps."""

from __future__ import annotations

import torch


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k largest entries of ``scores`` [..., L] (k <= L), ascending in
    position. Entries equal to the k-th largest value are taken lowest position first; NaN
    scores (diverged weights) rank as -inf instead of breaking the selection."""
    scores = scores.nan_to_num(nan=float("-inf"))
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True)
    take = above | (tied & (tied.cumsum(dim=-1) <= room))
    return take.nonzero(as_tuple=True)[-1].view(*scores.shape[:-1], k)
