"""Triton sparse MLA in its absorbed (MQA) form: forward, backward and the autograd Function.

Same semantics as the torch reference
(:func:`model_providers.glm5.model.dsa.sparse_attention.sparse_latent_attention`): q [b, s, n, D]
absorbed queries (D = latent + rope, 576 for GLM-5), kv [b, L, D] latent rows whose first ``dv``
dims are also the values, idx [b, s, k] distinct key positions per query, valid [b, s, k] bool.
o [b, s, n, dv] in q's dtype; head_probs [b, s, k] fp32, the attention probabilities summed over
heads (the KL target). Rows with no valid key give o = 0, head_probs = 0 and lse = -inf.

Forward (one launch): one program per (query, head group, batch). The heads are the scores
GEMM's M dim (padded to a power of two >= 16); the query's selected latent rows are gathered
BLOCK_N at a time and split into a value part (the first dv dims) and the rest (rope), each
padded to a power of two, so GLM-5's 512 + 64 needs no padding. Online softmax in fp32 gives o
and the log-sum-exp; a second sweep over the same rows (QK^T only) writes head_probs with the
final LSE. The output is accumulated transposed (o^T = V^T P^T, M = dv).

Backward from the saved LSE: the same programs recompute P, dP = dO V^T, dS = P (dP - delta)
and write dq directly. The heads' q and dO rows are stacked, X = [q; dO], so one GEMM gives
[S; dP] = X kv^T and one gives the kv gradient's two terms, dkv^T = X^T [dS; P]; dq is
accumulated transposed (dq^T = kv^T dS^T). Every large GEMM thus has M >= 128, which keeps
Triton's Hopper layouts consistent along each accumulation chain. delta = rowsum(dO * O) comes
from a small kernel run first (one program per query and head group): taken inside the
backward, its reduction's layout spread to dS and P, replicated across lanes (most of the
former backward's spills). Head, dimension and key masks are compile-time true where the launch
knows the blocks are full (GLM-5's shapes). Compiled for sm_90a without a GPU, the backward
keeps its dq accumulator and a key block's work in registers without spilling
(:data:`RESOURCES`, BWD_CONFIG). dkv is accumulated deterministically: each program writes its
per-(query, key) contributions [D] fp32 to a partial buffer, at rows placed by a stable sort of
the pairs by key (pairs numbered batch, query, head group, slot); a second kernel (:mod:`.ordered_rows`) walks each key's
run of rows in that fixed (query, head group) order and adds it to an fp32 [b, L, D] accumulator
(one program per key run: no atomics). Queries are processed in chunks whose partials fit
``PARTIAL_BUDGET`` (1 GiB; :func:`backward_chunk_plan`); chunks run in order, so every key's sum
is taken in the same order whatever the chunk size: dq and dkv are bitwise the same for any
budget. GLM-5 (64 heads, 576 dims, k = 2048, one head group): 4.7 MB of partials per query,
227 queries per chunk, 145 chunks at 32K queries (plus 32 bytes of sort/index per pair row,
1.4% of the partials). The former 4 GiB budget gave 36 chunks; each chunk adds a sort of its
pairs and two launches (not yet timed on a GPU: ``make gpu-check`` times the backward at 32K).

Precision: scores, softmax statistics, delta and every GEMM accumulate in fp32; fp32 inputs use
IEEE fp32 dots (no TF32). With bf16/fp16 inputs the products q.k and dO.v are exact, but P and
dS are fp32 and must enter tensor-core GEMMs in the input dtype, and delta = rowsum(dO * O)
taken from the saved 16-bit O errs by O's rounding. Two modes:

* ``precise=False`` (the default, :data:`PRECISE`) rounds P and dS once to the input dtype and
  takes delta from O (one launch before the backward's chunks), as flash attention does;
* ``precise=True`` splits P and dS into hi + lo parts in the input dtype (two GEMMs each: P.V
  forward; dS.K, dS^T.Q, P^T.dO backward; ~16 bits kept) and first sweeps the keys once more for
  delta = sum_j P_j dP_j: o, dq and dkv are fp32 math rounded once, at twice fast's backward
  GEMM work and 4/3 of its forward's.

The rule that picks the default: the bf16 floor of an output is the norm-relative error of the
exact (fp64) result rounded once to bf16; fast is the default iff its error is within
``FAST_MAX_ERROR_RATIO`` (1.5) x the floor for each of o, dq and dkv. Measured in the Triton
interpreter (GPU rounding; ``tests/unit/model/test_dsa_triton_kernels.py``, case "glm5
precision": 64 heads, 512 + 64, bf16, 16 queries of an 80-key sequence, k = 48, one key selected
by every query), error / floor:

    ======= ======= ========== ===========  (floor ~1.66e-3 for each output)
    output  precise fast       fast / floor
    ======= ======= ========== ===========
    o       1.66e-3 2.05e-3    1.24
    dq      1.66e-3 2.38e-3    1.44
    dkv     1.66e-3 2.38e-3    1.43
    ======= ======= ========== ===========

(key 0's dkv row alone: 1.42; other seeds and k = 128: 1.23-1.26 / 1.40-1.45 / 1.41-1.43).
Fast is within 1.5x everywhere, so it is the default; the test fails if a change of kernels or
of the default contradicts the rule. ``precise=True`` stays for checks that want the floor.
These are the interpreter's numbers with the GPU's bf16 rounding emulated; ``make gpu-check``
records both modes' errors and the floor on the GPU at GLM-5 shapes (k = 2048).

Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this module was
first imported (the Triton interpreter). triton 3.9's interpreter gets bf16 wrong (``tl.dot``
multiplies the raw bit patterns, fp32 -> bf16 casts truncate; triton-lang/triton#11584): bf16
in the interpreter needs ``kernels.interpreter.bf16_as_on_gpu()`` first; fp32
needs nothing.
"""

