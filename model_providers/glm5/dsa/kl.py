"""The indexer's training signal: KL(target || softmax(I)), where the target is the main
attention distribution summed over heads and L1-normalised (all-reduced over the TP group, whose
ranks hold different heads). Dense form: over all causal keys (DSA warm-up). Sparse form: over
each query's selected keys (sparse training). Computed per query chunk under activation
checkpointing, so memory stays O(chunk * L) (dense) or O(chunk * k) (sparse)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model_providers.glm5.dsa.indexer import causal_mask, index_logits


def _kl_rows(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum over rows of KL(target_row || softmax(logits_row)); target rows sum to 1."""
    logq = F.log_softmax(logits, dim=-1)
    terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - logq), 0.0)
    return terms.sum()


@torch.no_grad()
def dense_attention_target(query_sbnd, key_sbnd, scale: float, lo: int, hi: int, tp_group=None,
                           layout=None):
    """Head-summed, normalised attention probabilities of query rows lo..hi-1 over the keys
    they see (``layout``: :class:`~.layout.TokenLayout`; None = causal): [b, c, L]."""
    q = query_sbnd[lo:hi].permute(1, 2, 0, 3).float()  # [b, n, c, D]
    k = key_sbnd.permute(1, 2, 3, 0).float()  # [b, n, D, L]
    scores = torch.matmul(q, k) * scale
    hidden = (causal_mask(lo, hi - lo, key_sbnd.shape[0], q.device) if layout is None
              else layout.hidden(lo, hi)[:, None])
    scores.masked_fill_(hidden, float("-inf"))
    probs = scores.softmax(dim=-1).sum(dim=1)  # [b, c, L]
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(probs, group=tp_group)
    return probs / probs.sum(dim=-1, keepdim=True)


def dense_kl(iq, ik, iw, query_sbnd, key_sbnd, scale: float, chunk: int, tp_group=None,
             layout=None):
    """Mean over the first ``iq.shape[1]`` queries of the dense-form KL (keys: all the query
    sees, per ``layout``; None = all causal).
    iq/ik/iw: indexer projections (with grad). The logits here are fp32 (differentiable); the
    quantised indexer dtypes serve selection."""
    b, s = iq.shape[:2]
    total = iq.new_zeros((), dtype=torch.float32)

    def chunk_kl(q_c, w_c, k_all, target, lo, hidden):
        return _kl_rows(target, index_logits(q_c, k_all, w_c, lo, hidden=hidden))

    for lo in range(0, s, chunk):
        hi = min(lo + chunk, s)
        target = dense_attention_target(query_sbnd, key_sbnd, scale, lo, hi, tp_group, layout)
        hidden = None if layout is None else layout.hidden(lo, hi)
        total = total + checkpoint(chunk_kl, iq[:, lo:hi], iw[:, lo:hi], ik, target, lo, hidden,
                                   use_reentrant=False)
    return total / (b * s)


def sparse_index_logits(q_c, k_all, w_c, idx_c, valid_c):
    """Indexer scores at the selected keys only: [b, c, k] (-inf where invalid)."""
    b, c, h, d = q_c.shape
    kk = idx_c.shape[-1]
    k_sel = torch.stack([k_all[bi].index_select(0, idx_c[bi].reshape(-1)).view(c, kk, d)
                         for bi in range(b)])  # [b, c, k, d]
    per_head = torch.matmul(q_c.float(), k_sel.float().transpose(-1, -2))  # [b, c, H, k]
    logits = (F.relu(per_head) * w_c.float()[..., None]).sum(dim=2)
    return logits.masked_fill(~valid_c, float("-inf")).view(b, c, kk)


def sparse_kl(iq, ik, iw, idx, valid, head_probs, chunk: int, tp_group=None):
    """Mean over the queries of ``iq``/``iw``/``idx`` of the sparse-form KL over each query's
    selected keys (``ik`` holds every key)."""
    b, s = iq.shape[:2]
    target = head_probs.detach().float().masked_fill(~valid, 0.0)
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(target, group=tp_group)
    target = target / target.sum(dim=-1, keepdim=True)
    total = iq.new_zeros((), dtype=torch.float32)

    def chunk_kl(q_c, w_c, k_all, idx_c, valid_c, target_c):
        return _kl_rows(target_c, sparse_index_logits(q_c, k_all, w_c, idx_c, valid_c))

    for lo in range(0, s, chunk):
        hi = min(lo + chunk, s)
        total = total + checkpoint(chunk_kl, iq[:, lo:hi], iw[:, lo:hi], ik, idx[:, lo:hi],
                                   valid[:, lo:hi], target[:, lo:hi], use_reentrant=False)
    return total / (b * s)
