"""Triton kernel for the lightning-indexer logits, causal in global query positions, bf16 or fp8.

    logits[b, t, j] = sum_h w[b, t, h] * ReLU(q[b, t, h, :] . k[b, j, :])   for j <= q_pos[t]
                    = -inf                                                 for j >  q_pos[t]

q_pos [s] holds the ascending global positions of the query rows: 0..s-1, a run starting at an
offset, or the two zigzag runs of a context-parallel rank. One program computes a [BLOCK_M
query, BLOCK_N key] tile as :mod:`.indexer_fp8_triton` does (key tile loaded once, one tensor-core
dot per head, w * ReLU folded into an fp32 accumulator); a tile whose keys all lie after the
last position of its query rows is not computed, only filled with -inf.

dtype "bf16": q and k rounded to bf16, the dot accumulated in fp32 and rounded to bf16 (what a
bf16 matmul returns: the torch path ``fp8.index_logits(..., dtype="bf16")``), then ReLU and the
fp32 weighted head sum; any head dim (padded to a power of two). dtype "fp8": blockwise e4m3
with pow2 scales (``fp8.quantize_fp8(x, pow2_scales=True)``), d == 128, one scale per query head
and per key; positive scales commute with ReLU, so the query scale joins w and the key scale
multiplies the tile once. q and k are quantised once per call, before the launch.

Runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this module was
first imported (the Triton interpreter; for bf16 see the note in :mod:`.sparse_mla_triton`).
"""

from __future__ import annotations

import torch

from ..fp8 import FP8_DTYPE, quantize_fp8
from .indexer_fp8_triton import (
    DEFAULT_BLOCK_M,
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    HAVE_TRITON,
    HEAD_DIM,
    _scales_2d,
)