from __future__ import annotations

import torch

from .indexer_fp8_triton import HAVE_TRITON
from .ordered_rows import add_rows_in_order, pair_order

if HAVE_TRITON:
    import triton
    import triton.language as tl

PRECISE = False  #: 16-bit inputs: P and dS rounded once for their GEMMs (True: hi + lo parts)
FAST_MAX_ERROR_RATIO = 1.5  #: fast is the default iff its bf16 error <= this x the bf16 floor
HEAD_GROUP = 64  #: heads per program at most (the GEMM M dim); more heads use several programs
PARTIAL_BUDGET = 2**30  #: bytes of fp32 dkv partials per backward chunk at most (GLM-5: 227 queries)
#: selected keys per block, warps, pipeline stages of each kernel; RESOURCES below is what they
#: compile to at GLM-5 shapes. The backward's block_n = 16 (its smallest) and 2 stages are the
#: tiles that keep its dq accumulator (64 heads x 576 fp32: 144 of a thread's 255 registers at 8
#: warps) and the rest of a key block's work in registers: block_n = 32 spills, and so does one
#: stage (ptxas then schedules the gathers differently).
FWD_CONFIG = dict(block_n=32, num_warps=8, num_stages=2)
BWD_CONFIG = dict(block_n=16, num_warps=8, num_stages=2)
DELTA_CONFIG = dict(num_warps=8)  #: delta = rowsum(dO * O): one program per (query, head group)
#: ptxas resource use at GLM-5 shapes (64 heads, 512 + 64, k = 2048, bf16) compiled for sm_90a
#: without a GPU (triton 3.9; ``python -m benchmarks.kernel_resources`` prints them, and
#: tests/unit/model/test_kernel_resources.py holds these numbers to the compiled kernels):
#: registers per thread, spill stores and loads (bytes per thread), shared memory (KiB; an
#: H100/H200 block may use 227). The backward must not spill (the test fails if it does);
#: precise=True's hi + lo GEMMs still spill there, and the forward spills in both modes.
RESOURCES = {
    "sparse MLA forward": dict(registers=255, spill_stores=132, spill_loads=124, shared_kib=148),
    "sparse MLA backward": dict(registers=253, spill_stores=0, spill_loads=0, shared_kib=196),
    "sparse MLA delta": dict(registers=48, spill_stores=0, spill_loads=0, shared_kib=0.5),
    "sparse MLA forward precise": dict(registers=255, spill_stores=196, spill_loads=188, shared_kib=152),
    "sparse MLA backward precise": dict(registers=255, spill_stores=440, spill_loads=456, shared_kib=196),
}

