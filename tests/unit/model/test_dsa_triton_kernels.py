"""The Triton DSA kernels (sparse MLA forward/backward, causal indexer logits) in the CPU
interpreter against the torch references, at small odd sizes.

triton reads TRITON_INTERPRET when ``@triton.jit`` runs (the kernel modules' import), so every
kernel case runs once in a fresh subprocess with the variable set (:func:`_collect`, ~30 s on
two cores) and the tests below check its numbers. Sparse MLA: o, lse, head_probs, dq and dkv
against ``sparse_latent_attention`` (norm-relative error; fp32 <= 1e-5, bf16 inputs <= 2e-3 of
fp32 math on the same values, and precise mode within 5% of rounding that math once) for k < L,
k >= L (also against dense causal MLA in absorbed form), queries that see fewer than k keys,
packed documents, a key every query selects (its dkv row sums contributions of all queries,
head groups and backward chunks), rows with no valid key, GLM-5's 64 heads x (512 + 64) with
the GPU block sizes; the backward is bitwise reproducible, and bitwise the same for any chunking
of its dkv partials (a budget of one query per chunk against one chunk). The default precision
mode follows the rule in the kernel's docstring, on errors measured here against the bf16 floor
(fp64 math rounded once) at GLM-5 dims; the backward's chunk plan keeps the partials of GLM-5's
32K-query backward within 1 GiB (arithmetic, no kernel run). Indexer: bf16 and fp8 logits against ``fp8.index_logits``
(fp8: ``fp8_logits_reference`` on the same quantised inputs) for an offset run and the two
zigzag runs of a context-parallel rank, and their top-k equal to the reference's top-k."""

from __future__ import annotations

import pytest
import torch

from model_providers.glm5.model.dsa.kernels.interpreter import bf16_as_on_gpu
from tests.support.triton_interpreter import collect_in_interpreter

pytestmark = pytest.mark.heavy  # every case runs the Triton interpreter in one subprocess (minutes)

FP32_TOL, BF16_TOL = 1e-5, 2e-3
BF16_FAST_TOL = 3e-3  # precise=False: P and dS rounded to bf16 for their GEMMs (flash attention)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- sparse MLA cases
# name: b, L, n heads, dv, rope dims, k, dtype, selection, kernel options (last: only the last
# `last` positions are queries; otherwise all L)
ATTENTION_CASES = {
    "k<L": (2, 40, 5, 40, 8, 12, torch.float32, "causal", dict(block_n=16)),
    "k<L bf16": (1, 64, 8, 64, 16, 32, torch.bfloat16, "causal", dict(block_n=16, precise=True)),
    "k<L bf16 fast": (1, 64, 8, 64, 16, 32, torch.bfloat16, "causal", dict(block_n=16, precise=False)),
    "packed": (2, 40, 3, 64, 16, 10, torch.float32, "packed", dict(block_n=16)),
    # key 0 in every selection; 3 head groups of 2 and backward chunks of 9 queries
    "shared key": (1, 40, 5, 64, 16, 16, torch.float32, "shared",
                   dict(block_n=16, heads_per_program=2, chunk=9)),
    "shared key bf16": (1, 40, 5, 64, 16, 16, torch.bfloat16, "shared",
                        dict(block_n=16, heads_per_program=2, chunk=9)),
    "k>=L": (1, 24, 4, 64, 16, 24, torch.float32, "all", dict(block_n=16)),
    # GLM-5's attention shapes (64 heads, 512 + 64) with the GPU block sizes: the last 4 queries
    "glm5 dims bf16": (1, 80, 64, 512, 64, 48, torch.bfloat16, "shared", dict(last=4)),
    "empty rows": (1, 20, 3, 64, 16, 8, torch.float32, "empty", dict(block_n=16)),
}


