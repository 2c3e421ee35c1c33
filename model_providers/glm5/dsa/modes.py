"""Which parameters train in each DSA mode."""

from __future__ import annotations

INDEXER_TAG = ".indexer."


def is_indexer_param(name: str) -> bool:
    return INDEXER_TAG in f".{name}"


def apply_dsa_mode(model_chunks, tcfg, mode: str) -> None:
    """dense: everything but the indexer trains (it is not computed); warmup: only the indexer
    trains (the aux-loss-free expert bias is held: its update rate is 0, so nothing else changes); sparse:
    everything trains. Call before DDP wrapping and optimizer construction."""
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            indexer = is_indexer_param(name)
            param.requires_grad = {"dense": not indexer, "warmup": indexer, "sparse": True}[mode]
    if mode == "warmup":  # routing still counts tokens (load-balance metrics), the bias holds
        tcfg.moe_router_bias_update_rate = 0.0