if HAVE_TRITON:

    @triton.jit
    def _dot_fp32_right(a, b, acc, PREC: tl.constexpr, SPLIT: tl.constexpr):
        """acc + a @ b for a in the input dtype and an fp32 b (P or dS, transposed): b rounded
        to a's dtype, or with SPLIT taken as hi + lo parts in a's dtype (two GEMMs; bf16 keeps
        ~16 bits of b instead of 8, so the product is fp32 math to ~2^-16)."""
        hi = b.to(a.dtype)
        if SPLIT:  # both parts formed before the GEMMs (fewer registers live across them)
            lo = (b - hi.to(tl.float32)).to(a.dtype)
            acc = tl.dot(a, hi, acc, input_precision=PREC)
            acc = tl.dot(a, lo, acc, input_precision=PREC)
        else:
            acc = tl.dot(a, hi, acc, input_precision=PREC)
        return acc

    @triton.jit
    def _below(offs, n, FULL: tl.constexpr):
        """offs < n, or a constant true where the launch knows the block is full: the masks
        then fold away (at GLM-5 shapes every block is full), which frees registers."""
        if FULL:
            return tl.full(offs.shape, 1, tl.int1)
        else:
            return offs < n

    @triton.jit
    def _query_rows(b, t, S, NH, g, HEADS: tl.constexpr):
        """(row b * S + t of the [B, S] queries, row of its head group's first head in the
        [B, S, NH] heads), int64: queries x heads x dims pass 2^31 (202,752 x 64 x 576)."""
        row = b.to(tl.int64) * S + t
        return row, row * NH + g * HEADS

    @triton.jit
    def _head_probs_offset(g, B, S, row, K):
        """Offset of query ``row``'s head_probs of head group g in hp [G, B, S, K], int64 (an
        int32 g * B * S wraps once it reaches 2^31)."""
        return (g.to(tl.int64) * B * S + row) * K

    @triton.jit
    def _gather_rows(kv_ptr, idx_ptr, valid_ptr, n0, K, offs_dv, offs_dr, DV: tl.constexpr,
                     DR: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
        """The BLOCK_N selected rows from n0: value part [BN, BDV], rest [BN, BDR], and `ok`
        (in range and valid). Invalid rows load as zeros (their positions are not read)."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = _below(offs_n, K, EVEN_K)
        ok = n_ok & (tl.load(valid_ptr + offs_n, mask=n_ok, other=0) != 0)
        key = tl.load(idx_ptr + offs_n, mask=ok, other=0).to(tl.int64)
        row = kv_ptr + key[:, None] * (DV + DR)
        dv_ok = _below(offs_dv, DV, DV == offs_dv.shape[0])
        dr_ok = _below(offs_dr, DR, DR == offs_dr.shape[0])
        kv_v = tl.load(row + offs_dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
        kv_r = tl.load(row + DV + offs_dr[None, :], mask=ok[:, None] & dr_ok[None, :], other=0.0)
        return offs_n, n_ok, ok, kv_v, kv_r

    @triton.jit
    def _sparse_mla_fwd_kernel(
        q_ptr, kv_ptr, idx_ptr, valid_ptr, o_ptr, lse_ptr, hp_ptr,
        S, NH, K, L, scale,
        DV: tl.constexpr, DR: tl.constexpr, HEADS: tl.constexpr, FULL_H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
        BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # q [B, S, NH, D], kv [B, L, D], idx/valid [B, S, K], o [B, S, NH, DV], lse [B, S, NH],
        # hp [G, B, S, K]: all contiguous. The output is accumulated transposed, o^T = V^T P^T:
        # its GEMM has M = DV (not the heads), so hi and lo parts chain in one layout.
        g = tl.program_id(1)
        b = tl.program_id(2)
        B = tl.num_programs(2)
        D: tl.constexpr = DV + DR
        row, hrow = _query_rows(b, tl.program_id(0), S, NH, g, HEADS)
        offs_h = tl.arange(0, BLOCK_H)  # heads hrow + offs_h
        h_ok = _below(offs_h, tl.minimum(HEADS, NH - g * HEADS), FULL_H)
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_dr = tl.arange(0, BLOCK_DR)
        dv_ok = _below(offs_dv, DV, DV == BLOCK_DV)
        dr_ok = _below(offs_dr, DR, DR == BLOCK_DR)
        q_rows = q_ptr + hrow * D + offs_h[:, None] * D
        q_v = tl.load(q_rows + offs_dv[None, :], mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
        q_r = tl.load(q_rows + DV + offs_dr[None, :], mask=h_ok[:, None] & dr_ok[None, :], other=0.0)
        kv_b = kv_ptr + b.to(tl.int64) * L * D
        idx_r = idx_ptr + row * K
        valid_r = valid_ptr + row * K

        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc_t = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
        for n0 in range(0, K, BLOCK_N):
            offs_n, n_ok, ok, kv_v, kv_r = _gather_rows(kv_b, idx_r, valid_r, n0, K, offs_dv, offs_dr,
                                                        DV, DR, BLOCK_N, EVEN_K)
            s = tl.dot(q_v, tl.trans(kv_v), input_precision=DOT_PREC)
            s = tl.dot(q_r, tl.trans(kv_r), s, input_precision=DOT_PREC)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc_t = _dot_fp32_right(tl.trans(kv_v), tl.trans(p), acc_t * alpha[None, :], DOT_PREC, SPLIT)
            m = m_new
        has = l > 0.0
        l_safe = tl.where(has, l, 1.0)
        o_t = tl.where(has[None, :], acc_t / l_safe[None, :], 0.0)
        lse = tl.where(has, m + tl.log(l_safe), float("-inf"))
        tl.store(o_ptr + hrow * DV + offs_h[None, :] * DV + offs_dv[:, None], o_t.to(o_ptr.dtype.element_ty),
                 mask=h_ok[None, :] & dv_ok[:, None])
        tl.store(lse_ptr + hrow + offs_h, lse, mask=h_ok)

        # head_probs: the probabilities with the final LSE, summed over this group's heads
        lse_use = tl.where(has, lse, 0.0)
        hp_r = hp_ptr + _head_probs_offset(g, B, S, row, K)
        for n0 in range(0, K, BLOCK_N):
            offs_n, n_ok, ok, kv_v, kv_r = _gather_rows(kv_b, idx_r, valid_r, n0, K, offs_dv, offs_dr,
                                                        DV, DR, BLOCK_N, EVEN_K)
            s = tl.dot(q_v, tl.trans(kv_v), input_precision=DOT_PREC)
            s = tl.dot(q_r, tl.trans(kv_r), s, input_precision=DOT_PREC)
            p = tl.where(ok[None, :] & h_ok[:, None], tl.exp(s * scale - lse_use[:, None]), 0.0)
            tl.store(hp_r + offs_n, tl.sum(p, 0), mask=n_ok)

    @triton.jit
    def _sparse_mla_delta_kernel(o_ptr, do_ptr, delta_ptr, S, NH, DV: tl.constexpr, HEADS: tl.constexpr,
                                 FULL_H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
        # delta [B, S, NH] fp32 = rowsum(dO * O) for o, do [B, S, NH, DV]: the backward's
        # fast-mode delta, taken here so that the backward's layouts do not follow this
        # reduction's (inside it, its [heads] layout spread to dS and P, replicated across lanes)
        g = tl.program_id(1)
        _, hrow = _query_rows(tl.program_id(2), tl.program_id(0), S, NH, g, HEADS)
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = _below(offs_h, tl.minimum(HEADS, NH - g * HEADS), FULL_H)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows = hrow * DV + offs_h[:, None] * DV + offs_dv[None, :]
        mask = h_ok[:, None] & _below(offs_dv, DV, DV == BLOCK_DV)[None, :]
        o = tl.load(o_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(delta_ptr + hrow + offs_h, tl.sum(o * do, 1), mask=h_ok)

    @triton.jit
    def _sparse_mla_bwd_kernel(
        q_ptr, kv_ptr, idx_ptr, valid_ptr, delta_ptr, do_ptr, lse_ptr, dq_ptr, part_ptr, dest_ptr,
        T0, C, S, NH, K, L, scale,
        DV: tl.constexpr, DR: tl.constexpr, HEADS: tl.constexpr, FULL_H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
        BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # Query t = T0 + program_id(0) of the chunk [T0, T0 + C). Its partial rows are numbered
        # ((b * C + t - T0) * G + g) * K + slot and stored at part[dest[that]]: query-major, so a
        # key's rows are summed in the same order whatever the chunk size.
        # The heads' q and dO rows are stacked, X = [q; dO] [2 BLOCK_H, DV] (and [q_rope; 0]), so
        # that one GEMM gives [S; dP] = X kv^T and one gives dkv^T = X^T [dS; P]; dq is
        # accumulated transposed, dq^T = kv^T dS^T: every GEMM has M >= 128.
        tc = tl.program_id(0)
        g = tl.program_id(1)
        b = tl.program_id(2)
        G = tl.num_programs(1)
        D: tl.constexpr = DV + DR
        row, hrow = _query_rows(b, T0 + tc, S, NH, g, HEADS)
        offs_h = tl.arange(0, BLOCK_H)  # heads hrow + offs_h
        h_ok = _below(offs_h, tl.minimum(HEADS, NH - g * HEADS), FULL_H)
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_dr = tl.arange(0, BLOCK_DR)
        dv_ok = _below(offs_dv, DV, DV == BLOCK_DV)
        dr_ok = _below(offs_dr, DR, DR == BLOCK_DR)
        # stacked rows: x < BLOCK_H are q of head x, the others dO of head x - BLOCK_H
        offs_x = tl.arange(0, 2 * BLOCK_H)
        is_q = offs_x < BLOCK_H
        x_head = tl.where(is_q, offs_x, offs_x - BLOCK_H)
        x_ok = _below(x_head, tl.minimum(HEADS, NH - g * HEADS), FULL_H)
        q_rows = q_ptr + hrow * D + x_head[:, None] * D
        # one plain load (pointers chosen per row), so the GEMMs read it from shared memory
        qd_ptrs = tl.where(is_q[:, None], q_rows + offs_dv[None, :],
                           do_ptr + hrow * DV + x_head[:, None] * DV + offs_dv[None, :])
        qd = tl.load(qd_ptrs, mask=x_ok[:, None] & dv_ok[None, :], other=0.0)
        qr = tl.load(q_rows + DV + offs_dr[None, :], mask=(x_ok & is_q)[:, None] & dr_ok[None, :], other=0.0)
        lse = tl.load(lse_ptr + hrow + offs_h, mask=h_ok, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)  # rows without keys: every p is masked
        kv_b = kv_ptr + b.to(tl.int64) * L * D
        idx_r = idx_ptr + row * K
        valid_r = valid_ptr + row * K
        if SPLIT:
            # delta = rowsum(dO * O) of the unrounded O, i.e. sum_j P_j dP_j: one more sweep
            # (a 16-bit O's rounding would cost dq about as much as rounding dq itself)
            delta = tl.zeros([BLOCK_H], tl.float32)
            for n0 in range(0, K, BLOCK_N):
                offs_n, n_ok, ok, kv_v, kv_r = _gather_rows(kv_b, idx_r, valid_r, n0, K, offs_dv,
                                                            offs_dr, DV, DR, BLOCK_N, EVEN_K)
                sdp = tl.dot(qd, tl.trans(kv_v), input_precision=DOT_PREC)
                sdp = tl.dot(qr, tl.trans(kv_r), sdp, input_precision=DOT_PREC)
                s, dp = tl.split(tl.permute(tl.reshape(sdp, [2, BLOCK_H, BLOCK_N]), (1, 2, 0)))
                p = tl.where(ok[None, :] & h_ok[:, None], tl.exp(s * scale - lse[:, None]), 0.0)
                delta += tl.sum(p * dp, 1)
        else:  # rowsum(dO * O) from the saved O (_sparse_mla_delta_kernel)
            delta = tl.load(delta_ptr + hrow + offs_h, mask=h_ok, other=0.0)
        dest_r = dest_ptr + ((b.to(tl.int64) * C + tc) * G + g) * K

        dq_t = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
        dqr_t = tl.zeros([BLOCK_DR, BLOCK_H], tl.float32)
        for n0 in range(0, K, BLOCK_N):
            offs_n, n_ok, ok, kv_v, kv_r = _gather_rows(kv_b, idx_r, valid_r, n0, K, offs_dv, offs_dr,
                                                        DV, DR, BLOCK_N, EVEN_K)
            sdp = tl.dot(qd, tl.trans(kv_v), input_precision=DOT_PREC)
            sdp = tl.dot(qr, tl.trans(kv_r), sdp, input_precision=DOT_PREC)
            s, dp = tl.split(tl.permute(tl.reshape(sdp, [2, BLOCK_H, BLOCK_N]), (1, 2, 0)))
            p = tl.where(ok[None, :] & h_ok[:, None], tl.exp(s * scale - lse[:, None]), 0.0)
            ds = p * (dp - delta[:, None]) * scale
            dq_t = _dot_fp32_right(tl.trans(kv_v), tl.trans(ds), dq_t, DOT_PREC, SPLIT)
            dqr_t = _dot_fp32_right(tl.trans(kv_r), tl.trans(ds), dqr_t, DOT_PREC, SPLIT)
            dsp = tl.reshape(tl.permute(tl.join(ds, p), (2, 0, 1)), [2 * BLOCK_H, BLOCK_N])  # [dS; P]
            dkv_t = _dot_fp32_right(tl.trans(qd), dsp, tl.zeros([BLOCK_DV, BLOCK_N], tl.float32),
                                    DOT_PREC, SPLIT)
            dkvr_t = _dot_fp32_right(tl.trans(qr), dsp, tl.zeros([BLOCK_DR, BLOCK_N], tl.float32),
                                     DOT_PREC, SPLIT)
            part = part_ptr + tl.load(dest_r + offs_n, mask=n_ok, other=0)[None, :] * D
            tl.store(part + offs_dv[:, None], dkv_t, mask=n_ok[None, :] & dv_ok[:, None])
            tl.store(part + DV + offs_dr[:, None], dkvr_t, mask=n_ok[None, :] & dr_ok[:, None])
        dq_rows = dq_ptr + hrow * D + offs_h[None, :] * D
        tl.store(dq_rows + offs_dv[:, None], dq_t.to(dq_ptr.dtype.element_ty),
                 mask=h_ok[None, :] & dv_ok[:, None])
        tl.store(dq_rows + DV + offs_dr[:, None], dqr_t.to(dq_ptr.dtype.element_ty),
                 mask=h_ok[None, :] & dr_ok[:, None])


def _interpreted() -> bool:
    """True when @triton.jit built the kernels for the CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_sparse_mla_fwd_kernel, InterpretedFunction)


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(max(1, x)))


