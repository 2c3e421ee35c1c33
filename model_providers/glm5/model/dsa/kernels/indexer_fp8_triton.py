"""Triton kernel for the FP8 lightning-indexer logits.

    logits[b, t, s] = sum_h w[b, t, h] * ReLU(qs[b, t, h] * ks[b, s] * (q8[b, t, h, :] . k8[b, s, :]))

q8 [b, sq, H, 128] and k8 [b, sk, 128] are float8_e4m3fn with one fp32 scale per 128 values
(model_providers/glm5/model/dsa/fp8.py: quantize_fp8). One program computes a [BLOCK_M query, BLOCK_N
key] tile: the key tile is loaded once, then the loop over the H heads does one fp8 tensor-core
dot per head (fp32 result) and folds w * ReLU into an fp32 accumulator in registers, so the
[sq, sk, H] scores never exist in memory. Scales are positive, so ReLU(qs*ks*x) = qs*ks*ReLU(x):
the query scale joins w per head and the key scale multiplies the tile once at the end. Tiles
entirely above the causal diagonal only store -inf. The key-block index is the fastest grid
axis, so programs running together share the query tile in L2.

Accumulation: on sm_90 Triton lets the fp8 wgmma accumulate a whole 128-long dot in the tensor
core's reduced-precision accumulator (DeepSeek-V3 report: ~14 bits retained) before the fp32
head sum; `precise_acc=True` promotes to fp32 after every wgmma step instead (slower).

Without triton (or without a GPU) this module still imports;
`HAVE_TRITON` says whether the kernel exists. triton 3.9 reads TRITON_INTERPRET when
`@triton.jit` runs, i.e. when this module is first imported: set it before that import to run
the kernel on CPU tensors in the interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a pinned dependency
    triton = None
    tl = None
    HAVE_TRITON = False

HEAD_DIM = 128  # the kernel handles d == 128 (GLM-5, DeepSeek-V3.2): one scale per q head / key
DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 128
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
#: ptxas resource use at GLM-5 shapes compiled for sm_90a without a GPU (triton 3.9; ``python -m
#: benchmarks.kernel_resources`` prints them, tests/unit/model/test_kernel_resources.py holds these
#: numbers to the compiled kernels): registers per thread, spill stores and loads (bytes per
#: thread), shared memory (KiB; an H100/H200 block may use 227), at
#: GLM-5's indexer dims (32 heads x 128), non-causal (the indexer's fp8 path on quantised keys).
RESOURCES = {
    "indexer fp8 (quantised keys)": dict(registers=204, spill_stores=0, spill_loads=0, shared_kib=40),
}


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["q_offset"])
    def _fp8_index_kernel(
        q_ptr, qs_ptr, k_ptr, ks_ptr, w_ptr, o_ptr,
        SQ, SK, q_offset,
        s_qb, s_qm, s_qh,  # q8 [b, sq, H, D], last dim contiguous
        s_qsb, s_qsm,  # q scales [b, sq, H], last dim contiguous
        s_kb, s_kn,  # k8 [b, sk, D], last dim contiguous
        s_ksb,  # k scales [b, sk], last dim contiguous
        s_wb, s_wm,  # w [b, sq, H], last dim contiguous
        s_ob, s_om,  # out [b, sq, sk], last dim contiguous
        H: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, PRECISE_ACC: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_b = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        m_ok = offs_m < SQ
        n_ok = offs_n < SK
        rows = offs_m.to(tl.int64)
        o_ptrs = o_ptr + pid_b * s_ob + rows[:, None] * s_om + offs_n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]

        if CAUSAL:
            last_key = q_offset + tl.minimum(pid_m * BLOCK_M + BLOCK_M, SQ) - 1
        else:
            last_key = SK
        if pid_n * BLOCK_N > last_key:
            neg = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
            tl.store(o_ptrs, neg, mask=o_mask)
        else:
            k = tl.load(k_ptr + pid_b * s_kb + offs_n[:, None].to(tl.int64) * s_kn + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)
            kt = tl.trans(k)  # [D, BLOCK_N]
            ks = tl.load(ks_ptr + pid_b * s_ksb + offs_n, mask=n_ok, other=0.0)
            q_ptrs = q_ptr + pid_b * s_qb + rows[:, None] * s_qm + offs_d[None, :]
            qs_ptrs = qs_ptr + pid_b * s_qsb + rows * s_qsm
            w_ptrs = w_ptr + pid_b * s_wb + rows * s_wm
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for h in range(H):
                q = tl.load(q_ptrs + h * s_qh, mask=m_ok[:, None], other=0.0)
                qs = tl.load(qs_ptrs + h, mask=m_ok, other=0.0)
                wh = tl.load(w_ptrs + h, mask=m_ok, other=0.0)
                if PRECISE_ACC:
                    s = tl.dot(q, kt, out_dtype=tl.float32, max_num_imprecise_acc=0)
                else:
                    s = tl.dot(q, kt, out_dtype=tl.float32)
                acc += (wh * qs)[:, None] * tl.maximum(s, 0.0)
            out = acc * ks[None, :]
            if CAUSAL:
                visible = offs_n[None, :] <= (q_offset + offs_m)[:, None]
                out = tl.where(visible, out, float("-inf"))
            tl.store(o_ptrs, out, mask=o_mask)


def _interpreted() -> bool:
    """True when @triton.jit built the kernel for the CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_fp8_index_kernel, InterpretedFunction)