def _selection(kind: str, b: int, s: int, k: int, gen):
    """idx, valid [b, s, k]: a top-k of random scores over each query's visible keys."""
    pos = torch.arange(s)
    hidden = (pos[None, None, :] > pos[None, :, None]).expand(b, s, s)
    if kind == "all":
        idx = pos.expand(b, s, s).clone()
        return idx, ~hidden
    if kind == "packed":
        docs = torch.stack([torch.bucketize(pos, torch.tensor([13, 29]), right=True),
                            torch.bucketize(pos, torch.tensor([5, 6, 30]), right=True)])[:b]
        hidden = hidden | (docs[:, :, None] != docs[:, None, :])
    scores = torch.randn(b, s, s, generator=gen)
    if kind == "shared":
        scores[..., 0] = float("inf")
    idx = torch.topk(scores.masked_fill(hidden, float("-inf")), k, dim=-1).indices.sort(-1).values
    valid = ~torch.gather(hidden, 2, idx)
    if kind == "empty":
        valid[:, [0, 7, 19]] = False
    return idx, valid


def _reference_lse(q, kv, idx, valid, scale):
    b, s, k = idx.shape
    sel = torch.gather(kv.double(), 1, idx.reshape(b, s * k, 1).expand(-1, -1, kv.shape[-1]))
    scores = torch.einsum("bsnd,bskd->bsnk", q.double(), sel.view(b, s, k, -1)) * scale
    return scores.masked_fill(~valid[:, :, None, :], float("-inf")).logsumexp(-1)


