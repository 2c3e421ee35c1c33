"""Which parameters train in each DSA mode."""

from __future__ import annotations

import torch

INDEXER_TAG = ".indexer."


def is_indexer_param(name: str) -> bool:
    return INDEXER_TAG in f".{name}"


def apply_dsa_mode(model_chunks, tcfg, mode: str) -> None:
    """none: everything trains (the model has no indexer); dense: everything but the indexer trains (it is not computed); warmup: only the indexer
    trains (the aux-loss-free expert bias is held: its update rate is 0, so nothing else changes); sparse:
    everything trains. Call before DDP wrapping and optimizer construction."""
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            indexer = is_indexer_param(name)
            param.requires_grad = {"none": True, "dense": not indexer, "warmup": indexer,
                                   "sparse": True}[mode]
    if mode == "warmup":  # routing still counts tokens (load-balance metrics), the bias holds
        tcfg.moe_router_bias_update_rate = 0.0
        for chunk in model_chunks:
            if getattr(chunk, "embedding", None) is not None:
                chunk.embedding.register_forward_hook(_output_requires_grad)


def _output_requires_grad(module, args, output):
    """Warm-up freezes the embedding, so the first layer's input needs no gradient. Under full
    recomputation each layer is one checkpoint function whose output then needs none either
    (the indexer's parameters inside are not its inputs): the KL would reach no indexer and
    megatron's backward would silently skip. Asking for the input's gradient keeps the path."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.detach().requires_grad_()
    return output