def _scales_2d(scale: torch.Tensor, name: str) -> torch.Tensor:
    # quantize_fp8 gives [..., d // 128] = [..., 1] for d == 128; the kernel wants [...].
    if scale.shape[-1] != 1:
        raise ValueError(f"{name}: expected one scale per 128 values and d == 128, got {tuple(scale.shape)}")
    return scale.squeeze(-1).float().contiguous()


def fp8_index_logits_triton(q_fp8: torch.Tensor, q_scale: torch.Tensor, k_fp8: torch.Tensor,
                            k_scale: torch.Tensor, w: torch.Tensor, q_offset: int = 0,
                            causal: bool = True, out: torch.Tensor | None = None,
                            block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N,
                            num_warps: int = DEFAULT_NUM_WARPS,
                            num_stages: int = DEFAULT_NUM_STAGES,
                            precise_acc: bool = False) -> torch.Tensor:
    """FP8 indexer logits [b, sq, sk] fp32 (-inf above the causal diagonal).

    q_fp8 [b, sq, H, 128] e4m3, q_scale [b, sq, H, 1], k_fp8 [b, sk, 128] e4m3,
    k_scale [b, sk, 1], w [b, sq, H] fp32; q_offset is the absolute position of query row 0.
    `out` (optional) is written in place (any row stride, last dim contiguous)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    b, sq, H, d = q_fp8.shape
    sk = k_fp8.shape[1]
    if d != HEAD_DIM or tuple(k_fp8.shape) != (b, sk, d) or tuple(w.shape) != (b, sq, H):
        raise ValueError(f"expected q [b,sq,H,128], k [b,sk,128], w [b,sq,H]; got {tuple(q_fp8.shape)}, "
                         f"{tuple(k_fp8.shape)}, {tuple(w.shape)}")
    if q_fp8.dtype != torch.float8_e4m3fn or k_fp8.dtype != torch.float8_e4m3fn:
        raise TypeError(f"q and k must be float8_e4m3fn, got {q_fp8.dtype} and {k_fp8.dtype}")
    if q_fp8.stride(-1) != 1:
        q_fp8 = q_fp8.contiguous()
    if k_fp8.stride(-1) != 1:
        k_fp8 = k_fp8.contiguous()
    qs = _scales_2d(q_scale, "q_scale")
    ks = _scales_2d(k_scale, "k_scale")
    w = w.float()
    if w.stride(-1) != 1:
        w = w.contiguous()
    if out is None:
        out = torch.empty((b, sq, sk), dtype=torch.float32, device=q_fp8.device)
    elif out.shape != (b, sq, sk) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 [b, sq, sk] with a contiguous last dim, got {tuple(out.shape)}")
    if b == 0 or sq == 0 or sk == 0:
        return out
    if not q_fp8.is_cuda and not _interpreted():
        raise RuntimeError("the FP8 indexer kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "model_providers.glm5.model.dsa.kernels is first imported (CPU interpreter)")
    grid = (triton.cdiv(sk, block_n), triton.cdiv(sq, block_m), b)
    _fp8_index_kernel[grid](
        q_fp8, qs, k_fp8, ks, w, out,
        sq, sk, int(q_offset),
        q_fp8.stride(0), q_fp8.stride(1), q_fp8.stride(2),
        qs.stride(0), qs.stride(1),
        k_fp8.stride(0), k_fp8.stride(1),
        ks.stride(0),
        w.stride(0), w.stride(1),
        out.stride(0), out.stride(1),
        H=H, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), PRECISE_ACC=bool(precise_acc),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