def _dense_causal(q, kv, scale, dv):
    """Ordinary causal attention in absorbed form (every key a query may see), fp64."""
    s = q.shape[1]
    scores = torch.einsum("bsnd,bld->bsnl", q, kv) * scale
    causal = torch.arange(s)[None, :] > torch.arange(s)[:, None]
    p = scores.masked_fill(causal[None, :, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bsnl,bld->bsnd", p, kv[..., :dv])


def _attention_case(name: str) -> dict:
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import sparse_mla_backward, sparse_mla_forward
    from model_providers.glm5.model.dsa.sparse_attention import sparse_latent_attention

    b, L, n, dv, rope, k, dtype, kind, opts = ATTENTION_CASES[name]
    gen = torch.Generator().manual_seed(len(name) * 7 + L)
    D = dv + rope
    scale = D ** -0.5
    idx, valid = _selection(kind, b, L, k, gen)
    opts = dict(opts)
    s = opts.pop("last", L)  # query rows: the last s positions
    idx, valid = idx[:, L - s:], valid[:, L - s:]
    q = torch.randn(b, s, n, D, generator=gen).to(dtype)
    kv = torch.randn(b, L, D, generator=gen).to(dtype)
    go = torch.randn(b, s, n, dv, generator=gen).to(dtype)
    fwd_opts = {key: v for key, v in opts.items() if key != "chunk"}
    o, lse, hp = sparse_mla_forward(q, kv, idx, valid, scale, dv, **fwd_opts)
    dq, dkv = sparse_mla_backward(q, kv, idx, valid, o, lse, go, scale, dv, **opts)
    bitwise = None
    if kind == "shared":  # key 0's dkv row sums every query's and head group's contribution
        dq2, dkv2 = sparse_mla_backward(q, kv, idx, valid, o, lse, go, scale, dv, **opts)
        bitwise = bool(torch.equal(dq, dq2) and torch.equal(dkv, dkv2))

    # torch reference: fp32 math on fp32 copies of the same values
    q32, kv32 = (t.float().requires_grad_() for t in (q, kv))
    ro, rhp = sparse_latent_attention(q32, kv32, idx, valid, scale, dv, 7)
    rq, rkv = torch.autograd.grad(ro, (q32, kv32), go.float())
    rlse = _reference_lse(q, kv, idx, valid, scale)
    has = valid.any(-1)  # rows with a key (the reference's other rows are NaN)
    fin = torch.isfinite(rlse)
    res = {
        "dtypes": [str(t.dtype) for t in (o, lse, hp, dq, dkv)],
        "finite": all(bool(torch.isfinite(t).all()) for t in (o, hp, dq, dkv)),
        "o": _rel(o[has], ro[has]), "hp": _rel(hp[has], rhp[has]), "dq": _rel(dq, rq),
        "dkv": _rel(dkv, rkv), "lse": _rel(lse[fin], rlse[fin]),
        "lse_inf_same": bool(torch.equal(torch.isneginf(lse), torch.isneginf(rlse))),
        "dkv_key0": _rel(dkv[:, 0], rkv[:, 0]),
        "bitwise": bitwise,
        # the error of fp32 math rounded once to the input dtype
        "floor": {key: _rel(ref.to(dtype), ref) for key, ref in (("o", ro[has]), ("dq", rq), ("dkv", rkv))},
        "n_invalid": int((~valid).sum()), "n_empty_rows": int((~has).sum()),
        "key0_everywhere": bool((idx == 0).any(-1).all()),
        "empty_rows_zero": bool((o[~has] == 0).all() and (hp[~has] == 0).all()
                                and (dq[~has] == 0).all()),
    }
    if kind == "all":  # k >= L: dense causal MLA in absorbed form
        qd, kvd = (t.double().requires_grad_() for t in (q, kv))
        dense = _dense_causal(qd, kvd, scale, dv)
        dd = torch.autograd.grad(dense, (qd, kvd), go.double())
        res.update(dense_o=_rel(o, dense), dense_dq=_rel(dq, dd[0]), dense_dkv=_rel(dkv, dd[1]))
    return res


def _precision_case() -> dict:
    """Norm-relative errors of o, dq, dkv (and key 0's dkv row) in both precision modes at GLM-5
    dims (64 heads, 512 + 64), bf16, against fp64 math on the same values, and the bf16 floor:
    that fp64 result rounded once to bf16."""
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import sparse_mla_backward, sparse_mla_forward
    from model_providers.glm5.model.dsa.sparse_attention import sparse_latent_attention

    L, s, n, dv, rope, k = 80, 16, 64, 512, 64, 48
    gen = torch.Generator().manual_seed(2)
    D = dv + rope
    scale = D ** -0.5
    idx, valid = _selection("shared", 1, L, k, gen)
    idx, valid = idx[:, L - s:], valid[:, L - s:]
    q = torch.randn(1, s, n, D, generator=gen).bfloat16()
    kv = torch.randn(1, L, D, generator=gen).bfloat16()
    go = torch.randn(1, s, n, dv, generator=gen).bfloat16()
    q64, kv64 = (t.double().requires_grad_() for t in (q, kv))
    ro, _ = sparse_latent_attention(q64, kv64, idx, valid, scale, dv, 7)
    rq, rkv = torch.autograd.grad(ro, (q64, kv64), go.double())
    refs = {"o": ro, "dq": rq, "dkv": rkv, "dkv_key0": rkv[:, 0]}
    res = {"floor": {key: _rel(ref.bfloat16(), ref) for key, ref in refs.items()}}
    for mode, precise in (("precise", True), ("fast", False)):
        o, lse, _ = sparse_mla_forward(q, kv, idx, valid, scale, dv, precise=precise)
        dq, dkv = sparse_mla_backward(q, kv, idx, valid, o, lse, go, scale, dv, precise=precise)
        res[mode] = {key: _rel(out, refs[key]) for key, out in
                     (("o", o), ("dq", dq), ("dkv", dkv), ("dkv_key0", dkv[:, 0]))}
    return res


def _chunking_case() -> dict:
    """dq and dkv with a partial budget of one query per backward chunk (and of 4 queries)
    against one chunk: 5 heads in 3 head groups, key 0 selected by every query."""
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import (
        backward_chunk_plan, sparse_mla_backward, sparse_mla_forward)

    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(5)
        b, s, n, dv, D, k = 2, 14, 5, 32, 48, 8
        idx, valid = _selection("shared", b, s, k, gen)
        q = torch.randn(b, s, n, D, generator=gen).to(dtype)
        kv = torch.randn(b, s, D, generator=gen).to(dtype)
        go = torch.randn(b, s, n, dv, generator=gen).to(dtype)
        opts = dict(heads_per_program=2, block_n=16)
        o, lse, _ = sparse_mla_forward(q, kv, idx, valid, 0.2, dv, **opts)
        per_query = backward_chunk_plan(b, s, n, D, k, heads_per_program=2, partial_budget=1)[1]
        outs = {}
        for queries in (s, 4, 1):
            budget = queries * per_query
            assert backward_chunk_plan(b, s, n, D, k, heads_per_program=2, partial_budget=budget)[0] == queries
            outs[queries] = sparse_mla_backward(q, kv, idx, valid, o, lse, go, 0.2, dv,
                                                partial_budget=budget, **opts)
        res[str(dtype)] = {f"{queries} per chunk": bool(torch.equal(outs[queries][0], outs[s][0])
                                                        and torch.equal(outs[queries][1], outs[s][1]))
                           for queries in (4, 1)}
    return res


def _autograd_case() -> dict:
    """The autograd Function gives the same numbers as the direct calls with default options."""
    from model_providers.glm5.model.dsa.kernels import sparse_mla_triton
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import sparse_mla_backward, sparse_mla_forward

    gen = torch.Generator().manual_seed(11)
    b, s, n, dv, D, k = 1, 30, 3, 32, 48, 9
    idx, valid = _selection("causal", b, s, k, gen)
    q = torch.randn(b, s, n, D, generator=gen, requires_grad=True)
    kv = torch.randn(b, s, D, generator=gen, requires_grad=True)
    go = torch.randn(b, s, n, dv, generator=gen)
    o, hp = sparse_mla_triton(q, kv, idx, valid, 0.3, dv)
    gq, gkv = torch.autograd.grad(o, (q, kv), go)
    o2, lse, hp2 = sparse_mla_forward(q.detach(), kv.detach(), idx, valid, 0.3, dv)
    dq, dkv = sparse_mla_backward(q.detach(), kv.detach(), idx, valid, o2, lse, go, 0.3, dv)
    return {"same": all(torch.equal(a, b) for a, b in ((o, o2), (hp, hp2), (gq, dq), (gkv, dkv))),
            "hp_requires_grad": hp.requires_grad}


# ------------------------------------------------------------------------------ indexer cases
INDEXER_RUNS = {  # name: runs of (first position, rows), key length
    "offset": ([(5, 34)], 45),
    "zigzag": ([(4, 8), (33, 8)], 45),
}


def _indexer_case(name: str, dtype: str) -> dict:
    from model_providers.glm5.model.dsa.fp8 import fp8_logits_reference, index_logits, quantize_fp8
    from model_providers.glm5.model.dsa.kernels import index_logits_triton
    from model_providers.glm5.model.dsa.topk import topk_indices

    runs, L = INDEXER_RUNS[name]
    b, H, d, topk = 2, 3, (128 if dtype == "fp8" else 40), 12
    gen = torch.Generator().manual_seed(len(name) + H)
    q_pos = torch.cat([torch.arange(lo, lo + c) for lo, c in runs])
    s = len(q_pos)
    q = torch.randn(b, s, H, d, generator=gen)
    k = torch.randn(b, L, d, generator=gen)
    w = torch.randn(b, s, H, generator=gen) * (H * d) ** -0.5
    out = index_logits_triton(q, k, w, q_pos, dtype, block_m=16, block_n=16)
    prequantised_same = None
    if dtype == "fp8":  # keys quantised once by the caller give the same logits
        k8, ks = quantize_fp8(k, pow2_scales=True)
        again = index_logits_triton(q, k8, w, q_pos, dtype, k_scale=ks, block_m=16, block_n=16)
        prequantised_same = bool(torch.equal(again, out))
    refs, row = [], 0
    for lo, c in runs:
        qc, wc = q[:, row:row + c], w[:, row:row + c]
        if dtype == "fp8":  # the reference on the same quantised inputs
            q8, qs = quantize_fp8(qc, pow2_scales=True)
            k8, ks = quantize_fp8(k, pow2_scales=True)
            refs.append(fp8_logits_reference(q8, qs, k8, ks, wc, lo))
        else:
            refs.append(index_logits(qc, k, wc, lo, dtype="bf16"))
        row += c
    ref = torch.cat(refs, dim=1)
    fin = torch.isfinite(ref)
    diff = (out - ref)[fin].abs()
    return {
        "same_inf": bool(torch.equal(torch.isneginf(out), torch.isneginf(ref))),
        "n_inf": int((~fin).sum()),
        "finite_or_inf": bool((torch.isfinite(out) | torch.isneginf(out)).all()),
        "excess": float((diff - 1e-5 - 1e-5 * ref[fin].abs()).max()),
        "rel": float(diff.max() / ref[fin].abs().max()),
        "topk_equal": bool(torch.equal(topk_indices(out, topk), topk_indices(ref, topk))),
        "rows_with_fewer_keys": int((q_pos < topk - 1).sum()),
        "prequantised_same": prequantised_same,
        # 16 x 16 tiles whose keys all lie after their rows' last position (skipped, -inf)
        "future_tiles": sum(int(q_pos[min(m + 16, s) - 1]) < n
                            for m in range(0, s, 16) for n in range(0, L, 16)),
    }


def _collect() -> dict:
    """Every kernel case; run with TRITON_INTERPRET=1 set before the kernels are imported."""
    from triton.runtime.interpreter import InterpretedFunction

    from model_providers.glm5.model.dsa.kernels.indexer_triton import _index_logits_kernel
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import _sparse_mla_fwd_kernel

    torch.set_num_threads(1)
    bf16_as_on_gpu()
    return {
        "interpreted": isinstance(_sparse_mla_fwd_kernel, InterpretedFunction)
        and isinstance(_index_logits_kernel, InterpretedFunction),
        "attention": {name: _attention_case(name) for name in ATTENTION_CASES},
        "precision": _precision_case(),
        "chunking": _chunking_case(),
        "autograd": _autograd_case(),
        "indexer": {f"{name} {dt}": _indexer_case(name, dt) for name in INDEXER_RUNS
                    for dt in ("bf16", "fp8")},
    }


@pytest.fixture(scope="module")
def results() -> dict:
    return collect_in_interpreter("tests.unit.model.test_dsa_triton_kernels")


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_sparse_mla_matches_torch_reference(results, name):
    r = results["attention"][name]
    dtype, opts = ATTENTION_CASES[name][6], ATTENTION_CASES[name][8]
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import PRECISE

    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL if opts.get("precise", PRECISE) else BF16_FAST_TOL
    dtype = str(dtype)
    assert r["dtypes"] == [dtype, "torch.float32", "torch.float32", dtype, dtype], r
    assert r["finite"], r
    for key in ("o", "dq", "dkv", "dkv_key0"):
        assert r[key] <= tol, (key, r)
    if tol == BF16_TOL:  # precise: fp32 math rounded once, nothing more
        for key in ("o", "dq", "dkv"):
            assert r[key] <= 1.05 * r["floor"][key], (key, r)
    # the statistics are fp32 math on the inputs' values, whatever their dtype
    assert r["lse"] <= FP32_TOL and r["hp"] <= FP32_TOL and r["lse_inf_same"], r


def test_sparse_mla_backward_is_bitwise_reproducible(results):
    assert results["attention"]["shared key"]["bitwise"] is True
    assert results["attention"]["shared key bf16"]["bitwise"] is True


def test_default_precision_mode_follows_the_measured_rule(results):
    """Fast (precise=False) is the default iff its error is within FAST_MAX_ERROR_RATIO x the
    bf16 floor for each of o, dq and dkv at GLM-5 dims; precise is the floor itself."""
    import inspect

    from model_providers.glm5.model.dsa.kernels import sparse_mla_triton
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import (
        FAST_MAX_ERROR_RATIO, PRECISE, sparse_mla_backward, sparse_mla_forward)

    r = results["precision"]
    ratio = {mode: {key: r[mode][key] / r["floor"][key] for key in ("o", "dq", "dkv", "dkv_key0")}
             for mode in ("precise", "fast")}
    assert all(0.95 <= v <= 1.05 for v in ratio["precise"].values()), (ratio, r)
    fast_within = all(ratio["fast"][key] <= FAST_MAX_ERROR_RATIO for key in ("o", "dq", "dkv"))
    assert PRECISE is (not fast_within), (f"default precise={PRECISE} contradicts the measurement", ratio, r)
    chosen = ratio["precise" if PRECISE else "fast"]
    assert max(chosen.values()) <= FAST_MAX_ERROR_RATIO, (ratio, r)
    for fn in (sparse_mla_triton, sparse_mla_forward, sparse_mla_backward):
        assert inspect.signature(fn).parameters["precise"].default is PRECISE, fn


def test_backward_is_bitwise_independent_of_chunking(results):
    for dtype, r in results["chunking"].items():
        assert r == {"4 per chunk": True, "1 per chunk": True}, (dtype, r)


def test_chunk_plan_bounds_partials_at_glm5_shapes():
    """GLM-5 (64 heads, 512 + 64, k = 2048, b = 1, up to 32K queries): at most 1 GiB of fp32
    dkv partials per backward chunk, whatever the head grouping; a query always gets a chunk."""
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import PARTIAL_BUDGET, backward_chunk_plan

    assert PARTIAL_BUDGET <= 2**30
    for s in (1, 227, 228, 4096, 32768):
        for heads_per_program in (64, 32, 16):
            c, nbytes = backward_chunk_plan(1, s, 64, 576, 2048, heads_per_program=heads_per_program)
            assert 1 <= c <= s and nbytes <= 2**30, (s, heads_per_program, c, nbytes)
            assert nbytes == c * (64 // heads_per_program) * 2048 * 576 * 4
    c, nbytes = backward_chunk_plan(1, 32768, 64, 576, 2048)
    assert c == 227 and -(-32768 // c) == 145 and nbytes / 2**30 > 0.99, (c, nbytes)


def test_cases_cover_what_they_claim(results):
    att = results["attention"]
    assert att["k<L"]["n_invalid"] > 0  # early queries see fewer than k keys
    assert att["packed"]["n_invalid"] > att["k<L"]["n_invalid"] / 2
    assert att["shared key"]["key0_everywhere"] and att["shared key bf16"]["key0_everywhere"]
    assert att["empty rows"]["n_empty_rows"] == 3


def test_topk_at_least_length_equals_dense_causal_mla(results):
    r = results["attention"]["k>=L"]
    assert r["dense_o"] <= FP32_TOL and r["dense_dq"] <= FP32_TOL and r["dense_dkv"] <= FP32_TOL, r


def test_rows_without_keys_are_zero_not_nan(results):
    r = results["attention"]["empty rows"]
    assert r["finite"] and r["empty_rows_zero"] and r["lse_inf_same"], r


def test_autograd_function_wraps_the_kernels(results):
    assert results["autograd"] == {"same": True, "hp_requires_grad": False}


@pytest.mark.parametrize("case", [f"{n} {dt}" for n in INDEXER_RUNS for dt in ("bf16", "fp8")])
def test_indexer_matches_reference_and_topk(results, case):
    r = results["indexer"][case]
    assert r["same_inf"] and r["finite_or_inf"] and r["n_inf"] > 0, r
    if case.endswith("fp8"):
        assert r["excess"] <= 0.0 and r["prequantised_same"], r  # |out - ref| <= 1e-5 + 1e-5 |ref|
    else:
        assert r["rel"] <= 2e-3, r
    assert r["topk_equal"], r


def test_indexer_cases_cover_short_rows_and_skipped_blocks(results):
    """Rows that see fewer than top-k keys (ties at -inf, broken by position) exist, and some
    16 x 16 tiles lie wholly after their rows (not computed, -inf)."""
    for case, r in results["indexer"].items():
        assert r["n_inf"] > 0, case
    assert results["indexer"]["offset fp8"]["future_tiles"] > 0
    assert results["indexer"]["offset bf16"]["future_tiles"] > 0
    assert results["indexer"]["zigzag fp8"]["rows_with_fewer_keys"] > 0
    assert results["indexer"]["offset bf16"]["rows_with_fewer_keys"] > 0


def test_kernels_refuse_cpu_tensors_without_interpreter():
    from model_providers.glm5.model.dsa.kernels import index_logits_triton, sparse_mla_triton
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import _interpreted

    if _interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process: CPU tensors are allowed")
    q, kv = torch.randn(1, 4, 2, 24), torch.randn(1, 4, 24)
    idx = torch.zeros(1, 4, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="CUDA"):
        sparse_mla_triton(q, kv, idx, idx == 0, 0.2, 16)
    with pytest.raises(RuntimeError, match="CUDA"):
        index_logits_triton(torch.randn(1, 4, 2, 128), torch.randn(1, 4, 128), torch.ones(1, 4, 2),
                            torch.arange(4), "fp8")
    with pytest.raises(ValueError):
        index_logits_triton(q, kv, torch.ones(1, 4, 2), torch.arange(4), "fp16")
