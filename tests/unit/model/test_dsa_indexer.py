"""The lightning indexer against the DSA formula computed naively, chunked vs unchunked, and the
deterministic top-k (same indices across runs and chunk sizes; ties by position), and its RoPE
(plain, and YaRN equal to megatron's MLA rotary)."""

import pytest
import torch

from model_providers.glm5.model.dsa.indexer import index_logits, select_topk
from model_providers.glm5.model.dsa.rope import apply_rope, rope_cos_sin, yarn_inv_freq
from model_providers.glm5.model.dsa.topk import topk_indices


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
    # BLAS may block the chunks' GEMMs (other row counts) otherwise than the whole one: each
    # evaluation of sum_h w_h relu(q_h . k) is off by at most gamma_d sum_h |w_h| |q_h| . |k| (the
    # dot products) + gamma_h sum_h |w_h relu(q_h . k)| (the head sum), gamma_n = n u / (1 - n u)
    u = 2.0 ** -24
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    dots = torch.einsum("bshd,bld->bshl", q.abs(), k.abs())
    sums = torch.einsum("bsh,bshl->bsl", w.abs(), dots)
    heads_sum = torch.einsum("bsh,bshl->bsl", w.abs(), torch.einsum("bshd,bld->bshl", q, k).relu())
    bound = 2 * (gamma(d) * sums + gamma(h) * heads_sum)  # two evaluations, either side
    for chunk in (1, 4, 7):
        parts = [index_logits(q[:, lo:lo + chunk], k, w[:, lo:lo + chunk], lo) for lo in range(0, s, chunk)]
        chunked = torch.cat(parts, 1)
        assert torch.equal(torch.isfinite(chunked), finite)
        assert bool(((chunked - full)[finite].abs() <= bound[finite]).all()), chunk


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


@pytest.mark.parametrize("fused", [False, True])
def test_topk_breaks_ties_by_position(fused):
    scores = torch.tensor([[0.0, 5.0, 1.0, 1.0, 1.0, 1.0, float("-inf"), float("-inf")]])
    assert topk_indices(scores, 3, fused).tolist() == [[1, 2, 3]]
    assert topk_indices(scores, 7, fused).tolist() == [[0, 1, 2, 3, 4, 5, 6]]
    zeros = torch.zeros(2, 9)
    assert topk_indices(zeros, 4, fused).tolist() == [[0, 1, 2, 3]] * 2


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
    from model_providers.glm5.model.dsa.hadamard import hadamard_rotate

    dim = 16
    H = torch.tensor([[1.0]])
    while H.shape[0] < dim:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    x = torch.randn(3, 5, dim, generator=torch.Generator().manual_seed(0))
    # each output is a +-1 sum of the dim inputs, scaled: off by at most gamma_dim sum|x| (+ the
    # scaling's rounding) whichever order the butterfly or the GEMM adds in; twice for two sides
    u = 2.0 ** -24
    bound = 2 * (dim + 1) * u * x.abs().sum(-1, keepdim=True) / dim ** 0.5
    y = hadamard_rotate(x)
    assert bool(((y - x @ H.T / dim ** 0.5).abs() <= bound).all())
    # twice: the second rotation's own error, and the first's carried through an orthonormal map
    # (an error e becomes He, each entry at most sum|e| / sqrt(dim) <= sqrt(dim) max|e|)
    twice = (dim + 1) * u * (y.abs().sum(-1, keepdim=True) + x.abs().sum(-1, keepdim=True)) / dim ** 0.5 * dim ** 0.5
    assert bool(((hadamard_rotate(y) - x).abs() <= twice).all())
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.randn(2, 12))


