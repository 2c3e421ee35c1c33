"""The fused C++ sparse MLA (``dsa/kernels/dsa_cpu``) equals the op-by-op torch path
(``dsa/sparse_attention``): output, head probabilities and both gradients, with hidden keys and
without, fp32 and bf16, key counts that are not a multiple of the key block; it is bitwise
deterministic; o comes head-major (dO in any layout); and ``model.dsa.kernels=auto`` runs it in the DSA layer on CPU with the same
outputs and gradients as ``kernels=torch`` on packed documents.

Every kernel test runs at both vector widths, 8 lanes (the AVX2 machines' path) and 16 (the
AVX-512 machines'), whatever this CPU's own is: the widths tile and split their sums differently,
and each width's arithmetic is the same on any x86 CPU (``dsa_cpu.py`` says why).

The error bound, the same for both widths: the fused kernel and the torch path evaluate the same
formulas in the same precision (fp32 statistics; bf16 only for o, dq, dkv) and differ only in the
order of their sums, whose rounding is bounded by the same gamma_n sum|terms| whatever the order.
So against an fp64 evaluation of the same inputs, each of the kernel's outputs may be off by
twice what the torch path's is (the worst element of hundreds: a systematic error, such as a
biased exp or a lost low part, shows as many times that), plus, for outputs where the torch path
happens to be nearly exact, what one evaluation's rounding can reach: the output's own rounding
(u of its dtype) and, for sums of n fp32 terms with independently rounded parts, ~sqrt(n) u32
(the probabilistic bound of Higham and Mary, SIAM J. Sci. Comput. 2019), both of the output's
scale; n is the longest sum of the test (keys times the width of each dot product)."""

import math

import pytest
import torch

import model_providers.glm5.model.dsa.attention as attention
from model_providers.glm5.model.dsa.kernels import dsa_cpu as fused
from model_providers.glm5.model.dsa.sparse_attention import SparseLatentAttention
from tests.support.dsa_layer import outputs_per_kernel_choice

#: unit roundoff of each dtype the kernel takes or returns
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


# the other width is for the full suite, not the quick one (`make` builds it beside this CPU's own)
@pytest.fixture(params=[pytest.param(lanes, marks=() if lanes == fused.native_lanes() else pytest.mark.heavy)
                        for lanes in (8, 16)], ids=lambda lanes: f"{fused.ISA_OF_LANES[lanes]}-path")
def lanes(request, monkeypatch):
    """The kernel at one vector width (both are built by `make`'s bootstrap; a width missing from
    torch's extensions directory is built here, about a minute)."""
    monkeypatch.setenv(fused.LANES_ENV, str(request.param))
    assert fused.cpu_kernel().vector_lanes == request.param
    return request.param


def assert_within_rounding(got, torch_path, exact, terms: int):
    """Each output of ``got`` (the fused kernel's) is no further from ``exact`` (fp64) than twice
    the torch path's error plus (u of its dtype + sqrt(terms) u32) of its scale (the module's
    docstring); ``terms``: the length of the test's longest sum."""
    for i, (g, t, x) in enumerate(zip(got, torch_path, exact)):
        x = x.double()
        err, torch_err = float((g.double() - x).abs().max()), float((t.double() - x).abs().max())
        one_evaluation = UNIT_ROUNDOFF[g.dtype] + terms ** 0.5 * UNIT_ROUNDOFF[torch.float32]
        bound = 2 * torch_err + one_evaluation * float(x.abs().max())
        assert err <= bound, f"output {i}: error {err:.3g} > bound {bound:.3g} (torch path's {torch_err:.3g})"


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


def _run(fn, q, kv, *rest, grad_dtype=None):
    """[o, head_probs, dq, dkv] for dO ~ N(0, 1) rounded to ``grad_dtype`` (o's dtype by default)."""
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, head_probs = fn(q, kv, *rest)
    g = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=g).to(grad_dtype or out.dtype).to(out.dtype))
    return [out, head_probs, q.grad, kv.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [False, True])
