"""The DSA warm-up trains only the indexers, on inputs they read detached: ``GLM5Model`` runs the
frozen network without autograd and attaches each indexer's KL to its output
(``dsa.modes.FrozenOutput``). Its indexer gradients equal those of the plain forward, where each
KL rides on its layer's output and backward runs through every frozen layer, and no frozen layer
keeps anything for a backward (today's forward made every layer output need a gradient)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe import moe_utils

from model_providers.glm5.model.config import DSAConfig, GLM5Config, PrecisionConfig, to_transformer_config
from model_providers.glm5.model.dsa.attention import KL_TRACKER
from model_providers.glm5.model.provider import build_model_chunks
from parallel.config import ParallelConfig
from parallel.megatron_compat import MicroBatch, reset_loss_trackers

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="builds on CPU ranks")


@pytest.fixture(scope="module")
def warmup_model(one_rank):
    from megatron.core import tensor_parallel

    cfg = dataclasses.replace(GLM5Config(), dsa=DSAConfig(mode="warmup", topk=8), recompute="full")
    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    (model,) = build_model_chunks(cfg, to_transformer_config(cfg, ParallelConfig(), PrecisionConfig()), "local")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 257, (2, 24), generator=g)
    # two documents in the first sample: the attention and the KL's target see document masks
    documents = torch.zeros(2, 24, dtype=torch.long)
    documents[0, 10:] = 1
    batch = (tokens, torch.arange(24).expand(2, 24), documents, torch.roll(tokens, -1, dims=1))
    return model, batch


def _plain_forward(model, tokens, positions, documents, labels):
    """megatron's forward with grad: each KL rides on its layer's output. The frozen embedding's
    output is made to need a gradient, or full recomputation's layer outputs would need none and
    backward would reach no indexer (what the warm-up did before its frozen forward)."""
    hook = model.embedding.register_forward_hook(lambda m, i, o: o.detach().requires_grad_())
    try:
        with MicroBatch(documents).active():
            return GPTModel.forward(model, tokens, positions, documents, labels=labels)
    finally:
        hook.remove()


def _indexer_grads(model, forward, batch):
    tokens, positions, documents, labels = batch
    model.train()
    model.zero_grad(set_to_none=True)
    reset_loss_trackers()
    loss = forward(tokens, positions, documents, labels)
    loss.sum().backward()  # full recomputation logs the plain forward's KL in backward
    kl = moe_utils.get_moe_layer_wise_logging_tracker()[KL_TRACKER]["values"].clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), kl, grads


def test_warmup_indexer_gradients_equal_the_backward_through_the_frozen_network(warmup_model):
    model, batch = warmup_model
    indexers = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert indexers and all(".indexer." in n for n in indexers)

    def plain(tokens, positions, documents, labels):  # megatron's forward, KL on each layer's output
        return _plain_forward(model, tokens, positions, documents, labels)

    def frozen(tokens, positions, documents, labels):
        return model(tokens, positions, documents, labels=labels)

    loss, kl, grads = _indexer_grads(model, plain, batch)
    loss_f, kl_f, grads_f = _indexer_grads(model, frozen, batch)
    reset_loss_trackers()
    assert sorted(grads) == sorted(grads_f) == indexers  # the MTP layer's indexer too
    torch.testing.assert_close(loss_f, loss, rtol=0, atol=0)
    torch.testing.assert_close(kl_f, kl, rtol=0, atol=0)  # logged once per layer either way
    assert bool((kl[: len(model.decoder.layers) + 1] > 0).all()), kl
    for name in indexers:
        torch.testing.assert_close(grads_f[name], grads[name], rtol=1e-6, atol=1e-9, msg=name)
        assert grads[name].abs().sum() > 0, name


def test_warmup_runs_no_frozen_layer_under_autograd(warmup_model):
    """No frozen layer's output carries autograd history (so nothing is kept for it and backward
    never enters it); the plain forward's every layer output needs a gradient."""
    model, (tokens, positions, documents, labels) = warmup_model
    model.train()
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o[0] if isinstance(o, tuple) else o))
             for layer in model.decoder.layers]
    try:
        out = model(tokens, positions, documents, labels=labels)
        frozen_outputs, outputs[:] = list(outputs), []
        _plain_forward(model, tokens, positions, documents, labels)
    finally:
        for h in hooks:
            h.remove()
        reset_loss_trackers()
    assert out.requires_grad and len(frozen_outputs) == len(outputs) == len(model.decoder.layers)
    assert not any(o.requires_grad for o in frozen_outputs)
    assert all(o.requires_grad for o in outputs)
