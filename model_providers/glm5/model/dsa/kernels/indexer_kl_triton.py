"""Triton kernel for the indexer's sparse KL (``kl.sparse_kl``) with its gradients.

Per query t over its k selected keys j (idx [b, s, k], distinct; valid [b, s, k] or None):

    per_head[h, j] = q[t, h] . k[idx[t, j]]              (q [b, s, H, d], keys [b, L, d])
    z[j] = sum_h w[t, h] relu(per_head[h, j])             (-inf where not valid)
    KL_t = sum_j t_j log t_j - t_j log_softmax(z)_j       (target [b, s, k], 0 at hidden keys)
    d z = softmax(z) - target;  dw[h] = sum_j relu[h, j] dz[j]
    d per_head = [per_head > 0] w[h] dz[j];  dq = d per_head . K_sel;  dk[idx[j]] += d per_head^T . q

The same contract as the fused CPU kernel (``dsa_cpu.cpp`` ``sparse_kl``): returns (sum over the
queries of KL_t as an fp32 scalar tensor, dq [b, s, H, d], dk [b, L, d], dw [b, s, H]), all fp32;
``kl.sparse_kl`` divides by the number of queries. Rows with no valid key contribute 0 to the value
and to every gradient (the torch path's target is 0/0 there).

One launch per chunk of queries, one program per (query, batch). The heads are the GEMM M dim
(padded to a power of two >= 16), the query's selected key rows are gathered BLOCK_N at a time.
Two sweeps over the keys: the first takes the log-softmax's max and sum (online, fp32), the
second recomputes the scores and gives the KL terms, dw, dq (accumulated transposed, dq^T =
K_sel^T dph^T) and the key gradient's per-(query, key) rows, d per_head^T . q. Those rows go to a
partial buffer at rows placed by a stable sort of the (key, query) pairs, and the reduction the
sparse MLA shares (:mod:`.ordered_rows`) adds each key's run to the fp32 dk in query order: no
atomics, bitwise reproducible, the order of the torch path's ``index_put_(accumulate=True)``.
Queries run in chunks whose partials fit ``PARTIAL_BUDGET`` bytes (GLM-5, k = 2048 x d = 128:
1 MiB per query, ~1000 queries per chunk), so a layer's KL is a few launches per chunk instead of
the torch path's Python loop of ~15 ops per ten queries. Without gradients it is one launch and
no partials. No host syncs: the chunking depends on shapes only.

Precision: every GEMM accumulates in fp32, the softmax statistics and KL terms are fp32, the
per-row KL values are summed in fp64 (as the CPU kernel does). fp32 q/k use IEEE fp32 dots (no
TF32): the torch path's math to ~1e-6. bf16/fp16 q/k (the model's dtype on GPUs) enter the score
GEMM as they are (their products are exact in fp32, so the scores are the fp32 path's up to
summation order); the two gradient GEMMs multiply them by the fp32 d per_head, which enters as
hi + lo parts in the input dtype (two tensor-core GEMMs, ~16 bits kept: ``_dot_fp32_right`` of
:mod:`.sparse_mla_triton`), so dq and dk are fp32 math to ~2^-16.

Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this module was
first imported (the Triton interpreter; for bf16 see the note in :mod:`.sparse_mla_triton`).
"""

from __future__ import annotations

import torch

from .indexer_fp8_triton import HAVE_TRITON
from .ordered_rows import add_rows_in_order, pair_order
from .sparse_mla_triton import _pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .sparse_mla_triton import _dot_fp32_right

PARTIAL_BUDGET = 2**30  #: bytes of fp32 key-gradient partials per chunk of queries
#: selected keys per block, warps, pipeline stages. Not timed on a GPU yet.
KL_CONFIG = dict(block_n=32, num_warps=8, num_stages=2)
#: ptxas resource use at GLM-5 shapes compiled for sm_90a without a GPU (triton 3.9; ``python -m
#: benchmarks.kernel_resources`` prints them, tests/unit/model/test_kernel_resources.py holds these
#: numbers to the compiled kernels): registers per thread, spill stores and loads (bytes per
#: thread), shared memory (KiB; an H100/H200 block may use 227), at
#: GLM-5's indexer dims (32 heads x 128, k = 2048) with gradients and a valid mask: bf16 q/k (the
#: model's) and fp32 q/k.
RESOURCES = {
    "indexer KL bf16 (with gradients)": dict(registers=124, spill_stores=0, spill_loads=0, shared_kib=32.12),
    "indexer KL fp32 (with gradients)": dict(registers=255, spill_stores=260, spill_loads=264, shared_kib=48.12),
}