def _check(q, kv, idx, valid, dv: int):
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: the sparse MLA kernels need CUDA and triton")
    if q.dim() != 4 or kv.dim() != 3 or idx.dim() != 3 or valid.shape != idx.shape:
        raise ValueError(f"expected q [b,s,n,D], kv [b,L,D], idx and valid [b,s,k]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}, {tuple(idx.shape)}, {tuple(valid.shape)}")
    b, s, _, dim = q.shape
    if kv.shape[0] != b or kv.shape[2] != dim or idx.shape[:2] != (b, s) or not 0 < dv <= dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, idx {tuple(idx.shape)}, "
                         f"dv {dv}")
    if q.dtype != kv.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q and kv must share one of fp32/bf16/fp16, got {q.dtype} and {kv.dtype}")
    if not q.is_cuda and not _interpreted():
        raise RuntimeError("the sparse MLA Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set "
                           "before model_providers.glm5.model.dsa.kernels is first imported (CPU interpreter)")


def _meta(q, dv: int, heads_per_program: int, precise: bool):
    """The kernels' shape constexprs for q [b, s, n, D] (FULL_H: every head group fills its
    BLOCK_H rows, so the head masks fold away)."""
    n, dim = q.shape[2], q.shape[3]
    heads = min(n, heads_per_program)
    fp32 = q.dtype == torch.float32
    return dict(DV=dv, DR=dim - dv, HEADS=heads, FULL_H=heads == _pow2(heads) and n % heads == 0,
                BLOCK_H=_pow2(heads), BLOCK_DV=_pow2(dv), BLOCK_DR=_pow2(dim - dv),
                DOT_PREC="ieee" if fp32 else "tf32", SPLIT=bool(precise) and not fp32)