#: ptxas resource use at GLM-5 shapes compiled for sm_90a without a GPU (triton 3.9; ``python -m
#: benchmarks.kernel_resources`` prints them, tests/unit/model/test_kernel_resources.py holds these
#: numbers to the compiled kernels): registers per thread, spill stores and loads (bytes per
#: thread), shared memory (KiB; an H100/H200 block may use 227), at
#: GLM-5's indexer dims (32 heads x 128) with the default tiles (``indexer_fp8_triton.DEFAULT_*``).
RESOURCES = {
    "indexer logits bf16": dict(registers=248, spill_stores=0, spill_loads=0, shared_kib=80),
    "indexer logits fp8": dict(registers=254, spill_stores=0, spill_loads=0, shared_kib=40),
}

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _index_logits_kernel(
        q_ptr, qs_ptr, k_ptr, ks_ptr, w_ptr, pos_ptr, o_ptr,
        SQ, SK,
        s_qb, s_qm, s_qh,  # q [b, sq, H, D], last dim contiguous
        s_qsb, s_qsm,  # q scales [b, sq, H] (fp8), last dim contiguous
        s_kb, s_kn,  # k [b, sk, D], last dim contiguous
        s_ksb,  # k scales [b, sk] (fp8)
        s_wb, s_wm,  # w [b, sq, H], last dim contiguous
        s_ob, s_om,  # out [b, sq, sk], last dim contiguous
        H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        FP8: tl.constexpr, PRECISE_ACC: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_b = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < SQ
        n_ok = offs_n < SK
        d_ok = offs_d < D
        rows = offs_m.to(tl.int64)
        o_ptrs = o_ptr + pid_b * s_ob + rows[:, None] * s_om + offs_n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=-1)
        last_key = tl.load(pos_ptr + tl.minimum(pid_m * BLOCK_M + BLOCK_M, SQ) - 1)  # ascending
        if pid_n * BLOCK_N > last_key:
            tl.store(o_ptrs, tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32), mask=o_mask)
        else:
            k = tl.load(k_ptr + pid_b * s_kb + offs_n[:, None].to(tl.int64) * s_kn + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            kt = tl.trans(k)  # [BLOCK_D, BLOCK_N]
            q_ptrs = q_ptr + pid_b * s_qb + rows[:, None] * s_qm + offs_d[None, :]
            w_ptrs = w_ptr + pid_b * s_wb + rows * s_wm
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for h in range(H):
                q = tl.load(q_ptrs + h * s_qh, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
                wh = tl.load(w_ptrs + h, mask=m_ok, other=0.0)
                if FP8:
                    qs = tl.load(qs_ptr + pid_b * s_qsb + rows * s_qsm + h, mask=m_ok, other=0.0)
                    if PRECISE_ACC:
                        s = tl.dot(q, kt, out_dtype=tl.float32, max_num_imprecise_acc=0)
                    else:
                        s = tl.dot(q, kt, out_dtype=tl.float32)
                    acc += (wh * qs)[:, None] * tl.maximum(s, 0.0)
                else:
                    s = tl.dot(q, kt, out_dtype=tl.float32).to(tl.bfloat16).to(tl.float32)
                    acc += wh[:, None] * tl.maximum(s, 0.0)
            if FP8:
                ks = tl.load(ks_ptr + pid_b * s_ksb + offs_n, mask=n_ok, other=0.0)
                acc = acc * ks[None, :]
            out = tl.where(offs_n[None, :] <= pos[:, None], acc, float("-inf"))
            tl.store(o_ptrs, out, mask=o_mask)


def _interpreted() -> bool:
    """True when @triton.jit built the kernel for the CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_index_logits_kernel, InterpretedFunction)


def index_logits_triton(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, q_pos: torch.Tensor,
                        dtype: str = "fp8", *, k_scale: torch.Tensor | None = None,
                        out: torch.Tensor | None = None,
                        block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                        num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES,
                        precise_acc: bool = False) -> torch.Tensor:
    """Indexer logits [b, s, L] fp32, -inf at keys after each row's position.

    q [b, s, H, d], k [b, L, d], w [b, s, H] fp32 (scale folded in), q_pos [s] int64 ascending
    global positions of the rows; dtype "bf16" | "fp8" (see the module docstring). fp8 keys may
    come quantised (k float8_e4m3fn with ``k_scale`` [b, L, 1] from ``quantize_fp8(k,
    pow2_scales=True)``), so a caller that splits the queries into chunks quantises its keys
    once per layer. ``out`` (optional) is written in place (any row stride, last dim contiguous)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: the indexer kernel needs CUDA and triton")
    if q.dim() != 4 or k.dim() != 3 or w.dim() != 3:
        raise ValueError(f"expected q [b,s,H,d], k [b,L,d], w [b,s,H]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(w.shape)}")
    b, sq, H, d = q.shape
    sk = k.shape[1]
    if k.shape[0] != b or k.shape[2] != d or tuple(w.shape) != (b, sq, H) or tuple(q_pos.shape) != (sq,):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)}, "
                         f"q_pos {tuple(q_pos.shape)}")
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
    if not q.is_cuda and not _interpreted():
        raise RuntimeError("the indexer Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "model_providers.glm5.model.dsa.kernels is first imported (CPU interpreter)")
    if out is None:
        out = torch.empty((b, sq, sk), dtype=torch.float32, device=q.device)
    elif out.shape != (b, sq, sk) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 [b, s, L] with a contiguous last dim, got {tuple(out.shape)}")
    if b == 0 or sq == 0 or sk == 0:
        return out
    if dtype == "fp8":
        if d != HEAD_DIM:
            raise ValueError(f"the fp8 indexer kernel needs d == {HEAD_DIM}, got {d}")
        q, qs = quantize_fp8(q, pow2_scales=True)
        if k.dtype != FP8_DTYPE:
            k, k_scale = quantize_fp8(k, pow2_scales=True)
        elif k_scale is None:
            raise ValueError("fp8 keys need their k_scale (quantize_fp8(k, pow2_scales=True))")
        qs, ks = _scales_2d(qs, "q_scale"), _scales_2d(k_scale, "k_scale")
    elif k.dtype == FP8_DTYPE:
        raise ValueError("dtype='bf16' needs unquantised keys")
    else:
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        qs = ks = torch.zeros(1, 1, dtype=torch.float32, device=q.device)  # unused
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    w = w.float()
    if w.stride(-1) != 1:
        w = w.contiguous()
    q_pos = q_pos.to(device=q.device, dtype=torch.int64).contiguous()
    grid = (triton.cdiv(sk, block_n), triton.cdiv(sq, block_m), b)
    _index_logits_kernel[grid](
        q, qs, k, ks, w, q_pos, out,
        sq, sk,
        q.stride(0), q.stride(1), q.stride(2),
        qs.stride(0), qs.stride(1),
        k.stride(0), k.stride(1),
        ks.stride(0),
        w.stride(0), w.stride(1),
        out.stride(0), out.stride(1),
        H=H, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, BLOCK_N=block_n,
        FP8=dtype == "fp8", PRECISE_ACC=bool(precise_acc),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