if HAVE_TRITON:

    @triton.jit
    def _gather_keys(k_ptr, idx_ptr, valid_ptr, n0, K, offs_d, D,
                     HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr):
        """The BLOCK_N selected key rows from slot n0 [BN, BD] and `ok` (in range and valid);
        the other rows load as zeros (their positions are not read)."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < K
        ok = n_ok
        if HAS_VALID:
            ok = n_ok & (tl.load(valid_ptr + offs_n, mask=n_ok, other=0) != 0)
        key = tl.load(idx_ptr + offs_n, mask=ok, other=0).to(tl.int64)
        rows = tl.load(k_ptr + key[:, None] * D + offs_d[None, :], mask=ok[:, None] & (offs_d < D)[None, :],
                       other=0.0)
        return offs_n, n_ok, ok, rows

    @triton.jit
    def _indexer_kl_kernel(
        q_ptr, k_ptr, w_ptr, idx_ptr, valid_ptr, t_ptr, kl_ptr, dq_ptr, dw_ptr, part_ptr, dest_ptr,
        T0, C, S, H, K, L, D,
        HAS_VALID: tl.constexpr, WANT_GRADS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # Query t = T0 + program_id(0) of the chunk [T0, T0 + C), batch program_id(1). q [B, S, H, D],
        # keys [B, L, D], w [B, S, H] fp32, idx/valid/target [B, S, K], kl [B, S] fp32, dq
        # [B, S, H, D] fp32, dw [B, S, H] fp32: contiguous. Partial rows are numbered
        # (b * C + t - T0) * K + slot and stored at part[dest[that]] ([rows, D] fp32).
        tc = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        row = b * S + T0 + tc
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(q_ptr + (row * H + offs_h)[:, None] * D + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + row * H + offs_h, mask=h_ok, other=0.0)
        k_b = k_ptr + b * L * D
        idx_r = idx_ptr + row * K
        valid_r = valid_ptr + row * K
        t_r = t_ptr + row * K

        # sweep 1: the log-softmax's max and sum over the valid keys (online)
        m = tl.full([], float("-inf"), tl.float32)
        l = tl.full([], 0.0, tl.float32)
        for n0 in range(0, K, BLOCK_N):
            offs_n, n_ok, ok, kr = _gather_keys(k_b, idx_r, valid_r, n0, K, offs_d, D, HAS_VALID, BLOCK_N)
            s = tl.dot(q, tl.trans(kr), input_precision=DOT_PREC)  # [BH, BN]
            z = tl.where(ok, tl.sum(w[:, None] * tl.maximum(s, 0.0), 0), float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp(m - m_use) + tl.sum(tl.exp(z - m_use), 0)
            m = m_new
        # a row without valid keys: m = -inf, l = 0; every term below is masked
        m_use = tl.where(m == float("-inf"), 0.0, m)
        log_l = tl.log(tl.where(l > 0.0, l, 1.0))

        # sweep 2: KL terms t log t - t log q (log q = (z - max) - log sum, as log_softmax forms
        # it) and, with gradients, dz = softmax - target through the ReLU
        kl = tl.zeros([BLOCK_N], tl.float32)
        dw = tl.zeros([BLOCK_H], tl.float32)
        dq_t = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
        dest_r = dest_ptr + (b * C + tc) * K
        for n0 in range(0, K, BLOCK_N):
            offs_n, n_ok, ok, kr = _gather_keys(k_b, idx_r, valid_r, n0, K, offs_d, D, HAS_VALID, BLOCK_N)
            s = tl.dot(q, tl.trans(kr), input_precision=DOT_PREC)
            relu = tl.maximum(s, 0.0)
            logq = (tl.sum(w[:, None] * relu, 0) - m_use) - log_l
            t = tl.load(t_r + offs_n, mask=ok, other=0.0)
            has_t = ok & (t > 0.0)
            kl += tl.where(has_t, t * tl.log(tl.where(has_t, t, 1.0)) - t * logq, 0.0)
            if WANT_GRADS:
                dz = tl.where(ok, tl.exp(logq) - t, 0.0)
                dw += tl.sum(relu * dz[None, :], 1)
                dph = tl.where(s > 0.0, w[:, None] * dz[None, :], 0.0)  # [BH, BN]
                dq_t = _dot_fp32_right(tl.trans(kr), tl.trans(dph), dq_t, DOT_PREC, SPLIT)
                dk_t = _dot_fp32_right(tl.trans(q), dph, tl.zeros([BLOCK_D, BLOCK_N], tl.float32),
                                       DOT_PREC, SPLIT)  # [BD, BN]: the key rows' gradients
                part = part_ptr + tl.load(dest_r + offs_n, mask=n_ok, other=0)[None, :] * D
                tl.store(part + offs_d[:, None], dk_t, mask=n_ok[None, :] & d_ok[:, None])
        tl.store(kl_ptr + row, tl.sum(kl, 0))
        if WANT_GRADS:
            tl.store(dw_ptr + row * H + offs_h, dw, mask=h_ok)
            tl.store(dq_ptr + (row * H + offs_h)[None, :] * D + offs_d[:, None], dq_t,
                     mask=h_ok[None, :] & d_ok[:, None])


def _interpreted() -> bool:
    """True when @triton.jit built the kernel for the CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_indexer_kl_kernel, InterpretedFunction)


