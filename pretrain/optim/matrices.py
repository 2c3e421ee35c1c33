"""Which parameters Muon orthogonalises, and how: whole, per attention head (Muon Split), or
gathered over tensor parallelism first.

Muon takes every trainable hidden 2-D matrix: attention projections (MLA down/up, output), dense
and shared-expert MLPs, each routed expert's own matrices (megatron keeps one parameter per local
expert, so experts are orthogonalised one by one), the MTP ``eh_proj`` and the DSA indexer's
projections when they train. Adam keeps the embedding, the output layer, norms, the router and
every other non-2-D parameter. Frozen parameters (``requires_grad=False``) are in neither.

Tensor parallelism: a matrix's split is read from its ``tensor_model_parallel`` / ``partition_dim``
attributes, which the model provider sets from each layer's layout under every backend
(``parallel.megatron_compat.tp_attributes``; Transformer Engine's own marks call replicated and
row-parallel expert weights split along dim 0). megatron shards ``linear_q_up_proj`` /
``linear_kv_up_proj`` by head, so with ``split=per_head`` every block is TP-local and needs no
communication. Any other TP-sharded matrix (column-parallel: rows split; row-parallel: columns
split) is gathered to the full matrix over its TP group, orthogonalised whole on every TP rank, and
each rank keeps its own shard: the update is the one-rank update exactly (up to summation order),
at the cost of one all-gather of the matrix and TP-fold duplicated Newton-Schulz work. Gathered row
order does not matter (fc1's [gate; up] interleaves per rank): orthogonalisation commutes with row
and column permutations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state

SPLITS = ("none", "per_head")


@dataclass(frozen=True)
class MatrixSpec:
    """How one (TP-local) parameter matrix is orthogonalised."""

    name: str
    shape: tuple  #: the TP-local [rows, cols]
    block_rows: Optional[tuple] = None  #: per-head row blocks, repeated over the local heads
    tp_group: Optional[object] = None  #: gather the full matrix over this group first
    tp_dim: Optional[int] = None  #: the dimension megatron shards over ``tp_group``


def uses_adam(name: str, param: torch.Tensor) -> bool:
    """``shared_embedding``: megatron keeps a copy of the word embedding on the last pipeline
    stage for MTP (flagged only that way); its gradient is summed with the first stage's, and it
    must get the same (Adam) update or the two copies drift apart."""
    return (param.ndim != 2 or getattr(param, "is_embedding_or_output_parameter", False)
            or getattr(param, "shared_embedding", False) or ".router." in f".{name}")


def head_blocks(name: str, shape, tcfg, split: str) -> Optional[tuple]:
    """Muon Split's per-head blocks of MLA's up-projection ``name`` (rows per head, in order), or
    None where the matrix is orthogonalised whole (``split`` other than per_head, other weights)."""
    if split != "per_head":
        return None
    if name.endswith("linear_q_up_proj.weight"):
        blocks = (tcfg.qk_head_dim + tcfg.qk_pos_emb_head_dim,)
    elif name.endswith("linear_kv_up_proj.weight"):
        blocks = (tcfg.qk_head_dim, tcfg.v_head_dim)
    else:
        return None
    local_heads = tcfg.num_attention_heads // tcfg.tensor_model_parallel_size
    if shape[0] != local_heads * sum(blocks):
        raise ValueError(f"{name}: {shape[0]} rows, expected {local_heads} local heads x "
                         f"{sum(blocks)} ({'+'.join(map(str, blocks))})")
    return blocks


def _tp_group(name: str, param: torch.Tensor):
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if ".experts." in f".{name}":
        group = parallel_state.get_expert_tensor_parallel_group()
    else:
        group = parallel_state.get_tensor_model_parallel_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


def muon_matrices(model_chunks, split: str) -> dict:
    """{parameter: MatrixSpec} for every trainable parameter Muon updates on this rank."""
    specs = {}
    for chunk in model_chunks:
        tcfg = chunk.config
        for name, p in chunk.named_parameters():
            if not p.requires_grad or uses_adam(name, p):
                continue
            blocks = head_blocks(name, tuple(p.shape), tcfg, split)
            group = None if blocks else _tp_group(name, p)
            specs[p] = MatrixSpec(name=name, shape=tuple(p.shape), block_rows=blocks,
                                  tp_group=group, tp_dim=p.partition_dim if group else None)
    return specs
