"""The lightning indexer, as GLM-5 defines it (HF ``GlmMoeDsaIndexer``):

    q = wq_b(q_latent)            per head [H, d]; q_latent is MLA's q after q_a_layernorm
    k = LayerNorm(wk(x))          one key per token [d] (LayerNorm with bias, eps 1e-6)
    RoPE on the first qk_rope_head_dim dims of q and k (interleaved for GLM-5), with MLA's
    frequencies and cos/sin scale (plain, or YaRN when megatron's ``rope_type`` is yarn)
    optionally a Walsh-Hadamard rotation of q and k (DeepSeek-V3.2; off for GLM-5)
    w = weights_proj(x) * H^-0.5 * d^-0.5
    I(t, s) = sum_h w(t, h) * ReLU(q(t, h) . k(s)),   s <= t

Scores are computed one query chunk at a time, so memory is O(chunk * L), never O(L^2).
The indexer's parameters are replicated across TP ranks; its inputs are detached (it learns
only from the KL loss, and the KL never reaches the main model).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from model_providers.glm5.model.config import YarnConfig
from model_providers.glm5.model.dsa.hadamard import hadamard_rotate
from model_providers.glm5.model.dsa.visibility import TokenLayout
from model_providers.glm5.model.dsa.rope import apply_rope, rope_cos_sin
from model_providers.glm5.model.dsa.topk import topk_indices


class LightningIndexer(MegatronModule):
    def __init__(self, config, dsa):
        super().__init__(config=config)
        self.heads = dsa.index_heads
        self.head_dim = dsa.index_head_dim
        self.rope_dim = config.qk_pos_emb_head_dim
        self.rope_theta = config.rotary_base
        self.yarn = mla_yarn(config)
        self.interleaved = dsa.rope_interleaved
        self.hadamard = dsa.hadamard
        dt = config.params_dtype
        self.wq_b = torch.nn.Linear(config.q_lora_rank, self.heads * self.head_dim, bias=False, dtype=dt)
        self.wk = torch.nn.Linear(config.hidden_size, self.head_dim, bias=False, dtype=dt)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dt)
        self.weights_proj = torch.nn.Linear(config.hidden_size, self.heads, bias=False, dtype=dt)
        if config.perform_initialization:
            for lin in (self.wq_b, self.wk, self.weights_proj):
                config.init_method(lin.weight)

    def project(self, x_bsh: torch.Tensor, q_latent_bsq: torch.Tensor, positions: torch.Tensor):
        """q [b, s, H, d], k [b, s, d], w [b, s, H] (fp32, scales folded in)."""
        b, s, _ = x_bsh.shape
        q = self.wq_b(q_latent_bsq).view(b, s, self.heads, self.head_dim)
        k = self.k_norm(self.wk(x_bsh))
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.rope_theta, q.dtype, self.yarn)  # [b, s, r/2]
        r = self.rope_dim
        q = torch.cat([apply_rope(q[..., :r], cos[:, :, None], sin[:, :, None], self.interleaved),
                       q[..., r:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin, self.interleaved), k[..., r:]], dim=-1)
        if self.hadamard:
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        w = self.weights_proj(x_bsh).float() * (self.heads ** -0.5 * self.head_dim ** -0.5)
        return q, k, w


def mla_yarn(config) -> YarnConfig | None:
    """The YaRN settings of megatron's MLA rotary (None for plain RoPE)."""
    if getattr(config, "rope_type", "rope") != "yarn":
        return None
    return YarnConfig(factor=config.rotary_scaling_factor,
                      original_max_position_embeddings=config.original_max_position_embeddings,
                      beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                      mscale_all_dim=config.mscale_all_dim)


KEY_BLOCK = 1024  #: keys scored per GEMM in `index_logits` (fp32)


