"""FP8 scoring for the DSA lightning indexer: blockwise e4m3 quantisation, the torch reference of
the FP8 logits, and `index_logits`, the entry point the indexer module calls.

Score (docs/dsa.md), batch-first shapes:
    q [b, sq, H, d], k [b, sk, d] (one key per token, shared by the heads), w [b, sq, H] fp32
    I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s))  -> logits [b, sq, sk] fp32
w already carries the H^-0.5 * d^-0.5 scale. Causal: key s is visible to the query at absolute
position q_offset + t only when s <= q_offset + t; the others are -inf.

Quantisation (DeepSeek style): one fp32 scale per 128 contiguous values along the head dim (per
token and head for q, per token for k), scale = max(amax, 1e-4) / 448, values x / scale cast to
float8_e4m3fn (round to nearest even, clamped to +-448). `pow2_scales=True` rounds each scale UP
to a power of two (UE8M0 scales, as DeepSeek-V3.2 does), so scaled values stay within +-448.

Error bound (checked elementwise by tests/unit/model/test_dsa_fp8.py)
---------------------------------------------------------------
e4m3 has 3 mantissa bits. For a scaled value y = x / s with |y| >= 2^-6 (normal range) round to
nearest is off by at most half an ulp, 2^(e-4) for |y| in [2^e, 2^(e+1)): relative error
u = 2^-4. Below 2^-6 (subnormals, spacing 2^-9) the error is at most 2^-10 absolute. Hence,
for every element of q and k, with its block scale s:
    |x_hat - x| <= e(x) := u*|x| + 2^-10 * s                     (u = 2^-4 + 2^-22)
(the 2^-22 covers the fp32 roundings of x / s and x_fp8 * s, both exact with pow2 scales).
The per-128 scale makes the subnormal term tiny next to the block's largest value:
2^-10 * s = amax * 2^-10 / 448 ~ 2.2e-6 * amax (4.4e-6 * amax with pow2 scales).
A dot product then errs by
    |q_hat . k_hat - q . k| <= sum_i e(q_i)|k_i| + |q_i| e(k_i) + e(q_i) e(k_i)
                             = sum_i (|q_i| + e(q_i)) (|k_i| + e(k_i)) - |q_i||k_i|
                            ~= (2u + u^2) sum_i |q_i k_i| = 0.129 * sum_i |q_i k_i|,
ReLU is 1-Lipschitz, so the logit errs by at most sum_j |w_j| times the head's dot bound:
    |I_fp8 - I_fp32| <= sum_j |w_j| sum_i [(|q_ji| + e(q_ji)) (|k_i| + e(k_i)) - |q_ji||k_i|]
                        + 2 * (d + H + 2) * 2^-24 * sum_j |w_j| sum_i (|q_ji| + e(q_ji)) (|k_i| + e(k_i))
The second line is slack for fp32 rounding in both computations (sums of d products and H
heads). `fp8_logits_error_bound` evaluates this bound. It is a worst case (every element at the
worst rounding point, all errors aligned): on Gaussian data the largest observed error is ~4% of
it, and the mean error is ~3.5% of the mean |logit|. Per element the 2^-4 is tight: random
values reach > 0.9 * 2^-4 relative error.

The bf16 path (q, k rounded to bf16, bf16 matmul output, fp32 weighted head sum) has the same
form of bound with u = 2^-8 for the inputs plus 2^-8 relative for the rounded matmul output.
"""

from __future__ import annotations

import torch

from parallel.device import on_gpu

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
QUANT_BLOCK = 128  # values per scale along the head dim
AMAX_EPS = 1e-4  # amax floor (as DeepSeek's act_quant): all-zero blocks get a finite scale
FP8_REL_ERR = 2.0**-4  # half-ulp relative error with 3 mantissa bits (normal range)
_FP32_SCALING_ERR = 2.0**-22  # fp32 rounding of x / scale and x_fp8 * scale (0 for pow2 scales)
FP8_SUBNORMAL_ABS_ERR = 2.0**-10  # half the subnormal spacing 2^-9, in units of the scale
_FP32_EPS = 2.0**-24
_CHUNK_BYTES = 1 << 28  # torch paths: ~256 MiB for the [b, chunk, H, sk] intermediate