def _megatron_yarn(dim, theta, y):
    """megatron's own YarnRotaryEmbedding (the MLA rotary) for these settings."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    from parallel.megatron_compat import cpu_emulation

    if not torch.cuda.is_available():
        cpu_emulation.install()  # get_emb moves its frequencies to torch.cuda.current_device()
    return YarnRotaryEmbedding(
        dim, rotary_base=theta, use_cpu_initialization=True, scaling_factor=y.factor,
        original_max_position_embeddings=y.original_max_position_embeddings, beta_fast=y.beta_fast,
        beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)


@pytest.mark.parametrize("dim, theta, yarn", [
    (8, 1e4, dict(factor=4.0, original_max_position_embeddings=64)),  # cos/sin scale 0.1 ln 4 + 1
    (8, 1e4, dict(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)),
    (64, 1e6, dict(factor=8.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=0.707)),
])
def test_indexer_yarn_rope_equals_megatrons_mla_rotary(dim, theta, yarn):
    """The indexer's YaRN cos/sin are megatron's YarnRotaryEmbedding's (the MLA rotary, as HF feeds
    its indexer the model's cos/sin): the same fp32 frequencies bit for bit, the same scale, and
    cos/sin within the rounding of megatron's fp32 angles at positions up to 4x the original
    context. YaRN must differ from plain RoPE there, or this proves nothing."""
    from model_providers.glm5.model.config import YarnConfig

    y = YarnConfig(**yarn)
    orig = y.original_max_position_embeddings
    rot = _megatron_yarn(dim, theta, y)
    emb, mscale = rot.get_emb(4 * orig)  # [L, 1, 1, dim]: angles (fp32), twice over
    cos_mla, sin_mla = rot.get_cached_cos_sin(4 * orig, dtype=torch.float32)  # what MLA applies
    pos = torch.tensor([0, 1, 5, orig - 1, orig, orig + 3, 2 * orig + 1, 4 * orig - 1])
    inv_freq, scale = yarn_inv_freq(dim, theta, y)
    assert torch.equal(inv_freq, emb[1, 0, 0, : dim // 2]) and scale == mscale
    cos, sin = rope_cos_sin(pos, dim, theta, yarn=y)
    # megatron rounds each angle (< 4 * orig rad) to fp32: |error| <= angle * 2^-24, times the scale
    atol = 4 * orig * 2.0 ** -24 * scale + 1e-7
    torch.testing.assert_close(cos, cos_mla[pos, 0, 0, : dim // 2], rtol=0, atol=atol)
    torch.testing.assert_close(sin, sin_mla[pos, 0, 0, : dim // 2], rtol=0, atol=atol)
    plain_cos, _ = rope_cos_sin(pos, dim, theta)
    assert (cos - plain_cos).abs().max() > 0.1


def test_yarn_with_factor_one_is_plain_rope():
    """YaRN at factor 1 (no extension; validation forbids it, the formula must still degenerate)
    gives plain RoPE, and plain RoPE is unchanged: fp64 angles of theta^(-2i/dim)."""
    from model_providers.glm5.model.config import YarnConfig

    pos = torch.tensor([0, 3, 100, 5000, 70000])
    inv = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    cos, sin = rope_cos_sin(pos, 16, 1e6)
    assert torch.equal(cos, (pos.double()[:, None] * inv).cos().float())
    assert torch.equal(sin, (pos.double()[:, None] * inv).sin().float())
    y = YarnConfig(factor=1.0, original_max_position_embeddings=64, mscale=0.5, mscale_all_dim=1.0)
    inv_yarn, scale = yarn_inv_freq(16, 1e6, y)
    assert scale == 1.0 and float(((inv_yarn.double() - inv) / inv).abs().max()) <= 2.0 ** -23
    ycos, ysin = rope_cos_sin(pos, 16, 1e6, yarn=y)
    # the only difference: YaRN's frequencies are megatron's fp32 ones, so angles differ by <= 2^-23
    bound = (pos.double()[:, None] * inv * 2.0 ** -23 + 1e-7).float()
    assert bool(((ycos - cos).abs() <= bound).all()) and bool(((ysin - sin).abs() <= bound).all())