# the micro-kernels' tiles: 4 heads fill part of one vector; 11 heads (22 rows backward) take every
# head-tile size and a second vector (of either width), and dv = 36 puts a column chunk across the
# latent/rope edge
@pytest.mark.parametrize("heads, d, dv", [(N, D, DV), (11, 44, 36)])
def test_fused_cpu_kernel_equals_torch_path(lanes, dtype, hidden, heads, d, dv, monkeypatch):
    monkeypatch.setattr(fused, "KEY_BLOCK", 16)  # k = 37: two full key blocks and a partial one
    q, kv, idx, valid = _inputs(2, 9, 70, 37, dtype, hidden, heads=heads, d=d)
    scale = d ** -0.5
    want = _run(lambda q, kv: SparseLatentAttention.apply(q, kv, idx, valid, scale, dv, 4), q, kv)
    # the same inputs (bf16 ones exactly) in fp64 through the torch path, which computes in fp64
    exact = _run(lambda q, kv: SparseLatentAttention.apply(q, kv, idx, valid, scale, dv, 4), q.double(),
                 kv.double(), grad_dtype=dtype)
    got = _run(lambda q, kv: fused.sparse_mla_cpu(q[..., :dv], q[..., dv:], kv, idx, valid if hidden else None,
                                                  scale), q, kv)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert got[0].permute(2, 0, 1, 3).is_contiguous()  # head-major o: W_UV's per-head GEMM reads it in place
    assert_within_rounding(got, want, exact, terms=37 * d)
    if hidden:  # hidden keys carry no probability and receive no gradient
        assert float(got[1][~valid].abs().max()) == 0.0


