"""Sparse MLA in its absorbed (MQA) form: each query attends to its own top-k keys, and every
selected key is one shared latent row (kv_lora_rank + rope dims, 576 for GLM-5) used by all
heads. Compute and memory grow as O(L * k): queries are processed in small chunks whose selected
latent rows are gathered into a reused buffer (a few MiB, cache-resident), and the backward
recomputes the probabilities from the saved log-sum-exp (nothing of size L x k x heads is kept).

Precision: bf16/fp16 inputs are computed in fp32 (the gathered rows and each chunk of queries are
upcast, so scores, log-sum-exp, probabilities, delta, every GEMM and the dkv sums are fp32) and
only o, dq and dkv are rounded to the input dtype, once: their error is that rounding's (~1.7e-3
relative), where bf16 statistics and a bf16 dkv sum cost ~1e-2. lse and head_probs stay fp32.

Determinism: dkv is accumulated in an fp32 [L, D] buffer one query at a time. A query's k key
positions are distinct (they come from top-k), so each step gathers those k rows, adds the
query's contribution and writes them back with no key touched twice: every key's sum is taken
in query order on any device (``index_add_`` on CUDA adds with atomics, in whatever order they
land). The price is a few small kernels per query, which a fused GPU kernel would remove.

Shapes (batch-first): q [b, s, n, D] (absorbed queries, D = latent + rope), kv [b, L, D]
(latent rows; the first ``dv`` dims are also the values), idx [b, s, k] int64 key positions,
distinct within each query, valid [b, s, k] bool. Output o [b, s, n, dv] in the latent space
(the caller applies W_UV).
"""

from __future__ import annotations

import torch

#: bytes of gathered latent rows per chunk; small enough to stay in cache between the GEMMs
GATHER_BUDGET = 24 * 2**20


def _chunk_size(k: int, dim: int, itemsize: int, requested: int) -> int:
    return max(1, min(requested, GATHER_BUDGET // (k * dim * itemsize)))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _Gather:
    """Selected kv rows in the compute dtype, gathered into a reused [c * k, D] buffer; bf16/fp16
    rows pass through a second buffer in kv's dtype and are upcast one chunk at a time (an fp32
    copy of the whole kv would cost L x D x 4 bytes)."""

    def __init__(self, kv: torch.Tensor, rows: int, dtype: torch.dtype):
        self.buf = kv.new_empty(rows, kv.shape[-1], dtype=dtype)
        self.raw = None if kv.dtype == dtype else kv.new_empty(rows, kv.shape[-1])

    def __call__(self, kv_ld: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        rows = flat.numel()
        if self.raw is None:
            return torch.index_select(kv_ld, 0, flat, out=self.buf[:rows])
        return self.buf[:rows].copy_(torch.index_select(kv_ld, 0, flat, out=self.raw[:rows]))


class SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, valid, scale: float, dv: int, chunk: int):
        b, s, n, dim = q.shape
        k = idx.shape[-1]
        acc = _compute_dtype(q.dtype)
        c = _chunk_size(k, dim, acc.itemsize, chunk)
        out = q.new_empty(b, s, n, dv)
        lse = q.new_empty(b, s, n, dtype=acc)
        head_probs = q.new_empty(b, s, k, dtype=acc)  # attention summed over heads (the KL target)
        gather = _Gather(kv, c * k, acc)
        hidden = ~valid
        for bi in range(b):
            for lo in range(0, s, c):
                hi = min(lo + c, s)
                m = hi - lo
                sel = gather(kv[bi], idx[bi, lo:hi].reshape(-1)).view(m, k, dim)
                scores = torch.bmm(q[bi, lo:hi].to(acc), sel.transpose(1, 2)).mul_(scale)
                scores.masked_fill_(hidden[bi, lo:hi, None, :], float("-inf"))  # [m, n, k]
                row_lse = scores.logsumexp(dim=-1, keepdim=True)
                p = scores.sub_(row_lse).exp_()
                out[bi, lo:hi] = torch.bmm(p, sel[..., :dv])
                lse[bi, lo:hi] = row_lse.squeeze(-1)
                torch.sum(p, dim=1, out=head_probs[bi, lo:hi])
        ctx.save_for_backward(q, kv, idx, valid, lse)
        ctx.scale, ctx.dv, ctx.chunk = scale, dv, c
        ctx.mark_non_differentiable(head_probs)
        return out, head_probs

    @staticmethod
    def backward(ctx, grad_out, _grad_head_probs):
        q, kv, idx, valid, lse = ctx.saved_tensors
        scale, dv, c = ctx.scale, ctx.dv, ctx.chunk
        b, s, n, dim = q.shape
        k = idx.shape[-1]
        acc = _compute_dtype(q.dtype)
        grad_q = torch.empty_like(q)
        grad_kv = torch.zeros_like(kv, dtype=acc)
        gather = _Gather(kv, c * k, acc)
        rows = kv.new_empty(k, dim, dtype=acc)
        hidden = ~valid
        for bi in range(b):
            for lo in range(0, s, c):
                hi = min(lo + c, s)
                m = hi - lo
                sel = gather(kv[bi], idx[bi, lo:hi].reshape(-1)).view(m, k, dim)
                qc, go = q[bi, lo:hi].to(acc), grad_out[bi, lo:hi].to(acc)
                p = torch.bmm(qc, sel.transpose(1, 2)).mul_(scale)
                p = p.sub_(lse[bi, lo:hi, :, None]).exp_()
                p.masked_fill_(hidden[bi, lo:hi, None, :], 0.0)  # [m, n, k]
                ds = torch.bmm(go, sel[..., :dv].transpose(1, 2))  # dP
                delta = (ds * p).sum(dim=-1, keepdim=True)  # rowsum(dO * O), O unrounded
                ds.sub_(delta).mul_(p).mul_(scale)
                grad_q[bi, lo:hi] = torch.bmm(ds, sel)
                for r in range(m):
                    key = idx[bi, lo + r]
                    torch.index_select(grad_kv[bi], 0, key, out=rows)
                    rows.addmm_(ds[r].T, qc[r])
                    rows[:, :dv].addmm_(p[r].T, go[r])
                    grad_kv[bi].index_copy_(0, key, rows)
        return grad_q, grad_kv.to(kv.dtype), None, None, None, None, None


def sparse_latent_attention(q, kv, idx, valid, scale: float, dv: int, chunk: int = 64):
    """Returns (o [b, s, n, dv] in q's dtype, attention probabilities summed over heads [b, s, k]
    in fp32 (fp64 for fp64 inputs))."""
    return SparseLatentAttention.apply(q, kv, idx, valid, scale, dv, chunk)
