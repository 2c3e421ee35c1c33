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
    # the taken positions in ascending order, without nonzero (a device -> host sync): each taken
    # position goes to its rank among the taken ones, the rest to a discarded column k
    slot = torch.where(take, take.cumsum(dim=-1) - 1, k)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(slot)
    out = torch.empty((*scores.shape[:-1], k + 1), dtype=torch.long, device=scores.device)
    return out.scatter_(-1, slot, positions)[..., :k]