def test_fused_cpu_kernel_is_deterministic(lanes):
    q, kv, idx, valid = _inputs(1, 33, 64, 24, torch.float32, True, seed=3)
    runs = [_run(lambda q, kv: fused.sparse_mla_cpu(q[..., :DV], q[..., DV:], kv, idx, valid, 0.2), q, kv)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_auto_runs_the_fused_cpu_kernel_in_the_layer(one_rank, monkeypatch):
    calls = []
    kernel = attention.sparse_mla_cpu
    monkeypatch.setattr(attention, "sparse_mla_cpu", lambda *a: calls.append(a[4]) or kernel(*a))
    res = outputs_per_kernel_choice(("torch", "auto", "exact"))
    assert len(calls) == 1 and calls[0] is not None  # packed documents hide keys: the mask is passed
    assert_within_rounding(res["auto"], res["torch"], res["exact"], terms=21 * 64)


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


def _kl_of_logits(logits, target):
    """Mean over rows of KL(target || softmax(logits)); target 0 and logit -inf where hidden."""
    logq = torch.log_softmax(logits.masked_fill(target == 0, float("-inf")), -1)
    terms = torch.where(target > 0, target * (target.clamp_min(1e-300).log() - logq), 0.0)
    return terms.sum() / (logits.shape[0] * logits.shape[1])


def _indexer_logits(q, k, w, idx=None):
    """sum_h w_h relu(q_h . k) [b, s, keys] over every key of k, or at idx [b, s, kk]."""
    if idx is None:
        return torch.einsum("bsh,bshl->bsl", w, torch.einsum("bshd,bld->bshl", q, k).relu())
    sel = torch.stack([k[i][idx[i]] for i in range(k.shape[0])])  # [b, s, kk, d]
    return torch.einsum("bsh,bshk->bsk", w, torch.einsum("bshd,bskd->bshk", q, sel).relu())


def _kl_runs(kl_fn, exact_fn, leaves):
    """{path: [value, d iq, d ik, d iw]} for the torch path (fused=False), the fused kernel and
    the fp64 formula (``exact_fn`` of fp64 leaves, differentiated by autograd)."""
    res = {}
    for choice in (False, True):
        xs = [t.clone().requires_grad_() for t in leaves]
        value = kl_fn(*xs, fused=choice)
        value.backward()
        res[choice] = [value.detach()] + [t.grad for t in xs]
    xs = [t.double().requires_grad_() for t in leaves]
    value = exact_fn(*xs)
    res["exact"] = [value.detach(), *torch.autograd.grad(value, xs)]
    return res


@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("heads", [3, 11])
def test_fused_indexer_kl_equals_torch_path(lanes, hidden, heads):
    """The sparse KL and its gradients to the indexer's q, k and weights. d = 20 and 37 keys:
    vector loops with scalar tails; 3 and 11 heads: the micro-kernels' head and row tiles of every size."""
    from model_providers.glm5.model.dsa.kl import sparse_kl

    b, s, d, L, k = 2, 9, 20, 70, 37
    g = torch.Generator().manual_seed(5)
    iq, ik, iw = (torch.randn(b, s, heads, d, generator=g), torch.randn(b, L, d, generator=g),
                  torch.rand(b, s, heads, generator=g))
    _, _, idx, valid = _inputs(b, s, L, k, torch.float32, hidden, seed=6)
    head_probs = torch.rand(b, s, k, generator=g)
    target = head_probs.double().masked_fill(~valid, 0.0)
    target = target / target.sum(-1, keepdim=True)
    res = _kl_runs(lambda *xs, fused: sparse_kl(*xs, idx, valid, head_probs.clone(), chunk=4, fused=fused),
                   lambda q, k, w: _kl_of_logits(_indexer_logits(q, k, w, idx), target), (iq, ik, iw))
    assert res[False][0] > 0.1  # a real KL, not a degenerate zero
    assert_within_rounding(res[True], res[False], res["exact"], terms=k * d)


@pytest.mark.parametrize("layout_kind", ["causal", "documents", "cp_positions"])
def test_fused_dense_kl_equals_torch_path(lanes, layout_kind):
    """The dense KL (warm-up, and the dense prefix of sparse mode) with the fused CPU kernel
    doing the target's masked softmax and head sum and the KL's row work: value and gradients
    to the indexer's q, k and weights equal the torch path's, for plain causal rows (masked from
    the chunk's first row on only), packed documents with different boundaries per sample
    (b = 2), and CP-style non-contiguous query positions; chunks that do not divide the rows."""
    from model_providers.glm5.model.dsa.kl import dense_kl
    from model_providers.glm5.model.dsa.visibility import TokenLayout

    g = torch.Generator().manual_seed(7)
    b, L, n, D, h, d = 2, 29, 3, 10, 2, 8
    docs = torch.tensor([[0] * 9 + [1] * 12 + [2] * 8, [0] * 4 + [1] * 25])
    q_pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 22, 23, 24, 25, 26, 27, 28])
    layout = {"causal": TokenLayout.build(L, L, None), "documents": TokenLayout.build(L, L, docs),
              "cp_positions": TokenLayout.build(len(q_pos), L, None, q_pos)}[layout_kind]
    s = L if layout_kind != "cp_positions" else len(q_pos)
    query, key = torch.randn(s, b, n, D, generator=g), torch.randn(L, b, n, D, generator=g)
    iq, ik, iw = (torch.randn(b, s, h, d, generator=g), torch.randn(b, L, d, generator=g),
                  torch.rand(b, s, h, generator=g))
    scores = torch.einsum("sbnd,lbnd->bnsl", query.double(), key.double()) * 0.3
    probs = scores.masked_fill(layout.hidden(0, s)[:, None], float("-inf")).softmax(-1).sum(1)
    target = probs / probs.sum(-1, keepdim=True)
    res = _kl_runs(lambda *xs, fused: dense_kl(*xs, query, key, 0.3, chunk=5, fused=fused,
                                               layout=None if layout_kind == "causal" else layout),
                   lambda q, k, w: _kl_of_logits(_indexer_logits(q, k, w), target), (iq, ik, iw))
    assert res[False][0] > 0.1
    assert_within_rounding(res[True], res[False], res["exact"], terms=L * max(d, D))


