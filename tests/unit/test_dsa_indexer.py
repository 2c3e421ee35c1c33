"""The lightning indexer against the DSA formula computed naively, chunked vs unchunked, and the
deterministic top-k (same indices across runs and chunk sizes; ties by position)."""

import pytest
import torch
import torch.nn.functional as F

from model_providers.glm5.dsa.indexer import index_logits, select_topk
from model_providers.glm5.dsa.rope import apply_rope, rope_cos_sin
from model_providers.glm5.dsa.topk import topk_indices


def _naive_scores(q, k, w):
    b, s, h, d = q.shape
    out = torch.full((b, s, k.shape[1]), float("-inf"))
    for bi in range(b):
        for t in range(s):
            for j in range(t + 1):
                out[bi, t, j] = sum(w[bi, t, hh] * max(0.0, float(q[bi, t, hh] @ k[bi, j]))
                                    for hh in range(h))
    return out


def test_index_logits_match_naive_formula_and_chunking():
    gen = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 13, 3, 8
    q, k, w = torch.randn(b, s, h, d, generator=gen), torch.randn(b, s, d, generator=gen), torch.randn(b, s, h, generator=gen)
    naive = _naive_scores(q, k, w)
    full = index_logits(q, k, w, 0)
    finite = torch.isfinite(naive)
    assert torch.equal(finite, torch.isfinite(full))
    assert torch.allclose(full[finite], naive[finite], rtol=1e-5, atol=1e-5)
    for chunk in (1, 4, 7):
        parts = [index_logits(q[:, lo:lo + chunk], k, w[:, lo:lo + chunk], lo) for lo in range(0, s, chunk)]
        chunked = torch.cat(parts, 1)  # BLAS blocking may differ with the row count: ~1 ulp
        assert torch.equal(torch.isfinite(chunked), finite)
        assert torch.allclose(chunked[finite], full[finite], rtol=1e-6, atol=1e-6)


def test_topk_identical_across_runs_and_chunk_sizes():
    gen = torch.Generator().manual_seed(11)
    b, s, h, d, kk = 1, 97, 4, 16, 10
    q, k, w = torch.randn(b, s, h, d, generator=gen), torch.randn(b, s, d, generator=gen), torch.randn(b, s, h, generator=gen)
    ref_idx, ref_valid = select_topk(q, k, w, kk, chunk=97)
    for chunk in (1, 8, 33, 97):
        idx, valid = select_topk(q, k, w, kk, chunk=chunk)
        assert torch.equal(idx, ref_idx) and torch.equal(valid, ref_valid)
    scores = index_logits(q, k, w, 0)
    for t in (kk, 50, 96):  # selected keys are the top-k scores of that row
        chosen = scores[0, t, ref_idx[0, t]]
        assert chosen.min() >= scores[0, t].masked_fill(
            torch.zeros(s, dtype=torch.bool).index_fill(0, ref_idx[0, t], True), float("-inf")).max()
    assert bool((ref_valid.sum(-1)[0, :kk] == torch.arange(1, kk + 1)).all())


def test_topk_breaks_ties_by_position():
    scores = torch.tensor([[0.0, 5.0, 1.0, 1.0, 1.0, 1.0, float("-inf"), float("-inf")]])
    assert topk_indices(scores, 3).tolist() == [[1, 2, 3]]
    assert topk_indices(scores, 7).tolist() == [[0, 1, 2, 3, 4, 5, 6]]
    zeros = torch.zeros(2, 9)
    assert topk_indices(zeros, 4).tolist() == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_is_a_rotation_with_relative_positions(interleaved):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    cos, sin = rope_cos_sin(torch.arange(40), 16, 10000.0)
    rx = lambda v, p: apply_rope(v, cos[p], sin[p], interleaved)
    assert torch.allclose(rx(x, 7).norm(), x.norm(), rtol=1e-6)
    assert torch.allclose(rx(x, 9) @ rx(y, 4), rx(x, 30) @ rx(y, 25), rtol=1e-4, atol=1e-5)
    if interleaved:  # pairs (x0, x1): rotating by angle a maps x0 -> x0 cos a - x1 sin a
        a = 3 * 1.0
        assert torch.allclose(rx(x, 3)[0], x[0] * torch.cos(torch.tensor(a)) - x[1] * torch.sin(torch.tensor(a)), atol=1e-6)


def test_hadamard_rotation_is_orthonormal_and_matches_matrix():
    from model_providers.glm5.dsa.hadamard import hadamard_rotate

    dim = 16
    H = torch.tensor([[1.0]])
    while H.shape[0] < dim:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    x = torch.randn(3, 5, dim)
    assert torch.allclose(hadamard_rotate(x), x @ H.T / dim ** 0.5, atol=1e-6)
    assert torch.allclose(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.randn(2, 12))
