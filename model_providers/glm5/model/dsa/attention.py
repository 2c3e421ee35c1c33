"""GLM-5 attention: megatron's MLA whose core attention is DeepSeek Sparse Attention.

Modes (``model.dsa.mode``):
- ``none``: no indexer at all (built without one: DeepSeek-V3); plain causal MLA as ``dense``.
- ``dense``: causal softmax attention over all keys; no indexer compute.
- ``warmup``: dense attention; the indexer is trained by the dense-form KL (the caller freezes
  everything else, see :func:`model_providers.glm5.model.dsa.modes.apply_dsa_mode`).
- ``sparse``: each query attends to its indexer top-k keys through the absorbed (MQA) form of
  MLA; the indexer is trained by the sparse-form KL over the selected keys.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from model_providers.glm5.model.dsa.dense_attention import dense_attention
from model_providers.glm5.model.dsa.indexer import LightningIndexer, select_topk
from model_providers.glm5.model.dsa.kernels import HAVE_TRITON, sparse_mla_triton
from model_providers.glm5.model.dsa.kernels.dsa_cpu import cpu_kernel, fits_cpu_kernel, sparse_mla_cpu
from model_providers.glm5.model.dsa.kl import dense_kl, sparse_kl
from model_providers.glm5.model.dsa.visibility import TokenLayout
from model_providers.glm5.model.dsa.sparse_attention import all_visible, sparse_latent_attention
from parallel.context_parallel import cp_size, gather_sequence, local_positions
from parallel.megatron_compat import micro_batch
from parallel.device import on_gpu

KL_TRACKER = "indexer_kl"


@dataclass(frozen=True)
class MLAIntermediates:
    """What megatron's MLA computes on the way to q, k, v and DSA needs again: the indexer reads
    the layer input and the q latent, the absorbed (MQA) form of sparse attention the kv latent
    and the kv up-projection. ``s`` is this rank's sequence: the CP chunk, and under sequence
    parallelism its 1/tp share (the core attention gathers it)."""

    hidden_states: torch.Tensor  #: [s, b, hidden] the attention's (normalised) input
    q_latent: torch.Tensor  #: [s, b, q_lora_rank] after q_a_layernorm
    kv_latent: torch.Tensor  #: [s, b, kv_lora_rank] after kv_a_layernorm
    kv_up_weight: torch.Tensor  #: [n * (qk_head_dim + v_head_dim), kv_lora_rank], this TP rank's n heads
    kv_full: torch.Tensor | None  #: [L, b, kv_lora_rank] the CP-gathered kv latent; None without CP
    #: [L, b, qk_rope] every key's rotary part, CP-gathered, where the per-head key holds only the
    #: sparse mode's dense prefix (sparse under CP); else None (the key holds every row)
    k_rope_full: torch.Tensor | None = None

    def tensors(self) -> tuple:
        """The fields in order (as checkpoint inputs: autograd saves tensors, not this object;
        ``MLAIntermediates(*tensors)`` rebuilds it)."""
        return tuple(getattr(self, f.name) for f in fields(self))


class GLM5MLASelfAttention(MLASelfAttention):
    """megatron's MLA that also hands the DSA core attention its :class:`MLAIntermediates`.
    megatron calls the core attention with q, k, v and the mask only, so they are handed over
    through the micro-batch being computed (``megatron_compat.micro_batch``: taken once by the
    core attention; megatron's selective recomputation of the core attention carries them as
    checkpoint inputs). Under context parallelism it returns local queries and full-sequence
    keys/values rebuilt from the all-gathered latent."""

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        active = micro_batch.current()
        if active is None:
            raise RuntimeError(
                f"GLM5MLASelfAttention (layer {self.layer_number}) runs inside a micro-batch: "
                "GLM5Model.forward makes one active; a layer called on its own needs "
                "`with MicroBatch(document_ids).active():` (parallel.megatron_compat)")
        if not self.config.sequence_parallel:  # under SP the projection's input is a TP shard
            self.linear_kv_up_proj.rows = 1 if cp_size() > 1 else self._keys_read(hidden_states.shape[0])
        query, key, value, q_latent, kv_latent = super().get_query_key_value_tensors(
            hidden_states, *args, **kwargs)
        kv_full = k_rope_full = None
        if cp_size() > 1:
            key, value, kv_full, k_rope_full = self._gathered_key_value(key, kv_latent)
        active.hand_over(self.core_attention, MLAIntermediates(
            hidden_states, q_latent, kv_latent, self.linear_kv_up_proj.weight, kv_full, k_rope_full))
        return query, key, value, q_latent, kv_latent

    def _keys_read(self, length: int) -> int | None:
        """How many leading tokens' per-head keys and values the core attention reads (None:
        all): sparse DSA reads them for its dense prefix only."""
        dsa = self.core_attention.dsa
        return min(dsa.topk, length) if dsa.mode == "sparse" else None

    def _gathered_key_value(self, key_local, kv_latent):
        """``(key, value, c_full, k_rope_full)`` from the CP-gathered kv latent c_full [L, b,
        kv_lora_rank] and rope key (the gathered state per token is kv_lora_rank + qk_rope
        values, not n * (qk + v)): key [R, b, n, qk] and value [R, b, n, v] for this rank's
        heads and the R rows the core attention reads -- every row (R = L), or in sparse mode
        the dense prefix's (R = top-k), whose later queries read the latent and ``k_rope_full``
        [L, b, rope] (None when R = L): no full-length per-head key, value or gradient."""
        cfg = self.config
        nope = cfg.qk_head_dim
        c_full = gather_sequence(_full_sequence(kv_latent, cfg.sequence_parallel))
        k_rope = gather_sequence(key_local[:, :, 0, nope:])  # [L, b, rope]
        n = key_local.shape[2]
        rows = self._keys_read(c_full.shape[0]) or c_full.shape[0]
        kv = F.linear(c_full[:rows], self.linear_kv_up_proj.weight).view(rows, c_full.shape[1], n, -1)
        k_nope, value = kv.split([nope, cfg.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_rope[:rows, :, None].expand(-1, -1, n, -1)], dim=-1)
        return key.contiguous(), value.contiguous(), c_full, (k_rope if rows < c_full.shape[0] else None)


def use_triton_kernels(kernels: str, query: torch.Tensor) -> bool:
    """``model.dsa.kernels``: triton (always), torch (never), auto (on a real GPU when triton
    imports; not on the strict CPU emulation's tracked device)."""
    if kernels == "auto":
        return on_gpu(query) and HAVE_TRITON
    return kernels == "triton"


def use_cpu_kernel(kernels: str, query: torch.Tensor) -> bool:
    """``model.dsa.kernels=auto`` on CPU tensors: the fused C++ sparse MLA where it builds."""
    return kernels == "auto" and fits_cpu_kernel(query) and cpu_kernel() is not None


def _full_sequence(t_sbh: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    return gather_from_sequence_parallel_region(t_sbh) if sequence_parallel else t_sbh


def _document_ids(attention_mask):
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.dtype.is_floating_point or attention_mask.dtype == torch.bool:
        raise ValueError(
            "DSACoreAttention takes per-token document ids [b, L] (int) in the attention_mask "
            f"slot, got {attention_mask.dtype} {tuple(attention_mask.shape)}")
    return attention_mask


class _KeyReads(torch.autograd.Function):
    """What sparse mode reads of megatron's per-head key [L, b, n, qk + rope]: the dense prefix's
    rows (a copy of ``key[:kp]``) and every key's rotary part (shared by the heads: head 0's,
    [L, b, rope]). The backward builds the key's gradient once (as slices, each read would
    get its own zero-filled full-size gradient, summed after)."""

    @staticmethod
    def forward(ctx, key, kp: int, nope: int):
        ctx.kp, ctx.nope, ctx.shape = kp, nope, key.shape
        ctx.set_materialize_grads(False)  # a CP rank without prefix rows reads no key rows
        return key[:kp].clone(), key[:, :, 0, nope:].clone()

    @staticmethod
    def backward(ctx, grad_head, grad_rope):
        grad = (grad_rope if grad_head is None else grad_head).new_zeros(ctx.shape)  # one of them is set
        if grad_head is not None:
            grad[:ctx.kp] = grad_head
        if grad_rope is not None:
            grad[:, :, 0, ctx.nope:] += grad_rope
        return grad, None, None


class DSACoreAttention(MegatronModule):
    """Core attention for every DSA mode. query [s, b, n, qk] (this rank's queries), key
    [L, b, n, qk] and value [L, b, n, v] (the full sequence; L = s without CP) with local (TP)
    heads -> [s, b, n * v]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None, dsa=None, **unused):
        super().__init__(config=config)
        self.dsa = dsa
        self.layer_number = layer_number
        #: this layer's slot (1-based) in the per-layer loss trackers: its number among the
        #: decoder's layers; the model gives the MTP layer's (numbered from 1 again by megatron
        #: 0.19) the slot after them, as megatron's router does
        self.tracker_slot = layer_number
        self.softmax_scale = softmax_scale
        self.indexer = None if dsa.mode == "none" else LightningIndexer(config, dsa)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            raise NotImplementedError("DSA takes packed documents as document ids in attention_mask, "
                                      "not megatron's THD packed_seq_params")
        mla = micro_batch.take(self)  # GLM5MLASelfAttention's, for this call
        s = query.shape[0]
        keys = key.shape[0] if mla is None or mla.k_rope_full is None else mla.k_rope_full.shape[0]
        layout = TokenLayout.build(s, keys, _document_ids(attention_mask), local_positions(s),
                                   query.device)
        mode = self.dsa.mode
        if mode in ("dense", "none"):
            return self._dense(query, key, value, layout)
        if mla is None:
            raise RuntimeError(
                f"DSACoreAttention (layer {self.layer_number}, model.dsa.mode={mode}) got no "
                "MLAIntermediates: it runs inside GLM5MLASelfAttention, which hands them over "
                "through the micro-batch being computed")
        tp_group = parallel_state.get_tensor_model_parallel_group()
        # the DSA warm-up's frozen forward (dsa.modes.indexer_only_forward) runs without autograd:
        # the indexer differentiates its KL here, and the model's output hands the gradients on
        collected = micro_batch.precomputed_grads() if mode == "warmup" else None
        if mode == "warmup":
            out = self._dense(query, key, value, layout)
            with torch.enable_grad() if collected is not None else contextlib.nullcontext():
                iq, ik, iw = self._indexer_inputs(mla, layout)
                kl = dense_kl(iq, ik, iw, query, key, self.softmax_scale, self.dsa.query_chunk,
                              tp_group, layout, use_cpu_kernel(self.dsa.kernels, query))
                if collected is not None:
                    self._indexer_grads_now(self.dsa.kl_coeff * kl / cp_size(), collected)
        else:
            iq, ik, iw = self._indexer_inputs(mla, layout)
            out, kl = self._sparse(query, key, value, mla, iq, ik, iw, tp_group, layout)
        # kl is this rank's per-query mean; CP ranks hold equally many queries, so the mean over
        # the CP group (the tracker's average) is the sequence mean. megatron scales aux losses
        # by cp before DDP averages gradients over CP: divide by cp to get the mean's gradient.
        if torch.is_grad_enabled() or not self.training or collected is not None:
            # full activation recomputation runs a training forward twice: first without grad
            # (not logged), then again inside backward (logged once here); a frozen forward once
            self._track(kl)
        if collected is None and self.training and torch.is_grad_enabled():
            out = MoEAuxLossAutoScaler.apply(out, self.dsa.kl_coeff * kl / cp_size())
        return out

    def _indexer_grads_now(self, loss, collected: dict) -> None:
        """The indexer's parameter gradients of ``loss`` (its KL, built from detached inputs: the
        backward ends at the indexer), added to ``collected``: what the frozen forward keeps of
        this layer is their size (the KL's gradients and the projections' inputs are freed)."""
        params = [p for p in self.indexer.parameters() if p.requires_grad]
        for param, grad in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
            if grad is not None:
                collected[param] = grad if param not in collected else collected[param] + grad

    def _dense(self, query, key, value, layout: TokenLayout):
        return dense_attention(query, key, value, layout, self.softmax_scale,
                               triton=use_triton_kernels(self.dsa.kernels, query))

    def _indexer_inputs(self, mla: MLAIntermediates, layout: TokenLayout):
        """Indexer projections from detached inputs: q [b,s,H,d] and w [b,s,H] for this rank's
        queries (RoPE at their global positions), k [b,L,d] for the full sequence (CP-gathered;
        its gradient flows back to the ranks that computed it)."""
        sp = self.config.sequence_parallel
        with torch.no_grad():
            x = _full_sequence(mla.hidden_states, sp).transpose(0, 1)
            qr = _full_sequence(mla.q_latent, sp).transpose(0, 1)
        positions = layout.q_pos.expand(x.shape[0], -1)
        iq, ik, iw = self.indexer.project(x.detach(), qr.detach(), positions)
        if cp_size() > 1:
            ik = gather_sequence(ik.transpose(0, 1)).transpose(0, 1)
        return iq, ik, iw

    def _sparse(self, query, key, value, mla: MLAIntermediates, iq, ik, iw, tp_group,
                layout: TokenLayout):
        """Queries at global positions before top-k see all their keys (top-k of fewer than k
        candidates is all of them): exact dense attention there, over keys 0..k-1; the absorbed
        sparse kernel for the rest. Local positions ascend, so these queries are a leading block
        of rows. Both KL forms agree on the prefix (the selected set is every visible key)."""
        s = query.shape[0]
        topk, chunk = self.dsa.topk, self.dsa.query_chunk
        kp = min(topk, layout.key_len)
        prefix = layout.rows_before(topk)
        q_head, q_rest = query.split([prefix, s - prefix])
        if mla.k_rope_full is not None:  # under CP the MLA built the prefix's per-head keys only
            k_head, k_rope = key, mla.k_rope_full
        else:  # one split and one read of the key (their backwards build its gradient once; a
            # slice per use builds a zero-filled one each, summed after)
            k_head, k_rope = _KeyReads.apply(key, kp, self.config.qk_head_dim)
        outs, kl = [], iq.new_zeros((), dtype=torch.float32)
        if prefix:
            head = layout.rows(0, prefix, kp)
            outs.append(self._dense(q_head, k_head, value[:kp], head))
            kl = dense_kl(iq[:, :prefix], ik[:, :kp], iw[:, :prefix], q_head, k_head,
                          self.softmax_scale, chunk, tp_group, head,
                          use_cpu_kernel(self.dsa.kernels, query)) * prefix
        if prefix < s:
            rest_out, rest_kl = self._sparse_rest(q_rest, k_rope, mla, iq, ik, iw, prefix, tp_group,
                                                  layout)
            outs.append(rest_out)
            kl = kl + rest_kl * (s - prefix)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out, kl / s

    def _sparse_rest(self, query, k_rope, mla: MLAIntermediates, iq, ik, iw, first: int,
                     tp_group, layout):
        """Absorbed-form sparse attention for query rows ``first..s-1`` (``query`` holds them)
        over their top-k keys; ``k_rope`` [L, b, rope]: every key's rotary part."""
        cfg = self.config
        nope, rope, dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        rows, b, n, _ = query.shape
        triton = use_triton_kernels(self.dsa.kernels, query)
        fused = not triton and use_cpu_kernel(self.dsa.kernels, query)
        idx, valid = select_topk(iq[:, first:].detach(), ik.detach(), iw[:, first:].detach(),
                                 self.dsa.topk, self.dsa.query_chunk, self.dsa.indexer_dtype,
                                 first, layout, triton, fused)
        lora = cfg.kv_lora_rank
        w = mla.kv_up_weight.view(n, nope + dv, lora)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q_nope, q_pe = query.split([nope, rope], dim=-1)
        # W_UK per head as one bmm over [n, b * rows, nope]: the absorbed query's latent part
        # comes head-major, [b, rows, n, lora] as a view
        q_lat = torch.bmm(q_nope.permute(2, 1, 0, 3).reshape(n, b * rows, nope), w_uk)
        q_lat = q_lat.view(n, b, rows, lora).permute(1, 2, 0, 3)
        q_pe = q_pe.transpose(0, 1)  # [b, rows, n, rope]
        c = mla.kv_full
        if c is None:
            c = _full_sequence(mla.kv_latent, cfg.sequence_parallel)
        kv = torch.cat([c, k_rope], dim=-1).transpose(0, 1).contiguous()  # [b, L, lora + rope]
        if fused:  # reads both pieces in place: no [b, rows, n, lora + rope] concatenation
            o_lat, head_probs = sparse_mla_cpu(q_lat, q_pe, kv, idx,
                                               None if all_visible(valid) else valid, self.softmax_scale)
        else:
            q_abs = torch.cat([q_lat, q_pe], dim=-1).contiguous()
            if triton:
                o_lat, head_probs = sparse_mla_triton(q_abs, kv, idx, valid, self.softmax_scale, lora)
            else:
                o_lat, head_probs = sparse_latent_attention(q_abs, kv, idx, valid, self.softmax_scale,
                                                            lora, self.dsa.query_chunk)
        # W_UV per head as one bmm over [n, b * rows, c]: a view when o_lat is head-major (the
        # fused CPU kernel's), so the storage the kernel keeps is the one this GEMM keeps
        o_heads = o_lat.permute(2, 0, 1, 3).reshape(n, b * rows, lora)
        out = torch.bmm(o_heads, w_uv.transpose(1, 2)).view(n, b, rows, dv)
        out = out.permute(2, 1, 0, 3).reshape(rows, b, n * dv)
        kl = sparse_kl(iq[:, first:], ik, iw[:, first:], idx, valid, head_probs,
                       self.dsa.query_chunk, tp_group, fused, triton)
        return out, kl

    def _track(self, kl: torch.Tensor) -> None:
        cfg = self.config
        save_to_aux_losses_tracker(
            KL_TRACKER, kl.detach(), self.tracker_slot, cfg.num_layers + (cfg.mtp_num_layers or 0),
            avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
