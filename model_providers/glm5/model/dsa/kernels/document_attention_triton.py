"""Triton flash attention for packed documents and context parallelism: the GPU path of
:func:`model_providers.glm5.model.dsa.dense_attention.dense_attention` where SDPA's ``is_causal``
does not apply.

Query row r (global position ``q_pos[r]``, ascending: 0..s-1, or a CP rank's two zigzag runs)
of sample b sees the keys ``first_key[b, r] <= j <= q_pos[r]``, where ``first_key`` is the first
key of its document (0 without documents). That is the reference's rule (causal, same document)
because a sample's documents are contiguous runs of keys, as the data pipeline numbers them
(``data_pipeline.packing``: ids 0, 1, ... in order, padding last). Both bounds ascend with r, so a
block of rows sees one key range [first_key of its first row, q_pos of its last row], and a block
of keys is seen by one range of rows: every loop below has bounds read from device tensors, no
mask is materialised, no document is scored against another, and nothing is synchronised with
the host.

Forward (flash attention 2): one program per (block of BLOCK_M query rows, batch x head), online
softmax over the block's key range in base 2, fp32 statistics; it writes o and the log-sum-exp.
Backward without atomics: delta = rowsum(dO * O) (one small kernel), then one program per (key
block, batch x head) sweeps the rows that see its keys and owns its dK and dV rows, and one
program per query block sweeps its keys for dQ: every gradient element is summed by one program
in a fixed order, so the backward is deterministic. Each program's accumulators are fp32; the
probabilities and dS enter their GEMMs in the input dtype (flash attention's rounding).

Inputs are [s, b, n, d] views of any strides (the MLA's layout; no copies). fp32 inputs use IEEE
fp32 dots (the interpreter's reference mode), 16-bit inputs the tensor cores. On CPU tensors the
kernels run in the Triton interpreter when TRITON_INTERPRET=1 was set before this module was
first imported (tests); the model uses them on GPUs only (``model.dsa.kernels``).
"""

from __future__ import annotations

import torch

from .indexer_fp8_triton import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# Tiles (query rows, keys), warps, pipeline stages; not timed on a GPU yet.
FWD_CONFIG = dict(block_m=64, block_n=32, num_warps=8, num_stages=2)
BWD_KV_CONFIG = dict(block_m=64, block_n=32, num_warps=8, num_stages=1)
BWD_Q_CONFIG = dict(block_m=32, block_n=64, num_warps=8, num_stages=1)
DELTA_BLOCK_M = 64  #: rows per program of delta = rowsum(dO * O) (Triton's default warps, stages)
#: ptxas resource use at GLM-5's dense MLA head (q/k 192 + 64 rope = 256, v 256, bf16, 64 heads,
#: 202,752 tokens) compiled for sm_90a without a GPU (triton 3.9; ``python -m
#: benchmarks.kernel_resources`` prints them, tests/unit/model/test_kernel_resources.py holds
#: these numbers to the compiled kernels): registers per thread, spill stores and loads (bytes
#: per thread), shared memory (KiB; an H100/H200 block may use 227).
RESOURCES = {
    "document attention forward": dict(registers=206, spill_stores=0, spill_loads=0, shared_kib=96),
    "document attention delta": dict(registers=44, spill_stores=0, spill_loads=0, shared_kib=0.25),
    "document attention dK/dV": dict(registers=208, spill_stores=0, spill_loads=0, shared_kib=128),
    "document attention dQ": dict(registers=164, spill_stores=0, spill_loads=0, shared_kib=96),
}
LOG2E = 1.4426950408889634


