"""Local (non-Transformer-Engine) building blocks for GLM-5: an RMSNorm that works under
sequence parallelism and a core attention for MLA's unequal q/k and v head dims."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class RMSNorm(torch.nn.Module):
    """RMSNorm whose weight is marked ``sequence_parallel`` when SP is on, so megatron's DDP
    all-reduces its gradient across the TP group (each rank saw only its sequence shard)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class MLACoreAttention(MegatronModule):
    """Causal softmax attention with torch SDPA; q/k head dim (nope + rope) may differ from the
    value head dim, which megatron's local ``DotProductAttention`` rejects (upstream #1589).

    query, key: [s, b, heads, qk_dim]; value: [s, b, heads, v_dim] -> [s, b, heads * v_dim].
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None, **unused):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("MLACoreAttention: context parallelism is not supported")
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            raise NotImplementedError("MLACoreAttention: packed sequences are not supported yet")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
