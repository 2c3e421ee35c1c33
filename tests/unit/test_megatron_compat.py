"""One test per fix in ``parallel/megatron_compat``: each reproduces the upstream behaviour the
fix changes, so a megatron-core upgrade shows which fix to re-check."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from parallel import megatron_compat
from parallel.megatron_compat import fixes


def test_install_refuses_another_megatron_core_version(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"written for megatron-core 0\.16\.1, found 0\.17\.0"):
        fixes._check_version()


def _tiny_moe_model_after_one_step():
    """A tiny GLM-5 (MoE layers, alltoall dispatcher) under megatron DDP after one forward and
    backward; returns weak references to the model and the DDP wrapper."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from model_providers.glm5.config import GLM5Config, to_transformer_config
    from model_providers.glm5.provider import build_model_chunks
    from parallel.config import ParallelConfig
    from model_providers.glm5.config import PrecisionConfig

    cfg = GLM5Config()
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    (chunk,) = build_model_chunks(cfg, tcfg, "local")
    ddp = DistributedDataParallel(config=tcfg, ddp_config=DistributedDataParallelConfig(), module=chunk)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    loss = ddp(tokens, positions, None, labels=tokens, loss_mask=torch.ones(2, 32))
    loss.sum().backward()
    return weakref.ref(chunk), weakref.ref(ddp)


def test_a_trained_moe_model_is_freed_once_dropped(one_rank):
    """Without the fix the alltoall dispatcher's ``probs`` keep the autograd history, whose
    gradient-accumulator hooks hold megatron's DDP, alive: the model outlives every reference."""
    model, ddp = _tiny_moe_model_after_one_step()
    gc.collect()
    assert model() is None and ddp() is None


def test_rotary_embedding_caches_release_their_modules(one_rank):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    rope(8)
    ref = weakref.ref(rope)
    del rope
    gc.collect()
    assert ref() is not None  # megatron's lru_cache on forward holds the module
    megatron_compat.release_cached_modules()
    gc.collect()
    assert ref() is None


def test_mla_have_te_is_false_without_transformer_engine():
    megatron_compat.install()
    from megatron.core.transformer import multi_latent_attention

    assert multi_latent_attention.HAVE_TE is False


def test_moe_utils_te_general_gemm_is_none_and_router_gemm_falls_back():
    megatron_compat.install()
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    torch.manual_seed(0)
    inp = torch.randn(2, 3, 8)
    weight = torch.randn(4, 8)
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    assert out.shape == (2, 3, 4)
    torch.testing.assert_close(out, inp @ weight.t())