if HAVE_TRITON:

    @triton.jit
    def _row_offsets(rows, stride):
        """rows [R] x their row stride, in int64: a position's row offset in an [s, b, n, d]
        tensor passes 2^31 within GLM-5's context (202,752 x 64 heads x 256 = 3.3e9)."""
        return rows.to(tl.int64) * stride

    @triton.jit
    def _tile(ptr, rows, row_ok, stride, offs, DIM: tl.constexpr):
        """Rows ``rows`` [R] of one (batch, head)'s [*, DIM] matrix at ``ptr`` (row stride
        ``stride``), padded to ``offs``' width with zeros."""
        return tl.load(ptr + _row_offsets(rows, stride)[:, None] + offs[None, :],
                       mask=row_ok[:, None] & (offs < DIM)[None, :], other=0.0)

    @triton.jit
    def _store_tile(ptr, rows, row_ok, stride, offs, DIM: tl.constexpr, value):
        tl.store(ptr + _row_offsets(rows, stride)[:, None] + offs[None, :], value.to(ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs < DIM)[None, :])

    @triton.jit
    def _query_block(pos_ptr, first_ptr, b, S, m0, BLOCK_M: tl.constexpr):
        """Query rows m0.. of sample b: (rows, in range, positions, first visible keys, and the
        block's key range [lo, hi): its first row's first key to its last row's position)."""
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < S
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
        first = tl.load(first_ptr + b * S + rows, mask=row_ok, other=0)
        lo = tl.load(first_ptr + b * S + m0)
        hi = tl.load(pos_ptr + tl.minimum(m0 + BLOCK_M, S) - 1) + 1
        return rows, row_ok, pos, first, lo, hi

    @triton.jit
    def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, pos_ptr, first_ptr,
                    sq_s, sq_b, sq_h, sk_s, sk_b, sk_h, sv_s, sv_b, sv_h, so_s, so_b, so_h,
                    S, H, qk_scale,
                    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        m0 = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows, row_ok, pos, first, lo, hi = _query_block(pos_ptr, first_ptr, b, S, m0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k_bh, v_bh = k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h
        q = _tile(q_ptr + b * sq_b + h * sq_h, rows, row_ok, sq_s, offs_d, D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for n0 in range(lo - lo % BLOCK_N, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            k = _tile(k_bh, cols, col_ok, sk_s, offs_d, D)
            v = _tile(v_bh, cols, col_ok, sv_s, offs_dv, DV)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            seen = (cols[None, :] <= pos[:, None]) & (cols[None, :] >= first[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows only: every row sees its own key
        _store_tile(o_ptr + b * so_b + h * so_h, rows, row_ok, so_s, offs_dv, DV, acc / l_safe[:, None])
        tl.store(lse_ptr + bh.to(tl.int64) * S + rows, m_i + tl.log2(l_safe), mask=row_ok)

    @triton.jit
    def _delta_kernel(o_ptr, do_ptr, delta_ptr, so_s, so_b, so_h, sd_s, sd_b, sd_h, S, H,
                      DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        o = _tile(o_ptr + b * so_b + h * so_h, rows, rows < S, so_s, offs_dv, DV)
        do = _tile(do_ptr + b * sd_b + h * sd_h, rows, rows < S, sd_s, offs_dv, DV)
        tl.store(delta_ptr + bh.to(tl.int64) * S + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1),
                 mask=rows < S)

    @triton.jit
    def _bwd_kv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr, first_ptr,
                       row_lo_ptr, row_hi_ptr, dk_ptr, dv_ptr,
                       sq_s, sq_b, sq_h, sk_s, sk_b, sk_h, sv_s, sv_b, sv_h, sd_s, sd_b, sd_h,
                       sdk_s, sdk_b, sdk_h, sdv_s, sdv_b, sdv_h,
                       S, L, H, NKB, qk_scale, scale,
                       D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        # keys n0..n0+BLOCK_N-1 of (b, h); the rows that see any of them: row_lo..row_hi-1.
        # Scores are taken transposed (S^T = K Q^T) so dK and dV accumulate as [keys, d].
        kb = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_bh, do_bh = q_ptr + b * sq_b + h * sq_h, do_ptr + b * sd_b + h * sd_h
        k = _tile(k_ptr + b * sk_b + h * sk_h, cols, col_ok, sk_s, offs_d, D)
        v = _tile(v_ptr + b * sv_b + h * sv_h, cols, col_ok, sv_s, offs_dv, DV)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        r_lo = tl.load(row_lo_ptr + kb)
        r_hi = tl.load(row_hi_ptr + b * NKB + kb)
        for m0 in range(r_lo - r_lo % BLOCK_M, r_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < r_hi
            pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
            first = tl.load(first_ptr + b * S + rows, mask=row_ok, other=0)
            q = _tile(q_bh, rows, row_ok, sq_s, offs_d, D)
            do = _tile(do_bh, rows, row_ok, sd_s, offs_dv, DV)
            lse = tl.load(lse_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # [keys, rows]
            seen = (cols[:, None] <= pos[None, :]) & (cols[:, None] >= first[None, :])
            p_t = tl.where(seen, tl.exp2(s_t - lse[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
        _store_tile(dk_ptr + b * sdk_b + h * sdk_h, cols, col_ok, sdk_s, offs_d, D, dk * scale)
        _store_tile(dv_ptr + b * sdv_b + h * sdv_h, cols, col_ok, sdv_s, offs_dv, DV, dv)

    @triton.jit
    def _bwd_q_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr, first_ptr, dq_ptr,
                      sq_s, sq_b, sq_h, sk_s, sk_b, sk_h, sv_s, sv_b, sv_h, sd_s, sd_b, sd_h,
                      sdq_s, sdq_b, sdq_h, S, H, qk_scale, scale,
                      D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        m0 = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows, row_ok, pos, first, lo, hi = _query_block(pos_ptr, first_ptr, b, S, m0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k_bh, v_bh = k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h
        q = _tile(q_ptr + b * sq_b + h * sq_h, rows, row_ok, sq_s, offs_d, D)
        do = _tile(do_ptr + b * sd_b + h * sd_h, rows, row_ok, sd_s, offs_dv, DV)
        lse = tl.load(lse_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo - lo % BLOCK_N, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            k = _tile(k_bh, cols, col_ok, sk_s, offs_d, D)
            v = _tile(v_bh, cols, col_ok, sv_s, offs_dv, DV)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            seen = (cols[None, :] <= pos[:, None]) & (cols[None, :] >= first[:, None])
            p = tl.where(seen, tl.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
        _store_tile(dq_ptr + b * sdq_b + h * sdq_h, rows, row_ok, sdq_s, offs_d, D, dq * scale)


def first_visible_key(q_pos: torch.Tensor, doc_k, batch: int) -> torch.Tensor:
    """[b, s] int64: the first key each query row may see -- its document's first key (documents
    are contiguous runs of ``doc_k`` [b, L]), 0 without documents. Device ops only."""
    if doc_k is None:
        return torch.zeros(batch, q_pos.shape[0], dtype=torch.int64, device=q_pos.device)
    keys = torch.arange(doc_k.shape[1], device=doc_k.device).expand_as(doc_k)
    starts = torch.ones_like(doc_k, dtype=torch.bool)
    starts[:, 1:] = doc_k[:, 1:] != doc_k[:, :-1]
    run_start = torch.where(starts, keys, 0).cummax(dim=1).values  # [b, L]
    return run_start[:, q_pos].expand(batch, -1).contiguous()


def _strides(t: torch.Tensor):
    assert t.stride(-1) == 1, "the head dim must be contiguous"
    return t.stride(0), t.stride(1), t.stride(2)


def _dims(query, value):
    d, dv = query.shape[-1], value.shape[-1]
    prec = "ieee" if query.dtype == torch.float32 else "tf32"
    return dict(D=d, DV=dv, BLOCK_D=max(16, triton.next_power_of_2(d)),
                BLOCK_DV=max(16, triton.next_power_of_2(dv)), PREC=prec)


def _check(query, key, value, q_pos):
    if not HAVE_TRITON:
        raise RuntimeError("document_attention_triton needs triton")
    if not query.is_cuda and not _interpreted():
        raise RuntimeError("document_attention_triton runs on CUDA tensors (CPU tensors only "
                           "under TRITON_INTERPRET=1, set before the kernels were imported)")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if q_pos.shape[0] != query.shape[0]:
        raise ValueError(f"q_pos has {q_pos.shape[0]} positions for {query.shape[0]} query rows")


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_fwd_kernel, InterpretedFunction)


class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, q_pos, first, scale):
        s, b, n, _ = query.shape
        L = key.shape[0]
        dims = _dims(query, value)
        out = query.new_empty(s, b, n, value.shape[-1])
        lse = torch.empty(b * n, s, dtype=torch.float32, device=query.device)
        cfg = FWD_CONFIG
        _fwd_kernel[(triton.cdiv(s, cfg["block_m"]), b * n)](
            query, key, value, out, lse, q_pos, first, *_strides(query), *_strides(key),
            *_strides(value), *_strides(out), s, n, scale * LOG2E, BLOCK_M=cfg["block_m"],
            BLOCK_N=cfg["block_n"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **dims)
        ctx.save_for_backward(query, key, value, out, lse, q_pos, first)
        ctx.scale, ctx.key_len = scale, L
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, q_pos, first = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        s, b, n, _ = query.shape
        L, scale = ctx.key_len, ctx.scale
        dims = _dims(query, value)
        delta = torch.empty_like(lse)
        _delta_kernel[(triton.cdiv(s, DELTA_BLOCK_M), b * n)](
            out, grad_out, delta, *_strides(out), *_strides(grad_out), s, n, DV=dims["DV"],
            BLOCK_DV=dims["BLOCK_DV"], BLOCK_M=DELTA_BLOCK_M)
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))
        kv = BWD_KV_CONFIG
        bn = kv["block_n"]
        n_blocks = triton.cdiv(L, bn)
        starts = torch.arange(n_blocks, device=query.device) * bn
        # rows that see key block [j0, j1): q_pos >= j0 (a leading bound: positions ascend) and
        # first <= j1 - 1 (a trailing bound: document starts ascend with the rows)
        row_lo = torch.searchsorted(q_pos, starts)
        last_key = (starts + bn - 1).clamp_max(L - 1).expand(b, -1).contiguous()
        row_hi = torch.searchsorted(first, last_key, right=True)
        _bwd_kv_kernel[(n_blocks, b * n)](
            query, key, value, grad_out, lse, delta, q_pos, first, row_lo, row_hi, dk, dv,
            *_strides(query), *_strides(key), *_strides(value), *_strides(grad_out),
            *_strides(dk), *_strides(dv), s, L, n,
            n_blocks, scale * LOG2E, scale, BLOCK_M=kv["block_m"], BLOCK_N=bn,
            num_warps=kv["num_warps"], num_stages=kv["num_stages"], **dims)
        qc = BWD_Q_CONFIG
        _bwd_q_kernel[(triton.cdiv(s, qc["block_m"]), b * n)](
            query, key, value, grad_out, lse, delta, q_pos, first, dq,
            *_strides(query), *_strides(key), *_strides(value), *_strides(grad_out),
            *_strides(dq), s, n, scale * LOG2E, scale, BLOCK_M=qc["block_m"], BLOCK_N=qc["block_n"],
            num_warps=qc["num_warps"], num_stages=qc["num_stages"], **dims)
        return dq, dk, dv, None, None, None


def document_attention_triton(query_sbnd, key_sbnd, value_sbnd, layout, scale: float) -> torch.Tensor:
    """query [s, b, n, qk] at ``layout.q_pos``, key [L, b, n, qk], value [L, b, n, v] ->
    [s, b, n * v]: each query attends to the keys at or before its position in its document
    (``layout``: :class:`~model_providers.glm5.model.dsa.visibility.TokenLayout`)."""
    q_pos = layout.q_pos.to(torch.int64).contiguous()
    _check(query_sbnd, key_sbnd, value_sbnd, q_pos)
    s, b = query_sbnd.shape[:2]
    first = first_visible_key(q_pos, layout.doc_k, b)
    out = _DocumentAttention.apply(query_sbnd, key_sbnd, value_sbnd, q_pos, first, scale)
    return out.view(s, b, -1)
