"""GLM-5 attention: megatron's MLA whose core attention is DeepSeek Sparse Attention.

Modes (``model.dsa.mode``):
- ``dense``: causal softmax attention over all keys; no indexer compute.
- ``warmup``: dense attention; the indexer is trained by the dense-form KL (the caller freezes
  everything else, see :func:`model_providers.glm5.dsa.modes.apply_dsa_mode`).
- ``sparse``: each query attends to its indexer top-k keys through the absorbed (MQA) form of
  MLA; the indexer is trained by the sparse-form KL over the selected keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from model_providers.glm5.dsa.indexer import LightningIndexer, select_topk
from model_providers.glm5.dsa.kl import dense_kl, sparse_kl
from model_providers.glm5.dsa.sparse_attention import sparse_latent_attention

KL_TRACKER = "indexer_kl"


class GLM5MLASelfAttention(MLASelfAttention):
    """megatron's MLA that also hands the DSA core attention what MLA computes on the way:
    the hidden states and q latent (indexer inputs), the normalised kv latent and the kv
    up-projection (the absorbed form of sparse attention)."""

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        query, key, value, q_latent, kv_latent = super().get_query_key_value_tensors(
            hidden_states, *args, **kwargs)
        self.core_attention.latents = (hidden_states, q_latent, kv_latent,
                                       self.linear_kv_up_proj.weight)
        return query, key, value, q_latent, kv_latent


def _full_sequence(t_sbh: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    return gather_from_sequence_parallel_region(t_sbh) if sequence_parallel else t_sbh


class DSACoreAttention(MegatronModule):
    """Core attention for every DSA mode. query/key [s, b, n, qk], value [s, b, n, v] with
    local (TP) heads and the full sequence -> [s, b, n * v]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None, dsa=None, **unused):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("DSACoreAttention: context parallelism comes with the CP work")
        self.dsa = dsa
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.indexer = LightningIndexer(config, dsa)
        self.latents = None
        self.last_topk = None  #: (idx, valid) of the latest sparse forward, for inspection

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            raise NotImplementedError("DSA with packed sequences is not supported yet")
        latents, self.latents = self.latents, None
        mode = self.dsa.mode
        if mode == "dense":
            return self._dense(query, key, value)
        iq, ik, iw = self._indexer_inputs(latents, query.shape[0])
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if mode == "warmup":
            out = self._dense(query, key, value)
            kl = dense_kl(iq, ik, iw, query, key, self.softmax_scale, self.dsa.query_chunk, tp_group)
        else:
            out, kl = self._sparse(query, key, value, latents, iq, ik, iw, tp_group)
        self._track(kl)
        if self.training and torch.is_grad_enabled():
            out = MoEAuxLossAutoScaler.apply(out, self.dsa.kl_coeff * kl)
        return out

    def _dense(self, query, key, value):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _indexer_inputs(self, latents, seq_len: int):
        """Indexer projections from detached, full-sequence inputs: q [b,s,H,d], k [b,s,d], w."""
        hidden, q_latent, _, _ = latents
        sp = self.config.sequence_parallel
        with torch.no_grad():
            x = _full_sequence(hidden, sp).transpose(0, 1)
            qr = _full_sequence(q_latent, sp).transpose(0, 1)
        positions = torch.arange(seq_len, device=x.device).expand(x.shape[0], seq_len)
        return self.indexer.project(x.detach(), qr.detach(), positions)

    def _sparse(self, query, key, value, latents, iq, ik, iw, tp_group):
        """Queries before position top-k see all their causal keys (top-k of fewer than k
        candidates is all of them): exact dense attention there; the absorbed sparse kernel for
        the rest. Both KL forms agree on the prefix (the selected set is every causal key)."""
        s = query.shape[0]
        prefix = min(self.dsa.topk, s)
        chunk = self.dsa.query_chunk
        out = self._dense(query[:prefix], key[:prefix], value[:prefix])
        kl = dense_kl(iq[:, :prefix], ik[:, :prefix], iw[:, :prefix], query[:prefix],
                      key[:prefix], self.softmax_scale, chunk, tp_group) * prefix
        if prefix < s:
            rest_out, rest_kl = self._sparse_rest(query, key, latents, iq, ik, iw, prefix, tp_group)
            out = torch.cat([out, rest_out], dim=0)
            kl = kl + rest_kl * (s - prefix)
        return out, kl / s

    def _sparse_rest(self, query, key, latents, iq, ik, iw, first: int, tp_group):
        """Absorbed-form sparse attention for queries ``first..s-1`` over their top-k keys."""
        _, _, kv_latent, kv_up_weight = latents
        cfg = self.config
        nope, rope, dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        s, b, n, _ = query.shape
        idx, valid = select_topk(iq[:, first:].detach(), ik.detach(), iw[:, first:].detach(),
                                 self.dsa.topk, self.dsa.query_chunk, self.dsa.indexer_dtype, first)
        self.last_topk = (idx, valid)
        w = kv_up_weight.view(n, nope + dv, cfg.kv_lora_rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q_nope, q_pe = query[first:].split([nope, rope], dim=-1)
        q_abs = torch.cat([torch.einsum("sbnd,ndc->bsnc", q_nope, w_uk),
                           q_pe.transpose(0, 1)], dim=-1)
        c = _full_sequence(kv_latent, cfg.sequence_parallel)  # [s, b, kv_lora_rank]
        kv = torch.cat([c, key[:, :, 0, nope:]], dim=-1).transpose(0, 1)  # [b, s, lora + rope]
        o_lat, head_probs = sparse_latent_attention(
            q_abs.contiguous(), kv.contiguous(), idx, valid, self.softmax_scale,
            cfg.kv_lora_rank, self.dsa.query_chunk)
        out = torch.einsum("bsnc,nvc->sbnv", o_lat, w_uv).reshape(s - first, b, n * dv)
        kl = sparse_kl(iq[:, first:], ik, iw[:, first:], idx, valid, head_probs,
                       self.dsa.query_chunk, tp_group)
        return out, kl

    def _track(self, kl: torch.Tensor) -> None:
        cfg = self.config
        save_to_aux_losses_tracker(
            KL_TRACKER, kl.detach(), self.layer_number, cfg.num_layers + (cfg.mtp_num_layers or 0),
            avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
