"""The fused C++ sparse MLA (``dsa/kernels/sparse_mla_cpu``) equals the op-by-op torch path
(``dsa/sparse_attention``): output, head probabilities and both gradients, with hidden keys and
without, fp32 and bf16, key counts that are not a multiple of the key block; it is bitwise
deterministic; o comes head-major (dO in any layout); and ``model.dsa.kernels=auto`` runs it in the DSA layer on CPU with the same
outputs and gradients as ``kernels=torch`` on packed documents."""

import pytest
import torch

import model_providers.glm5.dsa.attention as attention
from model_providers.glm5.dsa.kernels import sparse_mla_cpu as fused
from model_providers.glm5.dsa.sparse_attention import SparseLatentAttention
from tests.unit.test_dsa_layer import outputs_per_kernel_choice

N, D, DV = 4, 40, 32  # heads, latent + rope, latent (values)


def _inputs(b, s, L, k, dtype, hidden: bool, seed=0, heads=N, d=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, heads, d, generator=g).to(dtype)
    kv = torch.randn(b, L, d, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(L, generator=g)[:k] for _ in range(b * s)]).view(b, s, k)
    if hidden:  # some selected keys hidden (future / other document); every query sees one at least
        valid = torch.rand(b, s, k, generator=g) < 0.6
        valid[..., k // 2] = True
    else:
        valid = torch.ones(b, s, k, dtype=torch.bool)
    return q, kv, idx, valid


def _run(fn, q, kv, *rest):
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, head_probs = fn(q, kv, *rest)
    g = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return [out, head_probs, q.grad, kv.grad]


def _worst(a, b):
    return max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hidden", [False, True])
# the micro-kernels' tiles: 4 heads fill part of one vector; 11 heads (22 rows backward) take every
# head-tile size and a second vector, and dv = 36 puts a column chunk across the latent/rope edge
@pytest.mark.parametrize("heads, d, dv", [(N, D, DV), (11, 44, 36)])
def test_fused_cpu_kernel_equals_torch_path(dtype, tol, hidden, heads, d, dv, monkeypatch):
    monkeypatch.setattr(fused, "KEY_BLOCK", 16)  # k = 37: two full key blocks and a partial one
    q, kv, idx, valid = _inputs(2, 9, 70, 37, dtype, hidden, heads=heads, d=d)
    scale = d ** -0.5
    want = _run(lambda q, kv: SparseLatentAttention.apply(q, kv, idx, valid, scale, dv, 4), q, kv)
    got = _run(lambda q, kv: fused.sparse_mla_cpu(q[..., :dv], q[..., dv:], kv, idx, valid if hidden else None,
                                                  scale), q, kv)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert got[0].permute(2, 0, 1, 3).is_contiguous()  # head-major o: W_UV's per-head GEMM reads it in place
    assert _worst(got, want) <= tol, _worst(got, want)
    if hidden:  # hidden keys carry no probability and receive no gradient
        assert float(got[1][~valid].abs().max()) == 0.0


def test_fused_cpu_kernel_is_deterministic():
    q, kv, idx, valid = _inputs(1, 33, 64, 24, torch.float32, True, seed=3)
    runs = [_run(lambda q, kv: fused.sparse_mla_cpu(q[..., :DV], q[..., DV:], kv, idx, valid, 0.2), q, kv)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_auto_runs_the_fused_cpu_kernel_in_the_layer(one_rank, monkeypatch):
    calls = []
    kernel = attention.sparse_mla_cpu
    monkeypatch.setattr(attention, "sparse_mla_cpu", lambda *a: calls.append(a[4]) or kernel(*a))
    res = outputs_per_kernel_choice(("torch", "auto"))
    assert len(calls) == 1 and calls[0] is not None  # packed documents hide keys: the mask is passed
    assert _worst(res["auto"], res["torch"]) <= 1e-5


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_kernel" / "lock"
    lock.parent.mkdir()
    lock.touch()
    fused._clear_stale_lock("some_kernel")
    assert lock.exists()  # a build under way
    old = time.time() - fused.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="stale build lock"):
        fused._clear_stale_lock("some_kernel")
    assert not lock.exists()


@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("heads", [3, 11])
def test_fused_indexer_kl_equals_torch_path(hidden, heads):
    """The sparse KL and its gradients to the indexer's q, k and weights. d = 20 and 37 keys:
    vector loops with scalar tails; 3 and 11 heads: the micro-kernels' head and row tiles of every size."""
    from model_providers.glm5.dsa.kl import sparse_kl

    b, s, d, L, k = 2, 9, 20, 70, 37
    g = torch.Generator().manual_seed(5)
    iq, ik, iw = (torch.randn(b, s, heads, d, generator=g), torch.randn(b, L, d, generator=g),
                  torch.rand(b, s, heads, generator=g))
    _, _, idx, valid = _inputs(b, s, L, k, torch.float32, hidden, seed=6)
    head_probs = torch.rand(b, s, k, generator=g)
    res = {}
    for choice in (False, True):
        leaves = [t.clone().requires_grad_() for t in (iq, ik, iw)]
        value = sparse_kl(*leaves, idx, valid, head_probs.clone(), chunk=4, fused=choice)
        value.backward()
        res[choice] = [value.detach()] + [t.grad for t in leaves]
    assert res[False][0] > 0.1  # a real KL, not a degenerate zero
    assert _worst(res[True], res[False]) <= 2e-6, _worst(res[True], res[False])


@pytest.mark.parametrize("layout_kind", ["causal", "documents", "cp_positions"])
def test_fused_dense_kl_equals_torch_path(layout_kind):
    """The dense KL (warm-up, and the dense prefix of sparse mode) with the fused CPU kernel
    doing the target's masked softmax and head sum and the KL's row work: value and gradients
    to the indexer's q, k and weights equal the torch path's, for plain causal rows (masked from
    the chunk's first row on only), packed documents with different boundaries per sample
    (b = 2), and CP-style non-contiguous query positions; chunks that do not divide the rows."""
    from model_providers.glm5.dsa.kl import dense_kl
    from model_providers.glm5.dsa.layout import TokenLayout

    g = torch.Generator().manual_seed(7)
    b, L, n, D, h, d = 2, 29, 3, 10, 2, 8
    docs = torch.tensor([[0] * 9 + [1] * 12 + [2] * 8, [0] * 4 + [1] * 25])
    q_pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 22, 23, 24, 25, 26, 27, 28])
    layout = {"causal": None, "documents": TokenLayout.build(L, L, docs),
              "cp_positions": TokenLayout.build(len(q_pos), L, None, q_pos)}[layout_kind]
    s = L if layout_kind != "cp_positions" else len(q_pos)
    query, key = torch.randn(s, b, n, D, generator=g), torch.randn(L, b, n, D, generator=g)
    iq, ik, iw = (torch.randn(b, s, h, d, generator=g), torch.randn(b, L, d, generator=g),
                  torch.rand(b, s, h, generator=g))
    res = {}
    for choice in (False, True):
        leaves = [t.clone().requires_grad_() for t in (iq, ik, iw)]
        value = dense_kl(*leaves, query, key, 0.3, chunk=5, layout=layout, fused=choice)
        value.backward()
        res[choice] = [value.detach()] + [t.grad for t in leaves]
    assert res[False][0] > 0.1
    assert _worst(res[True], res[False]) <= 2e-6, _worst(res[True], res[False])