def quantize_fp8(x: torch.Tensor, pow2_scales: bool = False, block: int = QUANT_BLOCK):
    """Blockwise e4m3 quantisation along the last dim.

    x [..., d] (d a multiple of `block`) -> (x_fp8 [..., d] float8_e4m3fn, scale [..., d // block]
    fp32) with x ~= x_fp8 * scale (each scale repeated over its block)."""
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"last dim {d} is not a multiple of the quantisation block {block}")
    xb = x.float().unflatten(-1, (d // block, block))
    amax = xb.abs().amax(dim=-1).clamp_min(AMAX_EPS)
    scale = amax / FP8_MAX
    if pow2_scales:
        # Round UP to a power of two, exactly: frexp gives scale = m * 2^e, m in [0.5, 1).
        m, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(m == 0.5, e - 1, e))
    xq = (xb / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq.flatten(-2), scale


def dequantize_fp8(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_fp8` in fp32 (x_fp8 [..., d], scale [..., d // block])."""
    nb = scale.shape[-1]
    xb = x_fp8.float().unflatten(-1, (nb, x_fp8.shape[-1] // nb))
    return (xb * scale.unsqueeze(-1)).flatten(-2)


def quantization_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound e(x) = (2^-4 + 2^-22) |x| + 2^-10 * scale on |dequant(quant(x)) - x|."""
    nb = scale.shape[-1]
    s = scale.unsqueeze(-1).expand(*scale.shape, x.shape[-1] // nb).flatten(-2)
    return (FP8_REL_ERR + _FP32_SCALING_ERR) * x.float().abs() + FP8_SUBNORMAL_ABS_ERR * s


def _causal_mask_(logits: torch.Tensor, q_offset: int) -> torch.Tensor:
    sq, sk = logits.shape[-2:]
    t = torch.arange(sq, device=logits.device).unsqueeze(1) + q_offset
    s = torch.arange(sk, device=logits.device).unsqueeze(0)
    return logits.masked_fill_(s > t, float("-inf"))


def _visible_keys(sk: int, sq: int, q_offset: int, causal: bool) -> int:
    return min(sk, q_offset + sq) if causal else sk


def _weighted_relu_logits(q, k, w, q_offset: int, causal: bool, mm_dtype=None) -> torch.Tensor:
    """sum_j w_j ReLU(q_j . k) for one query chunk, fp32 out; keys past the causal limit are
    not computed. mm_dtype=bfloat16 rounds q, k and the matmul output to bf16 (on CPU emulated
    exactly by fp32 math on bf16-rounded values, since CPU bf16 matmul is very slow)."""
    b, sq, H, d = q.shape
    sk = k.shape[1]
    n = _visible_keys(sk, sq, q_offset, causal)
    out = torch.full((b, sq, sk), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    kt = k[:, :n].transpose(1, 2)  # [b, d, n]
    if mm_dtype is None:
        s = torch.matmul(q.float().reshape(b, sq * H, d), kt.float())
    elif on_gpu(q):
        s = torch.matmul(q.to(mm_dtype).reshape(b, sq * H, d), kt.to(mm_dtype))
    else:
        s = torch.matmul(q.to(mm_dtype).float().reshape(b, sq * H, d), kt.to(mm_dtype).float())
        s = s.to(mm_dtype)
    s = s.view(b * sq, H, n).relu_()
    # fp32 weighted head sum as a batched [1, H] x [H, n] product.
    logits = torch.bmm(w.float().reshape(b * sq, 1, H), s.float()).view(b, sq, n)
    out[:, :, :n] = logits
    if causal:
        _causal_mask_(out, q_offset)
    return out


def _chunked(fn, rows: tuple, q_offset: int, sk: int, chunk_size: int | None) -> torch.Tensor:
    """Run fn(*row_chunks, offset) over query chunks of the query-aligned tensors `rows`
    (rows[0] is q [b, sq, H, d]) and assemble the [b, sq, sk] logits."""
    b, sq, H = rows[0].shape[:3]
    c = chunk_size or max(1, _CHUNK_BYTES // max(1, b * H * sk * 4))
    if c >= sq:
        return fn(*rows, q_offset)
    out = torch.empty((b, sq, sk), dtype=torch.float32, device=rows[0].device)
    for i in range(0, sq, c):
        out[:, i : i + c] = fn(*(r[:, i : i + c] for r in rows), q_offset + i)
    return out


def fp8_logits_reference(q_fp8, q_scale, k_fp8, k_scale, w, q_offset: int = 0,
                         causal: bool = True, chunk_size: int | None = None) -> torch.Tensor:
    """Torch reference of the FP8 indexer (what the Triton kernel must reproduce): q, k
    dequantised blockwise to fp32, dot products, ReLU and the w-weighted head sum in fp32.
    q_fp8 [b, sq, H, d], q_scale [b, sq, H, d // 128], k_fp8 [b, sk, d], k_scale [b, sk, d // 128]."""
    kd = dequantize_fp8(k_fp8, k_scale)

    def one(qc, qsc, wc, off):
        return _weighted_relu_logits(dequantize_fp8(qc, qsc), kd, wc, off, causal)

    return _chunked(one, (q_fp8, q_scale, w), q_offset, k_fp8.shape[1], chunk_size)


def fp8_logits_error_bound(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                           pow2_scales: bool = False) -> torch.Tensor:
    """The documented elementwise bound on |I_fp8 - I_fp32| (see module docstring), [b, sq, sk]
    (no causal mask; small sizes only, it materialises [b, sq, H, sk])."""
    H, d = q.shape[-2:]
    qa, ka = q.float().abs(), k.float().abs()
    eq = quantization_error_bound(q, quantize_fp8(q, pow2_scales)[1])
    ek = quantization_error_bound(k, quantize_fp8(k, pow2_scales)[1])
    hi = torch.einsum("bthd,bsd->bths", qa + eq, ka + ek)  # sum_i (|q|+e)(|k|+e)
    lo = torch.einsum("bthd,bsd->bths", qa, ka)
    wa = w.float().abs().unsqueeze(-1)
    quant = ((hi - lo) * wa).sum(2)
    slack = 2 * (d + H + 2) * _FP32_EPS * (hi * wa).sum(2)
    return quant + slack


def index_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, q_offset: int = 0,
                 dtype: str = "fp8", causal: bool = True, pow2_scales: bool = True,
                 backend: str = "auto", chunk_size: int | None = None) -> torch.Tensor:
    """Lightning-indexer logits [b, sq, sk] fp32 (-inf where causally masked).

    q [b, sq, H, d], k [b, sk, d], w [b, sq, H] (scale included); q_offset is the absolute
    position of q's first row. dtype: "fp32" plain fp32 math; "bf16" q, k cast to bf16, bf16
    matmul, fp32 weighted ReLU sum; "fp8" blockwise e4m3 q and k (`pow2_scales`), fp32 scales
    and accumulation. backend (fp8 only): "auto" = the Triton kernel when q is on CUDA (compute
    capability >= 8.9) and triton imports, else the torch reference; "torch"; "triton" (also on
    CPU tensors when TRITON_INTERPRET=1 was set before the kernel module was imported).
    chunk_size: queries per step of the torch paths (default: ~256 MiB intermediates)."""
    if q.dim() != 4 or k.dim() != 3 or w.dim() != 3:
        raise ValueError(f"expected q [b,sq,H,d], k [b,sk,d], w [b,sq,H]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(w.shape)}")
    b, sq, H, d = q.shape
    if k.shape[0] != b or k.shape[2] != d or tuple(w.shape) != (b, sq, H):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)}")
    sk = k.shape[1]
    if dtype == "fp32":
        return _chunked(lambda qc, wc, off: _weighted_relu_logits(qc, k, wc, off, causal),
                        (q, w), q_offset, sk, chunk_size)
    if dtype == "bf16":
        return _chunked(lambda qc, wc, off: _weighted_relu_logits(qc, k, wc, off, causal,
                                                                  torch.bfloat16),
                        (q, w), q_offset, sk, chunk_size)
    if dtype != "fp8":
        raise ValueError(f"dtype must be 'fp8', 'bf16' or 'fp32', got {dtype!r}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return fp8_logits_quantised_keys(q, *quantize_fp8(k, pow2_scales), w, q_offset, causal,
                                     pow2_scales, backend, chunk_size)


def fp8_logits_quantised_keys(q, k8, ks, w, q_offset: int = 0, causal: bool = True,
                              pow2_scales: bool = True, backend: str = "auto",
                              chunk_size: int | None = None) -> torch.Tensor:
    """`index_logits` (fp8) with keys quantised by the caller (``quantize_fp8(k, pow2_scales)``),
    so a layer quantises its keys once for all its query chunks."""
    q8, qs = quantize_fp8(q, pow2_scales)
    if backend == "auto":
        backend = "triton" if _triton_usable(q) else "torch"
    if backend == "triton":
        from .kernels.indexer_fp8_triton import fp8_index_logits_triton

        return fp8_index_logits_triton(q8, qs, k8, ks, w, q_offset, causal)
    return fp8_logits_reference(q8, qs, k8, ks, w, q_offset, causal, chunk_size)


def _triton_usable(q: torch.Tensor) -> bool:
    if not on_gpu(q) or q.shape[-1] != QUANT_BLOCK:
        return False
    if torch.cuda.get_device_capability(q.device) < (8, 9):  # no e4m3 tensor cores before Ada
        return False
    from .kernels.indexer_fp8_triton import HAVE_TRITON

    return HAVE_TRITON