def _check(q, k, w, idx, valid, target):
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: the indexer KL kernel needs CUDA and triton")
    if q.dim() != 4 or k.dim() != 3 or w.dim() != 3 or idx.dim() != 3:
        raise ValueError(f"expected q [b,s,H,d], keys [b,L,d], w [b,s,H], idx [b,s,k]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(w.shape)}, {tuple(idx.shape)}")
    b, s, heads, d = q.shape
    if (k.shape[0] != b or k.shape[2] != d or tuple(w.shape) != (b, s, heads) or idx.shape[:2] != (b, s)
            or target.shape != idx.shape or (valid is not None and valid.shape != idx.shape)):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, keys {tuple(k.shape)}, w {tuple(w.shape)}, "
                         f"idx {tuple(idx.shape)}, target {tuple(target.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q and keys must be fp32, bf16 or fp16, got {q.dtype}")
    if not q.is_cuda and not _interpreted():
        raise RuntimeError("the indexer KL Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 set "
                           "before model_providers.glm5.model.dsa.kernels is first imported (CPU interpreter)")


def sparse_kl_triton(iq, ik, iw, idx, valid, target, want_grads: bool, *, chunk: int | None = None,
                     partial_budget: int = PARTIAL_BUDGET, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None):
    """(sum over the queries of the sparse KL: fp32 scalar tensor, dq [b, s, H, d], dk [b, L, d],
    dw [b, s, H]: fp32, empty without ``want_grads``); the contract of the CPU kernel's
    ``sparse_kl`` (see the module docstring). iq [b, s, H, d] and ik [b, L, d] in fp32/bf16/fp16
    (one dtype; mixed ones compute in fp32), iw [b, s, H], idx [b, s, k] int64 (valid entries in
    [0, L): not checked, that would sync with the device), valid [b, s, k] bool or None (every
    key visible), target [b, s, k] (rows sum to 1, 0 at hidden keys; only valid entries are
    read). ``chunk``: queries per partial-buffer pass (default: as many as ``partial_budget``
    bytes of fp32 partials allow); block_n / num_warps / num_stages override KL_CONFIG."""
    _check(iq, ik, iw, idx, valid, target)
    if iq.dtype != ik.dtype:
        iq, ik = iq.float(), ik.float()
    q, k = iq.contiguous(), ik.contiguous()
    w = iw.float().contiguous()
    target = target.float().contiguous()
    idx = idx.contiguous()
    valid8 = None if valid is None else valid.contiguous().view(torch.uint8)
    b, s, heads, d = q.shape
    L, kk = k.shape[1], idx.shape[2]
    f32 = dict(dtype=torch.float32, device=q.device)
    kl_rows = torch.zeros(b, s, **f32)
    if want_grads:
        dq, dk, dw = torch.zeros(q.shape, **f32), torch.zeros(b, L, d, **f32), torch.zeros(w.shape, **f32)
    else:
        dq = dk = dw = torch.empty(0, **f32)
    if not (b and s and kk and heads and d):
        return kl_rows.sum(dtype=torch.float64).float(), dq, dk, dw
    fp32 = q.dtype == torch.float32
    cfg = KL_CONFIG
    meta = dict(HAS_VALID=valid is not None, WANT_GRADS=bool(want_grads), BLOCK_H=_pow2(heads),
                BLOCK_D=_pow2(d), BLOCK_N=block_n or cfg["block_n"], DOT_PREC="ieee" if fp32 else "tf32",
                SPLIT=not fp32, num_warps=num_warps or cfg["num_warps"],
                num_stages=num_stages or cfg["num_stages"])
    valid_arg = idx if valid8 is None else valid8  # not read without HAS_VALID
    if not want_grads:  # one launch, no partials
        _indexer_kl_kernel[(s, b)](q, k, w, idx, valid_arg, target, kl_rows, kl_rows, kl_rows, kl_rows, idx,
                                   0, s, s, heads, kk, L, d, **meta)
        return kl_rows.sum(dtype=torch.float64).float(), dq, dk, dw
    c = max(1, min(s, chunk or partial_budget // (b * kk * d * 4)))  # queries per chunk
    part = q.new_empty(b * c * kk, d, dtype=torch.float32)
    for t0 in range(0, s, c):
        cc = min(c, s - t0)
        keys_sorted, dest = pair_order(idx[:, t0:t0 + cc], None if valid is None else valid[:, t0:t0 + cc], L)
        _indexer_kl_kernel[(cc, b)](q, k, w, idx, valid_arg, target, kl_rows, dq, dw, part, dest,
                                    t0, cc, s, heads, kk, L, d, **meta)
        add_rows_in_order(keys_sorted, part, dk)
    return kl_rows.sum(dtype=torch.float64).float(), dq, dk, dw
