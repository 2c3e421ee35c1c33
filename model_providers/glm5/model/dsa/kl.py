"""The indexer's training signal: KL(target || softmax(I)), where the target is the main
attention distribution summed over heads and L1-normalised (all-reduced over the TP group, whose
ranks hold different heads). Dense form: over all keys a query sees (DSA warm-up). Sparse form:
over each query's selected keys (sparse training).

The KL is a scalar of small inputs (the indexer's q [b, s, H, d], k [b, L, d], w [b, s, H])
through large intermediates (scores of every query against its keys). So its gradients are
computed in the forward, one query chunk at a time, while each chunk's scores are at hand
(d logits = softmax(I) - target), and the backward only scales them: nothing of size
O(s * keys) is kept or recomputed, memory is O(chunk * L) (dense) or O(chunk * k) (sparse).
Dense chunks see only the keys their last query can see (no scores for future keys).

On GPUs the sparse form is one Triton kernel launch per chunk of ~1000 queries
(:func:`~.kernels.indexer_kl_triton.sparse_kl_triton`, ``triton=True``) instead of a Python loop
over chunks of ~10 queries, and the dense form's GEMMs run on TF32 tensor cores with fp32
accumulation (:func:`tensor_core_operand` says why TF32 and what it costs).
"""

from __future__ import annotations

import contextlib

import torch

from model_providers.glm5.model.dsa.indexer import causal_mask
from model_providers.glm5.model.dsa.kernels.dsa_cpu import cpu_kernel
from model_providers.glm5.model.dsa.kernels.indexer_kl_triton import sparse_kl_triton
from model_providers.glm5.model.dsa.sparse_attention import all_visible, rows_per_chunk, scatter_add_rows


