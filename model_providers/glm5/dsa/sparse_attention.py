"""Sparse MLA in its absorbed (MQA) form: each query attends to its own top-k keys, and every
selected key is one shared latent row (kv_lora_rank + rope dims, 576 for GLM-5) used by all
heads. Compute and memory grow as O(L * k): queries are processed in small chunks whose selected
latent rows are gathered into a reused buffer (a few MiB, cache-resident), and the backward
recomputes the probabilities from the saved log-sum-exp (nothing of size L x k x heads is kept).

Shapes (batch-first): q [b, s, n, D] (absorbed queries, D = latent + rope), kv [b, L, D]
(latent rows; the first ``dv`` dims are also the values), idx [b, s, k] int64 key positions,
valid [b, s, k] bool. Output o [b, s, n, dv] in the latent space (the caller applies W_UV).
"""

from __future__ import annotations

import torch

#: bytes of gathered latent rows per chunk; small enough to stay in cache between the GEMMs
GATHER_BUDGET = 24 * 2**20


def _chunk_size(k: int, dim: int, itemsize: int, requested: int) -> int:
    return max(1, min(requested, GATHER_BUDGET // (k * dim * itemsize)))


class SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, valid, scale: float, dv: int, chunk: int):
        b, s, n, dim = q.shape
        k = idx.shape[-1]
        c = _chunk_size(k, dim, kv.element_size(), chunk)
        out = q.new_empty(b, s, n, dv)
        lse = q.new_empty(b, s, n)
        head_probs = q.new_empty(b, s, k)  # attention summed over heads (the KL target)
        buf = kv.new_empty(c * k, dim)
        neg_inf = torch.tensor(float("-inf"), dtype=q.dtype)
        for bi in range(b):
            for lo in range(0, s, c):
                hi = min(lo + c, s)
                m = hi - lo
                sel = torch.index_select(kv[bi], 0, idx[bi, lo:hi].reshape(-1), out=buf[: m * k])
                sel = sel.view(m, k, dim)
                scores = torch.bmm(q[bi, lo:hi], sel.transpose(1, 2)).mul_(scale)  # [m, n, k]
                scores = torch.where(valid[bi, lo:hi, None, :], scores, neg_inf)
                row_lse = scores.logsumexp(dim=-1, keepdim=True)
                p = scores.sub_(row_lse).exp_()
                torch.bmm(p, sel[..., :dv], out=out[bi, lo:hi])
                lse[bi, lo:hi] = row_lse.squeeze(-1)
                torch.sum(p, dim=1, out=head_probs[bi, lo:hi])
        ctx.save_for_backward(q, kv, idx, valid, out, lse)
        ctx.scale, ctx.dv, ctx.chunk = scale, dv, c
        ctx.mark_non_differentiable(head_probs)
        return out, head_probs

    @staticmethod
    def backward(ctx, grad_out, _grad_head_probs):
        q, kv, idx, valid, out, lse = ctx.saved_tensors
        scale, dv, c = ctx.scale, ctx.dv, ctx.chunk
        b, s, n, dim = q.shape
        k = idx.shape[-1]
        grad_q = torch.empty_like(q)
        grad_kv = torch.zeros_like(kv)
        delta = (grad_out * out).sum(dim=-1)  # [b, s, n]
        buf = kv.new_empty(c * k, dim)
        grad_sel = kv.new_empty(c, k, dim)
        zero = torch.tensor(0.0, dtype=q.dtype)
        for bi in range(b):
            for lo in range(0, s, c):
                hi = min(lo + c, s)
                m = hi - lo
                flat = idx[bi, lo:hi].reshape(-1)
                sel = torch.index_select(kv[bi], 0, flat, out=buf[: m * k]).view(m, k, dim)
                qc, go = q[bi, lo:hi], grad_out[bi, lo:hi]
                p = torch.bmm(qc, sel.transpose(1, 2)).mul_(scale)
                p = p.sub_(lse[bi, lo:hi, :, None]).exp_()
                p = torch.where(valid[bi, lo:hi, None, :], p, zero)  # [m, n, k]
                ds = torch.bmm(go, sel[..., :dv].transpose(1, 2))  # dP
                ds.sub_(delta[bi, lo:hi, :, None]).mul_(p).mul_(scale)
                torch.bmm(ds, sel, out=grad_q[bi, lo:hi])
                g = grad_sel[:m]
                torch.bmm(ds.transpose(1, 2), qc, out=g)
                g[..., :dv].baddbmm_(p.transpose(1, 2), go)
                grad_kv[bi].index_add_(0, flat, g.view(m * k, dim))
        return grad_q, grad_kv, None, None, None, None, None


def sparse_latent_attention(q, kv, idx, valid, scale: float, dv: int, chunk: int = 64):
    """Returns (o [b, s, n, dv], attention probabilities summed over heads [b, s, k])."""
    return SparseLatentAttention.apply(q, kv, idx, valid, scale, dv, chunk)