def index_logits(q, k, w, q_offset: int, dtype: str = "fp32", hidden=None, out=None) -> torch.Tensor:
    """Indexer scores of a query chunk: q [b, c, H, d] (queries q_offset..q_offset+c-1),
    k [b, L, d], w [b, c, H] -> [b, c, L] fp32, -inf where the key is hidden: in the future, or
    where ``hidden`` ([b or 1, c, L] bool, from :class:`~.layout.TokenLayout`) says so;
    ``hidden=False``: nothing is masked (the caller masks). ``out``: fp32 storage of at least
    b * c * L elements for the fp32 scores with ``hidden=False`` (a caller scoring chunk after
    chunk reuses it: a fresh [b, c, L] per chunk is page faults at long context)."""
    if dtype != "fp32":
        from model_providers.glm5.model.dsa.fp8 import index_logits as quantised_index_logits

        logits = quantised_index_logits(q, k, w, q_offset, dtype=dtype, causal=hidden is None)
        return logits if hidden is None or hidden is False else logits.masked_fill(hidden, float("-inf"))
    b, c, h, d = q.shape
    length = k.shape[1]
    q_rows, w_rows = q.float().reshape(b, c * h, d), w.float().reshape(b * c, 1, h)
    # key blocks: each block's per-head scores [b, c*H, block] stay cache-resident between the
    # GEMM, the ReLU and the weighted head sum (unblocked, they stream through memory 4 times)
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, w))
    if out is not None and hidden is False and not differentiable:
        logits = out.view(-1)[:b * c * length].view(b, c, length)
    else:
        logits = torch.empty(b, c, length, dtype=torch.float32, device=q.device)
    per_head = None if differentiable else q_rows.new_empty(b, c * h, min(length, KEY_BLOCK))
    for lo in range(0, length, KEY_BLOCK):
        hi = min(lo + KEY_BLOCK, length)
        block = torch.bmm(q_rows, k[:, lo:hi].float().transpose(1, 2),
                          out=None if per_head is None else per_head[:, :, :hi - lo])
        summed = torch.bmm(w_rows, block.relu_().view(b * c, h, hi - lo))
        logits[:, :, lo:hi] = summed.view(b, c, hi - lo)
    if hidden is False:
        return logits
    if hidden is None:
        hidden = causal_mask(q_offset, c, k.shape[1], q.device)
    return logits.masked_fill(hidden, float("-inf"))


def causal_mask(q_offset: int, c: int, length: int, device) -> torch.Tensor:
    """[c, L] True where key position > query position."""
    qpos = torch.arange(q_offset, q_offset + c, device=device)[:, None]
    return torch.arange(length, device=device)[None, :] > qpos


@torch.no_grad()
def select_topk(q, k, w, topk: int, chunk: int, dtype: str = "fp32", first: int = 0, layout=None,
                triton: bool = False, fused: bool = False):
    """Deterministic top-k keys for query rows ``first .. first + q.shape[1] - 1``: idx
    [b, s, k'] int64 and valid [b, s, k'] (k' = min(topk, L); invalid entries are keys the
    query may not see, picked only because it sees fewer than k' keys). ``layout``
    (:class:`~.layout.TokenLayout`) gives the rows' global positions and documents; None means
    positions = row numbers, one document.

    Causal-aware: a chunk of rows is scored only against the keys its last row can see (at
    least k' of them, so the picks are those of the full row: the hidden keys rank -inf, lowest
    position first). fp8 keys are quantised once for all chunks. ``triton``: bf16/fp8 logits
    from the Triton kernel (:func:`~.kernels.index_logits_triton`; fp32 stays torch); ``fused``:
    the top-k from the fused CPU kernel."""
    b, s = q.shape[:2]
    length = k.shape[1]
    kk = min(topk, length)
    if layout is None:
        layout = TokenLayout.build(first + s, length, device=q.device)
    if triton and dtype != "fp32":
        from model_providers.glm5.model.dsa.fp8 import quantize_fp8
        from model_providers.glm5.model.dsa.kernels import index_logits_triton

        keys, scales = quantize_fp8(k, pow2_scales=True) if dtype == "fp8" else (k, None)

        def score(q_c, w_c, n, lo):
            positions = layout.q_pos[first + lo:first + lo + q_c.shape[1]]
            return index_logits_triton(q_c, keys[:, :n], w_c, positions, dtype,
                                       k_scale=None if scales is None else scales[:, :n])
    elif dtype == "fp8":
        from model_providers.glm5.model.dsa.fp8 import fp8_logits_quantised_keys, quantize_fp8

        k8, ks = quantize_fp8(k, pow2_scales=True)

        def score(q_c, w_c, n, lo):
            return fp8_logits_quantised_keys(q_c, k8[:, :n], ks[:, :n], w_c, causal=False)
    else:
        scores_buf = torch.empty(b * min(chunk, s) * length, dtype=torch.float32, device=q.device)

        def score(q_c, w_c, n, lo):
            return index_logits(q_c, k[:, :n], w_c, 0, dtype, hidden=False, out=scores_buf)
    idx = torch.empty(b, s, kk, dtype=torch.int64, device=q.device)
    for lo in range(0, s, chunk):
        hi = min(lo + chunk, s)
        n = min(length, max(kk, layout.keys_seen(first + lo, first + hi)))
        logits = score(q[:, lo:hi], w[:, lo:hi], n, lo)
        logits.masked_fill_(layout.hidden(first + lo, first + hi, n), float("-inf"))
        idx[:, lo:hi] = topk_indices(logits, kk, fused)
    return idx, layout.valid(idx, first)
