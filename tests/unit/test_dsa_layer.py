"""The DSA core attention inside megatron's MLA, sparse mode: its output equals per-head softmax
attention restricted to the indexer's top-k keys (a plain masked reference built from the same
layer's q/k/v), with top-k well below the sequence length."""

import pytest
import torch

from model_providers.glm5.config import DSAConfig


def _layer(mode, topk):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from model_providers.glm5.specs import _local_layer_spec

    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=24,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="rope",
        rotary_scaling_factor=1.0, normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, use_cpu_initialization=True, init_method_std=0.2)
    dsa = DSAConfig(mode=mode, index_heads=2, index_head_dim=16, topk=topk, query_chunk=7)
    return build_module(_local_layer_spec(None, dsa).submodules.self_attention, config=cfg, layer_number=1)


def test_sparse_layer_equals_masked_per_head_reference(one_rank):
    torch.manual_seed(0)
    layer = _layer("sparse", topk=10)
    captured = {}
    core = layer.core_attention
    core.register_forward_pre_hook(lambda m, args: captured.update(q=args[0], k=args[1], v=args[2]))
    x = torch.randn(40, 1, 64)
    out, _ = layer(x, attention_mask=None)

    q, k, v = captured["q"], captured["k"], captured["v"]  # [s, b, n, d]
    s = q.shape[0]
    idx, valid = core.last_topk  # for queries 10..39 (earlier ones see every causal key)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    sparse_rows = torch.zeros(s - 10, s, dtype=torch.bool).scatter_(1, idx[0], valid[0])
    allowed[10:] = sparse_rows
    assert int(allowed[10:].sum(1).max()) == 10 and not bool((allowed & ~torch.ones(s, s, dtype=torch.bool).tril()).any())
    scores = torch.einsum("snd,tnd->nst", q[:, 0], k[:, 0]) * core.softmax_scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("nst,tnv->snv", probs, v[:, 0]).reshape(s, 1, -1)
    ref_out, _ = layer.linear_proj(ref)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)


def test_sparse_layer_with_topk_at_least_length_equals_dense(one_rank):
    torch.manual_seed(1)
    dense, sparse = _layer("dense", 64), _layer("sparse", 64)
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(33, 2, 64)
    out_dense, _ = dense(x, attention_mask=None)
    out_sparse, _ = sparse(x, attention_mask=None)
    assert torch.allclose(out_sparse, out_dense, rtol=1e-5, atol=1e-6)
