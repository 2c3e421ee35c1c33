"""Micro-batches for this data-parallel rank from any indexable sample dataset."""

from __future__ import annotations

from typing import Iterator

import torch


def micro_batches(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_size: int) -> Iterator[dict]:
    """Yield this DP rank's micro-batches of one global batch, starting at ``consumed_samples``.

    The global batch is the same set of samples for every layout; DP rank ``r`` takes
    micro-batches ``r, r + dp, r + 2 dp, ...`` of it."""
    per_rank = global_batch_size // dp_size
    for m in range(per_rank // micro_batch_size):
        first = consumed_samples + (m * dp_size + dp_rank) * micro_batch_size
        samples = [dataset[first + i] for i in range(micro_batch_size)]
        yield {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
