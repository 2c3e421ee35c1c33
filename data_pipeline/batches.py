"""Micro-batches for this data-parallel rank from any indexable sample dataset."""

from __future__ import annotations

from typing import Iterator

import torch


def micro_batch_samples(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                        dp_rank: int, dp_size: int) -> list[list[int]]:
    """The sample numbers of each of this DP rank's micro-batches of one global batch: the global
    batch is the same set of samples for every layout; DP rank ``r`` takes micro-batches
    ``r, r + dp, r + 2 dp, ...`` of it."""
    per_rank = global_batch_size // dp_size
    out = []
    for m in range(per_rank // micro_batch_size):
        first = consumed_samples + (m * dp_size + dp_rank) * micro_batch_size
        out.append(list(range(first, first + micro_batch_size)))
    return out


def micro_batches(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_size: int) -> Iterator[dict]:
    """Yield this DP rank's micro-batches (:func:`micro_batch_samples`) of one global batch,
    starting at ``consumed_samples``."""
    for numbers in micro_batch_samples(consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size):
        samples = [dataset[i] for i in numbers]
        yield {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