def test_fused_indexer_kl_has_no_bias_near_convergence(lanes):
    """A trained indexer's KL is small (here ~5e-5 a row) against terms of ~6 (ln k): a rounding
    bias of 1e-7 per row in the log-sum-exp (a float running sum over the keys, a slightly low
    exp polynomial) shows as 2e-3 of the value; an old kernel's was 8e-4.

    Unbiased rounding averages out over the rows: each row's log-sum-exp, shared by its terms,
    rounds by ~u ln k, so the mean of r rows errs by ~sigma = u ln k / sqrt(r), 2.8e-4 of the
    value here. The torch path must stay within 4 sigma of an fp64 evaluation, and the fused
    kernel within twice the torch path's error plus sigma (as in the other tests: the same
    formula in other orders), which a bias of that size breaks."""
    from model_providers.glm5.model.dsa.kl import sparse_kl

    b, s, heads, d, L, k = 2, 384, 4, 32, 700, 512
    g = torch.Generator().manual_seed(1)
    iq, ik = torch.randn(b, s, heads, d, generator=g), torch.randn(b, L, d, generator=g)
    iw = torch.rand(b, s, heads, generator=g) * 0.3
    idx = torch.stack([torch.randperm(L, generator=g)[:k] for _ in range(b * s)]).view(b, s, k)
    sel = torch.stack([ik[i][idx[i]] for i in range(b)])
    logits = torch.einsum("bshd,bskd->bshk", iq, sel).relu().mul(iw[..., None]).sum(2)
    target = (logits + 0.01 * torch.randn(logits.shape, generator=g)).softmax(-1)
    exact_target = target.double() / target.double().sum(-1, keepdim=True)  # the paths normalise it too
    want = float(_kl_of_logits(_indexer_logits(iq.double(), ik.double(), iw.double(), idx), exact_target))
    valid = torch.ones(b, s, k, dtype=torch.bool)
    # sparse_kl forms its target in head_probs' storage: each path gets its own copy
    err = {fused: abs(float(sparse_kl(iq, ik, iw, idx, valid, target.clone(), chunk=8, fused=fused)) / want - 1)
           for fused in (False, True)}
    sigma = UNIT_ROUNDOFF[torch.float32] * math.log(k) / math.sqrt(b * s) / want
    assert err[False] <= 4 * sigma, (err, sigma)
    assert err[True] <= 2 * err[False] + sigma, (err, sigma)


@pytest.mark.parametrize("k", [1, 7, 300, 1000, 1001])
def test_fused_topk_equals_torch_topk(lanes, k):
    """The radix-select top-k picks what ``topk_indices`` picks, in the same (ascending) order:
    ties (many: scores from 40 values) lowest position first, -inf, NaN as -inf, -0.0 tying
    +0.0, rows that are all one value, k = L."""
    from model_providers.glm5.model.dsa.topk import topk_indices

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


def test_vector_width_is_the_cpus_own_unless_named(monkeypatch):
    monkeypatch.delenv(fused.LANES_ENV, raising=False)
    assert fused.kernel_lanes() == fused.native_lanes() == (16 if "avx512f" in fused._cpu_flags().split() else 8)
    monkeypatch.setenv(fused.LANES_ENV, "16")
    assert fused.kernel_lanes() == 16 and fused._name(16) != fused._name(8)  # one build per width
    monkeypatch.setenv(fused.LANES_ENV, "12")
    with pytest.raises(ValueError, match=r"GLM5_CPU_KERNEL_LANES='12'.*8 \(the AVX2 path\) or 16 \(the AVX-512 path\)"):
        fused.cpu_kernel()