def _launch(cfg: dict, k: int, block_n: int | None, num_warps: int | None, num_stages: int | None):
    """A launch's tile constexprs and options: ``cfg`` (FWD_CONFIG, BWD_CONFIG) unless overridden;
    EVEN_K: k is a multiple of BLOCK_N (no key-range masks)."""
    bn = block_n or cfg["block_n"]
    return dict(BLOCK_N=bn, EVEN_K=k % bn == 0, num_warps=num_warps or cfg["num_warps"],
                num_stages=num_stages or cfg["num_stages"])


def _flat(idx, valid):
    return idx.contiguous(), valid.contiguous().view(torch.uint8)


def sparse_mla_forward(q, kv, idx, valid, scale: float, dv: int, *, precise: bool = PRECISE,
                       heads_per_program: int = HEAD_GROUP, block_n: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None):
    """(o [b, s, n, dv] q's dtype, lse [b, s, n] fp32, head_probs [b, s, k] fp32); no autograd.
    Valid entries of idx must lie in [0, L) (not checked: that would sync with the device);
    invalid entries are never read. block_n / num_warps / num_stages override FWD_CONFIG."""
    _check(q, kv, idx, valid, dv)
    q, kv = q.contiguous(), kv.contiguous()
    idx, valid8 = _flat(idx, valid)
    b, s, n, _ = q.shape
    L, k = kv.shape[1], idx.shape[2]
    meta = _meta(q, dv, heads_per_program, precise)
    groups = triton.cdiv(n, meta["HEADS"])
    o = q.new_empty(b, s, n, dv)
    lse = q.new_empty(b, s, n, dtype=torch.float32)
    hp = q.new_empty(groups, b, s, k, dtype=torch.float32)
    if b and s and n:
        _sparse_mla_fwd_kernel[(s, groups, b)](
            q, kv, idx, valid8, o, lse, hp, s, n, k, L, float(scale), **meta,
            **_launch(FWD_CONFIG, k, block_n, num_warps, num_stages))
    return o, lse, hp[0] if groups == 1 else hp.sum(0)


