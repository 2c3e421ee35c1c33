"""Analytic training FLOPs per token for GLM-5 (matmuls only; 3x forward for fwd+bwd)."""

from __future__ import annotations

from model_providers.glm5.config import GLM5Config


def attention_matmul_params(c: GLM5Config) -> int:
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    return (
        c.hidden_size * c.q_lora_rank
        + c.q_lora_rank * c.num_attention_heads * qk
        + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
        + c.num_attention_heads * c.v_head_dim * c.hidden_size
    )


def train_flops_per_token(c: GLM5Config, seq_length: int) -> float:
    """Forward matmul FLOPs per token x 3 (backward is about twice the forward)."""
    dense_ffn = 3 * c.hidden_size * c.ffn_hidden_size
    active_moe = 3 * c.hidden_size * c.moe_ffn_hidden_size * (c.moe_topk + c.num_shared_experts)
    router = c.hidden_size * (c.num_experts or 0)
    moe_layers = c.num_moe_layers
    dense_layers = c.num_layers - moe_layers
    attn = attention_matmul_params(c)
    # causal attention: QK^T and AV over on average seq/2 keys
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    attn_scores = c.num_attention_heads * (qk + c.v_head_dim) * seq_length / 2
    per_layer_dense = attn + dense_ffn
    per_layer_moe = attn + active_moe + router
    mtp_layer = 2 * c.hidden_size * c.hidden_size + (per_layer_moe if c.num_experts else per_layer_dense)
    params = (dense_layers * per_layer_dense + moe_layers * per_layer_moe
              + c.mtp_num_steps * mtp_layer
              + (1 + c.mtp_num_steps) * c.hidden_size * c.vocab_size)
    scores = (c.num_layers + c.mtp_num_steps) * attn_scores
    return 3 * (2 * params + 2 * scores)
