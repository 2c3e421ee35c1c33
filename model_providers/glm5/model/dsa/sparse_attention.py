"""Sparse MLA in its absorbed (MQA) form: each query attends to its own top-k keys, and every
selected key is one shared latent row (kv_lora_rank + rope dims, 576 for GLM-5) used by all
heads. Compute and memory grow as O(L * k): queries are processed in small chunks whose selected
latent rows are gathered into a reused buffer (a few MiB, cache-resident), and the backward
recomputes the probabilities from the saved log-sum-exp (nothing of size L x k x heads is kept).

Precision: bf16/fp16 inputs are computed in fp32 (the gathered rows and each chunk of queries are
upcast, so scores, log-sum-exp, probabilities, delta, every GEMM and the dkv sums are fp32) and
only o, dq and dkv are rounded to the input dtype, once: their error is that rounding's (~1.7e-3
relative), where bf16 statistics and a bf16 dkv sum cost ~1e-2. lse and head_probs stay fp32.

Determinism: dkv is accumulated in an fp32 [L, D] buffer in query order, one call per chunk
of queries (`scatter_add_rows`: sequential ``index_add_`` on the CPU, the sort-based
``index_put_(accumulate=True)`` on CUDA, both adding each key's rows in query order).

Shapes (batch-first): q [b, s, n, D] (absorbed queries, D = latent + rope), kv [b, L, D]
(latent rows; the first ``dv`` dims are also the values), idx [b, s, k] int64 key positions,
distinct within each query, valid [b, s, k] bool. Output o [b, s, n, dv] in the latent space
(the caller applies W_UV).
"""

from __future__ import annotations

import torch

#: bytes of gathered latent rows per chunk; small enough to stay in cache between the GEMMs
GATHER_BUDGET = 10 * 2**20