def _kl_in_fp64(iq, ik, iw, idx, target):
    q, k, w = iq.double(), ik.double(), iw.double()
    sel = torch.stack([k[i][idx[i]] for i in range(k.shape[0])])  # [b, s, k, d]
    logq = torch.einsum("bshd,bskd->bshk", q, sel).relu().mul(w[..., None]).sum(2).log_softmax(-1)
    return (torch.special.xlogy(target, target) - target * logq).sum(-1).mean()


def test_fused_indexer_kl_has_no_bias_near_convergence():
    """A trained indexer's KL is small (here ~5e-5 a row) against terms of ~1e-2: a rounding
    bias of 1e-7 per row in the log-sum-exp (a float running sum over the keys, a slightly
    low exp polynomial) shows as 1e-3 of the value. Both paths stay within fp32 noise of an
    fp64 evaluation (2.1e-4 here; the old kernel: 8e-4)."""
    from model_providers.glm5.dsa.kl import sparse_kl

    b, s, heads, d, L, k = 2, 384, 4, 32, 700, 512
    g = torch.Generator().manual_seed(1)
    iq, ik = torch.randn(b, s, heads, d, generator=g), torch.randn(b, L, d, generator=g)
    iw = torch.rand(b, s, heads, generator=g) * 0.3
    idx = torch.stack([torch.randperm(L, generator=g)[:k] for _ in range(b * s)]).view(b, s, k)
    sel = torch.stack([ik[i][idx[i]] for i in range(b)])
    logits = torch.einsum("bshd,bskd->bshk", iq, sel).relu().mul(iw[..., None]).sum(2)
    target = (logits + 0.01 * torch.randn(logits.shape, generator=g)).softmax(-1)
    want = _kl_in_fp64(iq, ik, iw, idx, target.double())
    valid = torch.ones(b, s, k, dtype=torch.bool)
    for fused in (False, True):
        got = sparse_kl(iq, ik, iw, idx, valid, target, chunk=8, fused=fused)
        assert abs(float(got) / float(want) - 1) < 5e-4, (fused, float(got), float(want))


@pytest.mark.parametrize("k", [1, 7, 300, 1000, 1001])
def test_fused_topk_equals_torch_topk(k):
    """The radix-select top-k picks what ``topk_indices`` picks, in the same (ascending) order:
    ties (many: scores from 40 values) lowest position first, -inf, NaN as -inf, -0.0 tying
    +0.0, rows that are all one value, k = L."""
    from model_providers.glm5.dsa.topk import topk_indices

    g = torch.Generator().manual_seed(k)
    scores = torch.randint(-20, 20, (2, 5, 1001), generator=g).float() / 4
    scores[0, 0] = torch.randn(1001, generator=g) * 1e3  # distinct values over a wide range
    scores[0, 1, ::3] = float("-inf")
    scores[0, 2, ::5] = float("nan")
    scores[0, 3] = torch.where(torch.rand(1001, generator=g) < 0.5, -0.0, 0.0)
    scores[1, 0] = float("-inf")
    scores[1, 1] = 7.0
    got, want = topk_indices(scores, k, fused=True), topk_indices(scores, k)
    assert got.dtype == torch.int64 and got.shape == (2, 5, k)
    assert torch.equal(got, want)
