"""One forward and backward of a model built the way the provider builds it, on one rank: the
loss and every trained parameter's gradient, for tests that compare two configurations of the
same model (a fused kernel against the unfused path)."""

from __future__ import annotations


def loss_and_grads(cfg, par, precision, batch: int, seq: int):
    """(loss, {name: gradient}) of the GLM5Config ``cfg`` under ``par`` / ``precision``, its
    weights and tokens drawn from fixed seeds (the same for every configuration)."""
    import torch
    from megatron.core import tensor_parallel

    from model_providers.glm5.model.config import to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks

    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    tcfg = to_transformer_config(cfg, par, precision)
    (model,) = build_model_chunks(cfg, tcfg, "local")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq)
    loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, 1)).float().mean()
    loss.backward()
    return loss.detach(), {n: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone()
                           for n, p in model.named_parameters() if p.requires_grad}