def backward_chunk_plan(b: int, s: int, n: int, dim: int, k: int, *, heads_per_program: int = HEAD_GROUP,
                        partial_budget: int = PARTIAL_BUDGET, chunk: int | None = None) -> tuple[int, int]:
    """(queries per backward chunk, bytes of its fp32 dkv partial buffer) for q [b, s, n, dim]
    and k selected keys: as many queries as ``partial_budget`` allows (at least one; ``chunk``
    overrides). Each (query, head group, batch) program writes k rows of dim fp32."""
    groups = -(-n // min(n, heads_per_program)) if n else 1
    per_query = groups * b * k * dim * 4
    c = chunk or partial_budget // max(1, per_query)
    c = max(1, min(c, s))
    return c, c * per_query


def sparse_mla_backward(q, kv, idx, valid, o, lse, grad_o, scale: float, dv: int, *,
                        precise: bool = PRECISE, heads_per_program: int = HEAD_GROUP,
                        chunk: int | None = None, partial_budget: int = PARTIAL_BUDGET,
                        block_n: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None):
    """(dq in q's dtype, dkv in kv's dtype), bitwise reproducible and bitwise independent of
    the chunking. ``chunk``: queries per partial-buffer pass (default: as many as
    ``partial_budget`` bytes of fp32 partials allow, :func:`backward_chunk_plan`);
    block_n / num_warps / num_stages override BWD_CONFIG."""
    _check(q, kv, idx, valid, dv)
    q, kv, o, lse = q.contiguous(), kv.contiguous(), o.contiguous(), lse.contiguous()
    grad_o = grad_o.to(q.dtype).contiguous()
    idx, valid8 = _flat(idx, valid)
    b, s, n, dim = q.shape
    L, k = kv.shape[1], idx.shape[2]
    meta = _meta(q, dv, heads_per_program, precise)
    groups = triton.cdiv(n, meta["HEADS"])
    dq = torch.empty_like(q)
    dkv = torch.zeros(b, L, dim, dtype=torch.float32, device=q.device)
    if not (b and s and n and k):
        return dq.zero_(), dkv.to(kv.dtype)
    c, _ = backward_chunk_plan(b, s, n, dim, k, heads_per_program=heads_per_program,
                               partial_budget=partial_budget, chunk=chunk)
    part = q.new_empty(groups * b * c * k, dim, dtype=torch.float32)
    if meta["SPLIT"]:
        delta = lse  # not read: the kernel sweeps the keys for delta
    else:
        delta = torch.empty_like(lse)
        delta_meta = {key: meta[key] for key in ("DV", "HEADS", "FULL_H", "BLOCK_H", "BLOCK_DV")}
        _sparse_mla_delta_kernel[(s, groups, b)](o, grad_o, delta, s, n, **delta_meta, **DELTA_CONFIG)
    launch = _launch(BWD_CONFIG, k, block_n, num_warps, num_stages)
    for t0 in range(0, s, c):
        cc = min(c, s - t0)
        keys_sorted, dest = pair_order(idx[:, t0:t0 + cc], valid[:, t0:t0 + cc], L, groups)
        _sparse_mla_bwd_kernel[(cc, groups, b)](
            q, kv, idx, valid8, delta, grad_o, lse, dq, part, dest,
            t0, cc, s, n, k, L, float(scale), **meta, **launch)
        add_rows_in_order(keys_sorted, part, dkv)
    return dq, dkv.to(kv.dtype)


class SparseMLATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, valid, scale: float, dv: int, precise: bool):
        o, lse, head_probs = sparse_mla_forward(q, kv, idx, valid, scale, dv, precise=precise)
        ctx.save_for_backward(q, kv, idx, valid, o, lse)
        ctx.scale, ctx.dv, ctx.precise = scale, dv, precise
        ctx.mark_non_differentiable(head_probs)
        ctx.set_materialize_grads(False)  # no zero-filled [b, s, k] gradient for head_probs
        return o, head_probs

    @staticmethod
    def backward(ctx, grad_o, _grad_head_probs):
        if grad_o is None:
            return (None,) * 7
        q, kv, idx, valid, o, lse = ctx.saved_tensors
        dq, dkv = sparse_mla_backward(q, kv, idx, valid, o, lse, grad_o, ctx.scale, ctx.dv,
                                      precise=ctx.precise)
        return dq, dkv, None, None, None, None, None


def sparse_mla_triton(q, kv, idx, valid, scale: float, dv: int, *, precise: bool = PRECISE):
    """(o [b, s, n, dv] in q's dtype, head_probs [b, s, k] fp32), differentiable in q and kv;
    the Triton counterpart of ``sparse_latent_attention`` (see the module docstring).
    By default (``precise=False``) P and dS are rounded to the input dtype for their GEMMs
    (flash attention's choice: ~1.45x the bf16 error of exact math rounded once, at most);
    ``precise=True`` splits them into hi + lo parts (the floor itself, twice the backward GEMMs)."""
    return SparseMLATriton.apply(q, kv, idx, valid, scale, dv, precise)