def tensor_core_operand(x: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    """The values a TF32 tensor-core GEMM multiplies for fp32 ``x`` (fp32 storage): the mantissa
    cut to TF32's 10 explicit bits, rounded to nearest even (``truncate``: the low 13 bits
    dropped, the worse of the two ways hardware may read fp32 operands). The dense KL's GEMMs on
    CUDA run in TF32 with fp32 accumulation and fp32 outputs; on other devices ``dense_kl(...,
    tensor_cores=True)`` rounds its GEMM operands with this first, so CPU tests measure the same
    arithmetic up to summation order.

    Why TF32 rather than bf16 operands with fp32 outputs (``torch.bmm(..., out_dtype=float32)``):
    the model's q and k are bf16 values, exact in TF32 as in bf16, so the score GEMMs (the
    target's and the indexer's) multiply exactly either way; the gradient GEMMs multiply an fp32
    operand, d per_head, which TF32 rounds to 2^-11 relative and bf16 to 2^-8 (8x the error in
    dq and dk); TF32 needs no bf16 copies of the fp32 buffers the path already keeps, and no
    CUDA-only op (``bmm.dtype`` has no CPU kernel), so the same code runs, and is measured, on
    the CPU. It costs half bf16's tensor-core rate, still ~7x the fp32 CUDA cores' on an
    H100/H200, and the dense KL's passes over its scores are memory-bound besides.
    Measured against the fp32 GEMMs (``tests/unit/model/test_dsa_kl_triton.py``, 512 queries,
    8 heads x 256, GLM-5's indexer 32 x 128): bf16-valued inputs (the model's) keep the value and
    dw exactly (on a GPU up to the GEMMs' summation order) and err by 2e-4 relative in dq and dk
    (4e-4 if the hardware truncates instead of rounding), an order below the bf16 rounding
    (2^-8) the gradients get on their way to the bf16 parameters. fp32-valued
    inputs lose ~1e-5 in the value, ~4e-4 in dw and ~1e-2 in dq and dk (ReLU masks flip where a
    rounded score crosses 0)."""
    bits = x.float().contiguous().view(torch.int32)
    if not truncate:  # round half to even on the 13 bits that go (carries may reach the exponent)
        bits = bits + (0xFFF + ((bits >> 13) & 1))
    return (bits & ~0x1FFF).view(torch.float32)


@contextlib.contextmanager
def _tf32_matmuls():
    """fp32 matmuls on CUDA inside run on TF32 tensor cores; the previous setting comes back
    after. Set through the legacy ``allow_tf32`` flag: its setter keeps torch's two TF32 states
    (the legacy matmul precision and the per-backend ``fp32_precision``) in agreement, whereas
    setting ``matmul.fp32_precision`` alone leaves them disagreeing, and then every getter that
    compares them raises "you have used mix of the legacy and new APIs" -- cuBLAS's own
    ``allowTF32CuBLAS`` among them, at the first fp32 matmul. The per-backend value is put back
    too (it may have been ``none``, which the legacy setter would leave as ``ieee``)."""
    matmul = torch.backends.cuda.matmul
    allowed, precision = matmul.allow_tf32, matmul.fp32_precision  # raises if the caller mixed
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = allowed
        if matmul.fp32_precision != precision:
            matmul.fp32_precision = precision


class _Gemms:
    """How the dense KL runs its four large GEMMs (the target's scores, the indexer's per-head
    scores, dq, dk): IEEE fp32, or with ``tensor_cores`` TF32 operands and fp32 accumulation, on
    CUDA by enabling TF32 around each of them (only them: the head sums in ``_kl_and_grads``
    stay fp32), elsewhere by rounding their operands with :func:`tensor_core_operand` first."""

    def __init__(self, tensor_cores: bool, device: torch.device):
        self.on_tensor_cores = tensor_cores and device.type == "cuda"
        self.rounded = tensor_cores and not self.on_tensor_cores

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_core_operand(x) if self.rounded else x

    def scope(self):
        return _tf32_matmuls() if self.on_tensor_cores else contextlib.nullcontext()


_FP32_GEMMS = _Gemms(False, torch.device("cpu"))


def _kl_and_grads(per_head, w, target, hidden, want_grads: bool):
    """One chunk of rows: per_head [R, H, n] (q . k per indexer head; overwritten), w [R, H],
    target [R, n] (rows sum to 1, 0 at hidden keys), hidden [R, n] or None (every key
    visible) -> (sum of the rows' KL, d per_head [R, H, n] (in per_head's storage) or None,
    d w [R, H] or None)."""
    rows, heads, n = per_head.shape
    relu = per_head.relu_()
    logits = torch.bmm(w.view(rows, 1, heads), relu).view(rows, n)
    if hidden is not None:
        logits.masked_fill_(hidden, float("-inf"))
    # log_softmax subtracts the max first: log q keeps the precision of z - max, where z - lse
    # would round at lse's magnitude (an ulp of a logit of 50 is ~4e-6 in every term)
    logq = torch.log_softmax(logits, dim=-1)
    d_logits = logq.exp().sub_(target) if want_grads else None  # softmax - target (0 at hidden)
    if hidden is not None:
        logq.masked_fill_(hidden, 0.0)  # t = 0 there: no 0 x -inf
    # KL = sum t log t - t log q: per row first, so the sum over rows does not depend (beyond
    # the last bits of the KL) on which rows share a chunk
    value = torch.addcmul(torch.special.xlogy(target, target), target, logq, value=-1).sum(-1).sum()
    if not want_grads:
        return value, None, None
    d_w = torch.bmm(relu, d_logits.view(rows, n, 1)).view(rows, heads)
    # ReLU's gradient mask (relu > 0 where per_head > 0) times w x d_logits, in place
    d_per_head = relu.sign_().mul_(w.view(rows, heads, 1)).mul_(d_logits.view(rows, 1, n))
    return value, d_per_head, d_w


class _KLWithEagerGradients(torch.autograd.Function):
    """value = run(want_grads)[0]; its gradients w.r.t. (q, k, w) come from the same run."""

    @staticmethod
    def forward(ctx, run, q, k, w):
        value, grads = run(any(ctx.needs_input_grad[1:]))
        ctx.dtypes = (q.dtype, k.dtype, w.dtype)
        if grads is not None:
            ctx.save_for_backward(*grads)
        return value

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.saved_tensors
        return (None,) + tuple((g * grad).to(dt) for g, dt in zip(grads, ctx.dtypes))


def _grad_buffers(q, k, w, want: bool):
    if not want:
        return None, None, None
    f32 = dict(dtype=torch.float32, device=q.device)
    return torch.empty(q.shape, **f32), torch.zeros(k.shape, **f32), torch.empty(w.shape, **f32)


@torch.no_grad()
def dense_attention_target(query_sbnd, key_bnld, scale: float, lo: int, hi: int, hidden,
                           tp_group=None, buffer=None, first_hidden: int = 0, fused: bool = False,
                           gemms: _Gemms = _FP32_GEMMS):
    """Head-summed, normalised attention probabilities of query rows lo..hi-1 over the keys
    of ``key_bnld`` ([b, n, keys, D] fp32) with ``hidden`` [b or 1, c, keys] masked: [b, c, keys].
    ``buffer``: fp32 storage of at least b * n * c * keys elements for the scores (reused).
    ``first_hidden``: no key before it is hidden from any row (known on the host: the causal
    mask of a chunk without documents hides only keys after its first row), so the mask is
    applied from there on (the scores are n * c * keys elements, out of cache at long context:
    a pass over them costs as much as a quarter of their GEMM). ``fused``: the CPU kernel does
    everything after the GEMM in one pass, a row at a time. ``gemms``: the GEMM's precision
    (``key_bnld`` comes as the caller's ``gemms.operand`` left it), see ``dense_kl``."""
    q = gemms.operand(query_sbnd[lo:hi].permute(1, 2, 0, 3).float())  # [b, n, c, D]
    b, n, c, dim = q.shape
    shape = (b, n, c, key_bnld.shape[2])
    scores = q.new_empty(shape) if buffer is None else buffer[:b * n * c * shape[3]].view(shape)
    # the scale is the GEMM's alpha, applied to its fp32 result: bf16 queries stay exact for
    # tensor cores, and no scaled copy of q (beta = 0: the buffer's contents are not read)
    with gemms.scope():
        scores.view(b * n, c, shape[3]).baddbmm_(q.reshape(b * n, c, dim),
                                                 key_bnld.reshape(b * n, shape[3], dim).transpose(1, 2),
                                                 beta=0.0, alpha=scale)
    if fused:
        return _normalised(cpu_kernel().attention_target(scores, hidden, first_hidden), tp_group)
    if first_hidden < shape[3]:
        scores[..., first_hidden:].masked_fill_(hidden[:, None, :, first_hidden:], float("-inf"))
    # not torch.softmax: its CPU kernel's faster exp is biased by ~1e-7 per term, which the
    # KL near convergence (a difference of terms of ~1e-2) turns into ~1e-4 of its value
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # softmax in place
    return _normalised(scores.div_(scores.sum(dim=-1, keepdim=True)).sum(dim=1), tp_group)


def _normalised(probs, tp_group):
    """Head-summed probabilities [b, c, keys] of this rank's heads -> the L1-normalised sum over
    the TP group's heads."""
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(probs, group=tp_group)
    return probs / probs.sum(dim=-1, keepdim=True)


def dense_kl(iq, ik, iw, query_sbnd, key_sbnd, scale: float, chunk: int, tp_group=None,
             layout=None, fused: bool = False, tensor_cores: bool | None = None):
    """Mean over the queries of ``iq`` of the dense-form KL over the keys each query sees (per
    ``layout``: :class:`~.layout.TokenLayout`; None = causal, positions = row numbers).
    iq/ik/iw: indexer projections (gradients reach them only). The logits are fp32; the
    quantised indexer dtypes serve selection. ``fused``: the fused CPU kernel does the
    elementwise work between the GEMMs (the caller checked it is built and the tensors are on
    the CPU). ``tensor_cores`` (default: on CUDA with 16-bit attention inputs, whose values TF32
    holds exactly; fp32 training keeps fp32 GEMMs): the four large GEMMs take TF32 operands and
    accumulate in fp32, on CUDA's tensor cores or, elsewhere, on operands rounded by
    :func:`tensor_core_operand` first (what the tests measure); False keeps IEEE fp32 GEMMs."""
    b, s, heads, d = iq.shape
    if tensor_cores is None:
        tensor_cores = iq.is_cuda and query_sbnd.element_size() < 4
    gemms = _Gemms(tensor_cores, iq.device)

    def run(want_grads: bool):
        keys_all = gemms.operand(key_sbnd.detach().permute(1, 2, 0, 3).float().contiguous())  # [b, n, L, D]
        k = gemms.operand(ik.detach().float())
        dq, dk, dw = _grad_buffers(iq, ik, iw, want_grads)
        # reused: fresh chunk-sized results are fresh pages every chunk
        scores_buf = iq.new_empty(b * key_sbnd.shape[2] * min(chunk, s) * k.shape[1],
                                  dtype=torch.float32)
        per_head_buf = iq.new_empty(b * min(chunk, s) * heads * k.shape[1], dtype=torch.float32)
        total = iq.new_zeros((), dtype=torch.float32)
        for lo in range(0, s, chunk):
            hi = min(lo + chunk, s)
            c = hi - lo
            n = hi if layout is None else layout.keys_seen(lo, hi)
            hidden = (causal_mask(lo, c, n, iq.device)[None] if layout is None
                      else layout.hidden(lo, hi, n))
            first = _first_hidden(layout, lo)
            target = dense_attention_target(query_sbnd.detach(), keys_all[:, :, :n], scale, lo,
                                            hi, hidden, tp_group, scores_buf, first, fused, gemms)
            q_c = gemms.operand(iq[:, lo:hi].detach().float().reshape(b, c * heads, d))
            with gemms.scope():
                per_head = torch.bmm(q_c, k[:, :n].transpose(1, 2),
                                     out=per_head_buf[:b * c * heads * n].view(b, c * heads, n))
            per_head = per_head.view(b * c, heads, n)
            w_c = iw[:, lo:hi].detach().float().reshape(b * c, heads).contiguous()
            if fused:  # d per_head replaces per_head in its storage
                value, d_w = cpu_kernel().dense_kl_rows(per_head, w_c, target.reshape(b * c, n),
                                                        hidden, b, first, want_grads)
                d_ph = per_head
            else:
                value, d_ph, d_w = _kl_and_grads(per_head, w_c, target.view(b * c, n),
                                                 hidden.expand(b, c, n).reshape(b * c, n),
                                                 want_grads)
            total += value
            if want_grads:
                d_ph = gemms.operand(d_ph.view(b, c * heads, n))
                dw[:, lo:hi] = d_w.view(b, c, heads)
                with gemms.scope():
                    dq[:, lo:hi] = torch.bmm(d_ph, k[:, :n]).view(b, c, heads, d)
                    dk[:, :n].baddbmm_(d_ph.transpose(1, 2), q_c)
        return _mean(total, (dq, dk, dw), b * s, want_grads)

    return _KLWithEagerGradients.apply(run, iq, ik, iw)


def _first_hidden(layout, lo: int) -> int:
    """The first key that may be hidden from a row of the chunk starting at row ``lo``: the key
    after that row's position without documents (later rows see more), 0 with them."""
    if layout is None:
        return lo + 1
    if layout.doc_q is not None or layout.q_pos_host is None:
        return 0
    return int(layout.q_pos_host[lo]) + 1


def sparse_kl(iq, ik, iw, idx, valid, head_probs, chunk: int, tp_group=None, fused: bool = False,
              triton: bool = False):
    """Mean over the queries of ``iq``/``iw``/``idx`` of the sparse-form KL over each query's
    selected keys (``ik`` holds every key). ``head_probs`` (fp32, the main attention summed over
    this rank's heads) is overwritten by the target. ``fused``: the fused CPU kernel computes it
    (the caller checked it is built and the tensors are on the CPU). ``triton``: the Triton
    kernel does (CUDA tensors; q and k read in their own dtype, fp32 math: see its module); a
    row with no valid key then contributes 0 (the torch paths' target is 0/0 there)."""
    b, s, heads, d = iq.shape
    kk = idx.shape[-1]
    # the target is formed in head_probs' storage (nothing else reads it): at long context a
    # fresh [b, s, k] copy per step is page faults as much as arithmetic
    hidden = None if all_visible(valid) else ~valid
    target = head_probs.detach().float()
    if hidden is not None:
        target.masked_fill_(hidden, 0.0)
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(target, group=tp_group)
    target.div_(target.sum(dim=-1, keepdim=True))
    c_max = rows_per_chunk(kk, d, 4, chunk)

    def run_fused(want_grads: bool):
        total, dq, dk, dw = cpu_kernel().sparse_kl(
            iq.detach().float().contiguous(), ik.detach().float().contiguous(),
            iw.detach().float().contiguous(), idx, None if hidden is None else valid,
            target.contiguous(), want_grads)
        return _mean(total, (dq, dk, dw), b * s, want_grads)

    def run_triton(want_grads: bool):
        total, dq, dk, dw = sparse_kl_triton(iq.detach(), ik.detach(), iw.detach(), idx,
                                             None if hidden is None else valid, target, want_grads)
        return _mean(total, (dq, dk, dw), b * s, want_grads)

    def run(want_grads: bool):
        dq, dk, dw = _grad_buffers(iq, ik, iw, want_grads)
        total = iq.new_zeros((), dtype=torch.float32)
        k = ik.detach().float()
        rows_buf = k.new_empty(c_max * kk, d)  # reused: see dense_kl
        contribution_buf = k.new_empty(c_max, kk, d)
        for bi in range(b):
            for lo in range(0, s, c_max):
                hi = min(lo + c_max, s)
                c = hi - lo
                k_sel = torch.index_select(k[bi], 0, idx[bi, lo:hi].reshape(-1),
                                           out=rows_buf[:c * kk]).view(c, kk, d)
                q_c = iq[bi, lo:hi].detach().float()  # [c, H, d]
                per_head = torch.bmm(q_c, k_sel.transpose(1, 2))  # [c, H, k]
                value, d_ph, d_w = _kl_and_grads(per_head, iw[bi, lo:hi].detach().float(),
                                                 target[bi, lo:hi],
                                                 None if hidden is None else hidden[bi, lo:hi],
                                                 want_grads)
                total += value
                if want_grads:
                    dw[bi, lo:hi] = d_w
                    dq[bi, lo:hi] = torch.bmm(d_ph, k_sel)
                    scatter_add_rows(dk[bi], idx[bi, lo:hi], torch.bmm(d_ph.transpose(1, 2), q_c,
                                                                       out=contribution_buf[:c]))
        return _mean(total, (dq, dk, dw), b * s, want_grads)

    return _KLWithEagerGradients.apply(run_triton if triton else run_fused if fused else run, iq, ik, iw)


def _mean(total, grads, count: int, want_grads: bool):
    if not want_grads:
        return total / count, None
    return total / count, tuple(g.div_(count) for g in grads)
