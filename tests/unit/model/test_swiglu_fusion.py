"""``parallel.bias_activation_fusion``: megatron's fused SwiGLU (``bias_swiglu_impl`` in the dense
and shared-expert MLPs, ``weighted_bias_swiglu_impl`` where routed experts fold their routing
probabilities in) runs on CPU ranks and gives the unfused model's loss and gradients."""

import pytest
import torch

from model_providers.glm5.model.config import GLM5Config
from pretrain.config.schema import PrecisionConfig


def _loss_and_grads(fused: bool, calls: dict, monkeypatch):
    from megatron.core.transformer import mlp

    from model_providers.glm5.model.config import to_transformer_config
    from parallel.config import ParallelConfig
    from tests.support.one_step import loss_and_grads

    monkeypatch.undo()  # the other run's counters
    for name in ("bias_swiglu_impl", "weighted_bias_swiglu_impl"):
        real = getattr(mlp, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mlp, name, counted)
    par = ParallelConfig(bias_activation_fusion=fused)
    assert to_transformer_config(GLM5Config(), par, PrecisionConfig()).bias_activation_fusion is fused
    return loss_and_grads(GLM5Config(), par, PrecisionConfig(), batch=2, seq=48)


def test_fused_swiglu_trains_like_the_unfused_one(one_rank, monkeypatch):
    unfused_calls, fused_calls = {}, {}
    loss, grads = _loss_and_grads(False, unfused_calls, monkeypatch)
    fused_loss, fused_grads = _loss_and_grads(True, fused_calls, monkeypatch)
    assert unfused_calls == {} and sum(fused_calls.values()) > 0, fused_calls  # the fused path ran
    assert fused_loss == pytest.approx(loss.item(), rel=1e-6)
    assert grads.keys() == fused_grads.keys()
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)