def rows_per_chunk(k: int, dim: int, itemsize: int, requested: int) -> int:
    """Queries per chunk: at most ``requested``, and their gathered rows within the budget."""
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
        c = rows_per_chunk(k, dim, acc.itemsize, chunk)
        out = q.new_empty(b, s, n, dv)
        lse = q.new_empty(b, s, n, dtype=acc)
        head_probs = q.new_empty(b, s, k, dtype=acc)  # attention summed over heads (the KL target)
        gather = _Gather(kv, c * k, acc)
        hidden = None if all_visible(valid) else ~valid
        # reused buffers: a fresh allocation of this size is fresh pages (page faults) every time
        q_scaled = q.new_empty(c, n, dim, dtype=acc)  # the softmax scale goes on q, not the scores
        scores_buf = q.new_empty(c, n, k, dtype=acc)
        o_buf = None if out.dtype == acc else q.new_empty(c, n, dv, dtype=acc)
        for bi in range(b):
            for lo in range(0, s, c):
                hi = min(lo + c, s)
                m = hi - lo
                sel = gather(kv[bi], idx[bi, lo:hi].reshape(-1)).view(m, k, dim)
                qc = q_scaled[:m].copy_(q[bi, lo:hi]).mul_(scale)  # upcast first, then scale
                scores = torch.bmm(qc, sel.transpose(1, 2), out=scores_buf[:m])  # [m, n, k]
                if hidden is not None:
                    scores.masked_fill_(hidden[bi, lo:hi, None, :], float("-inf"))
                row_max = scores.amax(dim=-1, keepdim=True)
                p = scores.sub_(row_max).exp_()
                row_sum = p.sum(dim=-1, keepdim=True)
                p.div_(row_sum)
                if o_buf is None:
                    torch.bmm(p, sel[..., :dv], out=out[bi, lo:hi])
                else:
                    out[bi, lo:hi] = torch.bmm(p, sel[..., :dv], out=o_buf[:m])
                lse[bi, lo:hi] = (row_max + row_sum.log()).squeeze(-1)
                torch.sum(p, dim=1, out=head_probs[bi, lo:hi])
        ctx.save_for_backward(q, kv, idx, valid, lse)
        ctx.scale, ctx.dv, ctx.chunk = scale, dv, c
        ctx.mark_non_differentiable(head_probs)
        ctx.set_materialize_grads(False)  # no zero-filled [b, s, k] gradient for head_probs
        return out, head_probs

    @staticmethod
    def backward(ctx, grad_out, _grad_head_probs):
        if grad_out is None:
            return (None,) * 7
        q, kv, idx, valid, lse = ctx.saved_tensors
        scale, dv, c = ctx.scale, ctx.dv, ctx.chunk
        b, s, n, dim = q.shape
        k = idx.shape[-1]
        acc = _compute_dtype(q.dtype)
        grad_q = torch.empty_like(q)
        grad_kv = torch.zeros_like(kv, dtype=acc)
        gather = _Gather(kv, c * k, acc)
        # Two left operands of 2n rows each, so every GEMM has M = 2n (heads are few): rows
        # [dO | 0 ; q] give dP and the scores in one GEMM with the gathered rows; rows
        # [q ; dO | 0] against [dS ; P] give the kv gradient's two terms in one GEMM.
        do_q = q.new_zeros(c, 2 * n, dim, dtype=acc)
        q_do = q.new_zeros(c, 2 * n, dim, dtype=acc)
        dp_s_buf = q.new_empty(c, 2 * n, k, dtype=acc)
        product = q.new_empty(c, n, k, dtype=acc)
        dq_buf = q.new_empty(c, n, dim, dtype=acc)
        contribution_buf = q.new_empty(c, k, dim, dtype=acc)
        hidden = None if all_visible(valid) else ~valid
        for bi in range(b):
            for lo in range(0, s, c):
                hi = min(lo + c, s)
                m = hi - lo
                sel = gather(kv[bi], idx[bi, lo:hi].reshape(-1)).view(m, k, dim)
                do_q[:m, :n, :dv] = grad_out[bi, lo:hi]
                do_q[:m, n:].copy_(q[bi, lo:hi]).mul_(scale)
                q_do[:m, :n] = do_q[:m, n:]
                q_do[:m, n:, :dv] = do_q[:m, :n, :dv]
                dp_s = torch.bmm(do_q[:m], sel.transpose(1, 2), out=dp_s_buf[:m])  # dP ; S
                p = dp_s[:, n:].sub_(lse[bi, lo:hi, :, None]).exp_()
                if hidden is not None:
                    p.masked_fill_(hidden[bi, lo:hi, None, :], 0.0)
                ds = dp_s[:, :n]
                delta = torch.mul(ds, p, out=product[:m]).sum(dim=-1, keepdim=True)  # rowsum(dO*O)
                ds.sub_(delta).mul_(p)  # dS / scale: the scale is on q (dkv) and on dq below
                grad_q[bi, lo:hi] = torch.bmm(ds, sel, out=dq_buf[:m]).mul_(scale)
                contribution = torch.bmm(dp_s.transpose(1, 2), q_do[:m], out=contribution_buf[:m])
                scatter_add_rows(grad_kv[bi], idx[bi, lo:hi], contribution)  # [m, k, dim]
        return grad_q, grad_kv.to(kv.dtype), None, None, None, None, None


def all_visible(valid: torch.Tensor) -> bool:
    """Every selected key visible (no mask to apply); asked on the CPU only (a device sync)."""
    return not valid.is_cuda and bool(valid.all())


def scatter_add_rows(dest: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """dest[idx[r, j]] += rows[r, j] for r in order: every destination row's sum is taken in
    the same order on any device, in one call. dest [L, D], idx [m, k], rows [m, k, D].
    On the CPU ``index_add_`` adds sequentially. On CUDA ``index_add_`` adds with atomics (an
    order that changes from run to run), while ``index_put_(accumulate=True)`` stable-sorts
    the destinations and adds each one's rows in their original order, starting from its
    current value: the CPU's order, bit for bit."""
    flat_idx, flat_rows = idx.reshape(-1), rows.reshape(-1, rows.shape[-1])
    if dest.is_cuda:
        dest.index_put_((flat_idx,), flat_rows, accumulate=True)
    else:
        dest.index_add_(0, flat_idx, flat_rows)


def sparse_latent_attention(q, kv, idx, valid, scale: float, dv: int, chunk: int = 64):
    """Returns (o [b, s, n, dv] in q's dtype, attention probabilities summed over heads [b, s, k]
    in fp32 (fp64 for fp64 inputs))."""
    return SparseLatentAttention.apply(q, kv, idx, valid, scale, dv, chunk)
