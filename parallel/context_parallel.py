"""All-gather context parallelism: the helpers the training step and the attention share.

The sequence of L tokens is cut into 2 * cp chunks; CP rank r holds chunks r and 2cp-1-r (the
load-balanced "zigzag" of megatron's ``get_batch_on_this_cp_rank``, which splits the batch), so
every rank has the same causal work. Queries stay local; what attention needs from the other
ranks (for MLA: the compressed kv latent, the rope key and the indexer key, a few hundred values
per token instead of full per-head K/V) is all-gathered in natural order, and its gradient is
reduce-scattered back (megatron's sequence-parallel gather, run on the CP group).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.utils import get_batch_on_this_cp_rank


def cp_size() -> int:
    """The context-parallel size; 1 without a process group (megatron's getter says 0 then)."""
    return max(parallel_state.get_context_parallel_world_size(), 1)


def zigzag_positions(local_len: int, size: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [local_len] of CP rank ``rank``'s tokens (ascending)."""
    half = local_len // 2
    first = torch.arange(rank * half, (rank + 1) * half, device=device)
    second = torch.arange((2 * size - 1 - rank) * half, (2 * size - rank) * half, device=device)
    return torch.cat([first, second])


def local_positions(local_len: int, device=None) -> torch.Tensor | None:
    """This rank's global positions, or None without context parallelism."""
    size = cp_size()
    if size == 1:
        return None
    return zigzag_positions(local_len, size, parallel_state.get_context_parallel_rank(), device)


def _natural_order(size: int) -> torch.Tensor:
    """Chunk index into the rank-ordered gather [r0: (0, 2cp-1), r1: (1, 2cp-2), ...] for each
    chunk 0..2cp-1 of the natural order."""
    where = torch.empty(2 * size, dtype=torch.int64)
    for r in range(size):
        where[r] = 2 * r
        where[2 * size - 1 - r] = 2 * r + 1
    return where


def gather_sequence(t_local: torch.Tensor) -> torch.Tensor:
    """[s_local, ...] zigzag chunks of every CP rank -> [s_local * cp, ...] in natural order.
    Backward: the gradient of every rank's copy is summed back onto the owner (reduce-scatter)."""
    size = cp_size()
    if size == 1:
        return t_local
    gathered = gather_from_sequence_parallel_region(
        t_local, tensor_parallel_output_grad=True, group=parallel_state.get_context_parallel_group())
    chunks = gathered.view(2 * size, t_local.shape[0] // 2, *t_local.shape[1:])
    order = _natural_order(size).to(t_local.device)
    return chunks.index_select(0, order).reshape(t_local.shape[0] * size, *t_local.shape[1:])


def batch_on_this_cp_rank(batch: dict, keep_whole=("document_ids",)) -> dict:
    """This CP rank's zigzag chunks of every [b, L] tensor of ``batch`` (megatron's splitter);
    keys in ``keep_whole`` stay full (the attention masks keys of the whole sequence)."""
    if cp_size() == 1:
        return batch
    split = get_batch_on_this_cp_rank({k: v for k, v in batch.items() if k not in keep_whole},
                                      is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
    return {**batch, **split}
