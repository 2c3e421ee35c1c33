"""Sparse MLA (absorbed form) against plain references: a masked dense softmax over the same
selected keys (k < L), and ordinary dense MLA attention with per-head keys/values (k >= L)."""

import pytest
import torch
import torch.nn.functional as F

from model_providers.glm5.dsa.indexer import select_topk
from model_providers.glm5.dsa.sparse_attention import sparse_latent_attention
from model_providers.glm5.dsa.topk import topk_indices

torch.set_default_dtype(torch.float32)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _masked_dense_reference(q, kv, idx, valid, scale, dv):
    """softmax over ALL keys with everything outside the selected (valid) set masked."""
    b, s, n, _ = q.shape
    L = kv.shape[1]
    allowed = torch.zeros(b, s, L, dtype=torch.bool)
    allowed.scatter_(-1, idx, valid)
    scores = torch.einsum("bsnd,bld->bsnl", q, kv) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    p = scores.softmax(-1)
    return torch.einsum("bsnl,bld->bsnd", p, kv[..., :dv]), p.sum(2)


def _random_selection(b, s, L, k, gen):
    scores = torch.randn(b, s, L, generator=gen)
    causal = torch.arange(L)[None, None, :] > torch.arange(s)[None, :, None]
    idx = topk_indices(scores.masked_fill(causal, float("-inf")), k)
    return idx, idx <= torch.arange(s)[None, :, None]


@pytest.mark.parametrize("b,s,n,lora,rope,k,chunk", [
    (1, 40, 4, 32, 8, 8, 16),
    (2, 33, 3, 48, 16, 12, 7),
    (1, 64, 2, 64, 8, 20, 64),
])
def test_sparse_equals_masked_dense_forward_and_grads(b, s, n, lora, rope, k, chunk):
    gen = torch.Generator().manual_seed(s * n + k)
    D = lora + rope
    q = torch.randn(b, s, n, D, generator=gen, requires_grad=True)
    kv = torch.randn(b, s, D, generator=gen, requires_grad=True)
    idx, valid = _random_selection(b, s, s, k, gen)
    scale = D ** -0.5
    out, probs = sparse_latent_attention(q, kv, idx, valid, scale, lora, chunk)
    ref, ref_probs = _masked_dense_reference(q, kv, idx, valid, scale, lora)
    assert _rel(out, ref) <= 1e-5
    assert _rel(probs, ref_probs.gather(-1, idx) * valid) <= 1e-5
    grad = torch.randn(out.shape, generator=gen)
    gq, gkv = torch.autograd.grad(out, (q, kv), grad)
    rq, rkv = torch.autograd.grad(ref, (q, kv), grad)
    assert _rel(gq, rq) <= 1e-5 and _rel(gkv, rkv) <= 1e-5


@pytest.mark.parametrize("s,n,nope,rope,dv,lora", [(24, 4, 12, 8, 16, 20), (37, 2, 24, 8, 32, 32)])
def test_topk_at_least_length_equals_dense_mla(s, n, nope, rope, dv, lora):
    """With k >= L every causal key is selected: the absorbed sparse path must equal ordinary
    MLA attention (per-head K = [c W_UK^T, k_pe], V = c W_UV^T, causal SDPA)."""
    gen = torch.Generator().manual_seed(7)
    q_nope = torch.randn(s, n, nope, generator=gen, requires_grad=True)
    q_pe = torch.randn(s, n, rope, generator=gen, requires_grad=True)
    c = torch.randn(s, lora, generator=gen, requires_grad=True)
    k_pe = torch.randn(s, rope, generator=gen, requires_grad=True)
    w_uk = torch.randn(n, nope, lora, generator=gen) * lora ** -0.5
    w_uv = torch.randn(n, dv, lora, generator=gen) * lora ** -0.5
    w_uk.requires_grad_(), w_uv.requires_grad_()
    scale = (nope + rope) ** -0.5

    keys = torch.cat([torch.einsum("lc,ndc->nld", c, w_uk), k_pe[None].expand(n, s, rope)], -1)
    values = torch.einsum("lc,nvc->nlv", c, w_uv)
    query = torch.cat([q_nope, q_pe], -1).transpose(0, 1)
    dense = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)

    idx, valid = select_topk(torch.randn(1, s, 2, 4, generator=gen), torch.randn(1, s, 4, generator=gen),
                             torch.randn(1, s, 2, generator=gen), topk=s + 5, chunk=8)
    assert idx.shape[-1] == s and bool((valid.sum(-1) == torch.arange(1, s + 1)).all())
    q_abs = torch.cat([torch.einsum("snd,ndc->snc", q_nope, w_uk), q_pe], -1)[None]
    kv = torch.cat([c, k_pe], -1)[None]
    o_lat, _ = sparse_latent_attention(q_abs, kv, idx, valid, scale, lora, chunk=5)
    sparse = torch.einsum("bsnc,nvc->bnsv", o_lat, w_uv)[0]
    assert _rel(sparse, dense) <= 1e-5

    grad = torch.randn(dense.shape, generator=gen)
    leaves = (q_nope, q_pe, c, k_pe, w_uk, w_uv)
    for g_sparse, g_dense in zip(torch.autograd.grad(sparse, leaves, grad),
                                 torch.autograd.grad(dense, leaves, grad)):
        assert _rel(g_sparse, g_dense) <= 1e-5


def test_memory_is_linear_in_k_not_length():
    """Nothing of size s x L is saved for backward: saved tensors are O(s*k + L*D + s*n*D)."""
    s, n, D, lora, k = 256, 2, 24, 16, 8
    q = torch.randn(1, s, n, D, requires_grad=True)
    kv = torch.randn(1, s, D, requires_grad=True)
    idx, valid = _random_selection(1, s, s, k, torch.Generator().manual_seed(0))
    out, _ = sparse_latent_attention(q, kv, idx, valid, 0.2, lora, 32)
    saved = out.grad_fn.saved_tensors
    assert max(t.numel() for t in saved) <= max(s * n * D, s * k)
    assert all(t.numel() < s * s for t in saved)
