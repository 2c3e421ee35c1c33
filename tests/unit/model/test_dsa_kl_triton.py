"""The indexer KL on GPUs: the Triton sparse KL kernel in the CPU interpreter against the torch
path of ``kl.sparse_kl``, and the dense KL's TF32 tensor-core GEMMs against its fp32 GEMMs.

Sparse KL (``kernels/indexer_kl_triton.py``): triton reads TRITON_INTERPRET when ``@triton.jit``
runs (the kernel modules' import), so every case runs in one fresh subprocess with the variable
set (:func:`_collect`) and the tests below check its numbers. At small odd sizes: causal
selection (early queries see fewer than k keys), extra hidden keys, a key every query selects
(its dk row sums every query's contribution across forced small chunks), rows with no valid key
(0, not NaN), no mask at all (``valid=None``) and bf16 inputs; value, dq, dk and dw against the
torch path (fp32: norm-relative error <= 1e-5), dk bitwise reproducible and independent of the
chunking, and ``sparse_kl(..., triton=True)`` through autograd.

Dense KL on tensor cores (``kl.tensor_core_operand``): the TF32 path's error is measured against
the fp32 path at GLM-5's indexer dims and bounded (see ``TF32_BOUNDS``)."""

from __future__ import annotations

import functools

import pytest
import torch

from model_providers.glm5.model.dsa.kernels.interpreter import bf16_as_on_gpu
from tests.support.triton_interpreter import collect_in_interpreter

pytestmark = pytest.mark.heavy  # the Triton interpreter in one subprocess (~15 s on two cores)

FP32_TOL = 1e-5
#: bf16 q/k: scores exact, d per_head enters the gradient GEMMs as bf16 hi + lo (~2^-16;
#: measured 2.2e-6)
BF16_TOL = 2e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------- sparse KL (Triton)
# name: b, L (= queries), H, d, k, selection, dtype, kernel options
CASES = {
    "causal": (2, 40, 3, 24, 10, "causal", torch.float32, dict(block_n=16)),
    "hidden keys": (2, 33, 4, 16, 12, "holes", torch.float32, dict(block_n=16, chunk=8)),
    # key 0 in every selection, chunks of 5 queries: its dk row sums 37 queries over 8 chunks
    "shared key": (1, 37, 4, 16, 8, "shared", torch.float32, dict(block_n=16, chunk=5)),
    "empty rows": (2, 20, 3, 16, 8, "empty", torch.float32, dict(block_n=16, chunk=6)),
    "no mask": (1, 30, 3, 32, 9, "all visible", torch.float32, dict(block_n=16)),
    "bf16": (1, 40, 4, 32, 12, "causal", torch.bfloat16, dict(block_n=16, chunk=16)),
}
EMPTY = [0, 7, 19]  # queries without a valid key in "empty rows"


def _selection(kind: str, b: int, s: int, k: int, gen):
    """idx [b, s, k] (distinct per query), valid [b, s, k] or None."""
    pos = torch.arange(s)
    if kind == "all visible":  # any k distinct keys, every one visible
        idx = torch.stack([torch.stack([torch.randperm(s, generator=gen)[:k] for _ in range(s)])
                           for _ in range(b)])
        return idx, None
    hidden = (pos[None, None, :] > pos[None, :, None]).expand(b, s, s)
    scores = torch.randn(b, s, s, generator=gen)
    if kind == "shared":
        scores[..., 0] = float("inf")
    idx = torch.topk(scores.masked_fill(hidden, float("-inf")), k, dim=-1).indices.sort(-1).values
    valid = ~torch.gather(hidden, 2, idx)
    if kind == "holes":  # more hidden keys than causality hides (as packed documents do)
        valid &= torch.rand(b, s, k, generator=gen) > 0.3
        valid[:, :, 0] |= idx[:, :, 0] <= pos[None, :]  # most rows keep a key
    if kind == "empty":
        valid[:, EMPTY] = False
    return idx, valid


def _inputs(name: str):
    b, L, H, d, k, kind, dtype, _ = CASES[name]
    gen = torch.Generator().manual_seed(len(name) * 13 + L)
    idx, valid = _selection(kind, b, L, k, gen)
    iq = torch.randn(b, L, H, d, generator=gen).to(dtype)
    ik = torch.randn(b, L, d, generator=gen).to(dtype)
    iw = torch.randn(b, L, H, generator=gen) * 3 * (H * d) ** -0.5
    head_probs = torch.rand(b, L, k, generator=gen)
    return iq, ik, iw, idx, valid, head_probs


def _reference(iq, ik, iw, idx, valid, head_probs, keep):
    """The torch path's sums (value, dq, dk, dw) on fp32 copies, over the rows ``keep`` (its
    target is 0/0 on rows without a valid key)."""
    from model_providers.glm5.model.dsa.kl import sparse_kl

    b = iq.shape[0]
    q, k, w = (t.float()[:, keep].clone() if t is not ik else t.float().clone() for t in (iq, ik, iw))
    q, k, w = (t.requires_grad_() for t in (q, k, w))
    if valid is None:  # the torch path takes a mask: all True (it then applies none)
        valid = torch.ones_like(idx, dtype=torch.bool)
    kl = sparse_kl(q, k, w, idx[:, keep], valid[:, keep], head_probs[:, keep].clone(), chunk=4)
    kl.backward()
    n = b * len(keep)
    return float(kl) * n, q.grad * n, k.grad * n, w.grad * n


def _sparse_case(name: str) -> dict:
    from model_providers.glm5.model.dsa.kernels.indexer_kl_triton import sparse_kl_triton

    b, L, H, d, k, kind, dtype, opts = CASES[name]
    iq, ik, iw, idx, valid, head_probs = _inputs(name)
    target = head_probs if valid is None else head_probs.masked_fill(~valid, 0.0)
    target = target / target.sum(-1, keepdim=True)  # as sparse_kl forms it (0/0 on empty rows)
    total, dq, dk, dw = sparse_kl_triton(iq, ik, iw, idx, valid, target, True, **opts)
    again = sparse_kl_triton(iq, ik, iw, idx, valid, target, True, **opts)
    one_chunk = sparse_kl_triton(iq, ik, iw, idx, valid, target, True,
                                 **{key: v for key, v in opts.items() if key != "chunk"})
    value_only = sparse_kl_triton(iq, ik, iw, idx, valid, target, False, **opts)

    has = torch.ones(L, dtype=torch.bool) if valid is None else valid.any(-1).all(0)
    keep = has.nonzero().flatten()
    rv, rq, rk, rw = _reference(iq, ik, iw, idx, valid, head_probs, keep)
    return {
        "dtypes": [str(t.dtype) for t in (total, dq, dk, dw)],
        "finite": all(bool(torch.isfinite(t).all()) for t in (total, dq, dk, dw)),
        "value": abs(float(total) - rv) / abs(rv), "dq": _rel(dq[:, keep], rq), "dk": _rel(dk, rk),
        "dw": _rel(dw[:, keep], rw), "dk_key0": _rel(dk[:, 0], rk[:, 0]),
        "value_only": abs(float(value_only[0]) - float(total)) / abs(float(total)),
        "value_only_empty": [t.numel() for t in value_only[1:]],
        "bitwise": all(torch.equal(x, y) for x, y in zip((total, dq, dk, dw), again)),
        "chunking_bitwise": all(torch.equal(x, y) for x, y in zip((total, dq, dk, dw), one_chunk)),
        "empty_rows_zero": bool((dq[:, ~has] == 0).all() and (dw[:, ~has] == 0).all()),
        "n_empty_rows": int((~has).sum()), "n_invalid": 0 if valid is None else int((~valid).sum()),
        "key0_everywhere": bool((idx == 0).any(-1).all()),
    }


def _wired_case() -> dict:
    """``sparse_kl(..., triton=True)`` through autograd gives the torch path's numbers."""
    from model_providers.glm5.model.dsa.kl import sparse_kl

    iq, ik, iw, idx, valid, head_probs = _inputs("causal")
    out = {}
    for triton in (False, True):
        q, k, w = (t.clone().requires_grad_() for t in (iq, ik, iw))
        kl = sparse_kl(q, k, w, idx, valid, head_probs.clone(), chunk=4, triton=triton)
        kl.backward()
        out[triton] = (kl.detach(), q.grad, k.grad, w.grad)
    return {key: _rel(a, b) for key, a, b in zip(("value", "dq", "dk", "dw"), out[True], out[False])}


def _collect() -> dict:
    """Every kernel case; run with TRITON_INTERPRET=1 set before the kernels are imported."""
    from triton.runtime.interpreter import InterpretedFunction

    from model_providers.glm5.model.dsa.kernels.indexer_kl_triton import _indexer_kl_kernel

    torch.set_num_threads(1)
    bf16_as_on_gpu()
    return {
        "interpreted": isinstance(_indexer_kl_kernel, InterpretedFunction),
        "sparse": {name: _sparse_case(name) for name in CASES},
        "wired": _wired_case(),
    }


@pytest.fixture(scope="module")
def results() -> dict:
    return collect_in_interpreter("tests.unit.model.test_dsa_kl_triton")


@pytest.mark.parametrize("name", list(CASES))
def test_sparse_kl_kernel_matches_torch_path(results, name):
    r = results["sparse"][name]
    tol = FP32_TOL if CASES[name][6] == torch.float32 else BF16_TOL
    assert r["dtypes"] == ["torch.float32"] * 4 and r["finite"], r
    for key in ("value", "dq", "dk", "dw", "dk_key0"):
        assert r[key] <= tol, (key, r)
    assert r["value_only"] <= 1e-6 and r["value_only_empty"] == [0, 0, 0], r


def test_key_gradient_is_bitwise_reproducible_and_chunking_independent(results):
    for name, r in results["sparse"].items():
        assert r["bitwise"] is True, name
        assert r["chunking_bitwise"] is True, name


def test_rows_without_valid_keys_contribute_zero(results):
    r = results["sparse"]["empty rows"]
    assert r["n_empty_rows"] == len(EMPTY) and r["empty_rows_zero"] and r["finite"], r


def test_cases_cover_what_they_claim(results):
    sparse = results["sparse"]
    assert sparse["causal"]["n_invalid"] > 0  # early queries see fewer than k keys
    assert sparse["hidden keys"]["n_invalid"] > 0.2 * 2 * 33 * 12  # ~30% hidden beyond causality
    assert sparse["shared key"]["key0_everywhere"]
    assert sparse["no mask"]["n_invalid"] == 0


def test_sparse_kl_dispatches_to_the_kernel(results):
    r = results["wired"]
    assert all(v <= FP32_TOL for v in r.values()), r


def test_kernel_refuses_cpu_tensors_without_interpreter():
    from model_providers.glm5.model.dsa.kernels import sparse_kl_triton
    from model_providers.glm5.model.dsa.kernels.indexer_kl_triton import _interpreted

    if _interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process: CPU tensors are allowed")
    idx = torch.zeros(1, 4, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="CUDA"):
        sparse_kl_triton(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 2), idx, None,
                         torch.full((1, 4, 2), 0.5), True)


# ------------------------------------------------------------ dense KL on TF32 tensor cores
def test_tensor_core_operand_rounds_as_tf32():
    """Round half to even (and truncation) to 11 significant bits, against frexp arithmetic."""
    from model_providers.glm5.model.dsa.kl import tensor_core_operand

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=gen) * torch.logspace(-20, 20, 4096)
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2 - 2**-12, 0.0, -0.0])
    x = torch.cat([x, ties]).float()
    m, e = torch.frexp(x.double())
    for truncate, fn in ((False, torch.round), (True, torch.trunc)):
        want = torch.ldexp(fn(m * 2**11) / 2**11, e).float()
        assert torch.equal(tensor_core_operand(x, truncate), want), truncate
    bf16_values = torch.randn(1000, generator=gen).bfloat16().float()
    assert torch.equal(tensor_core_operand(bf16_values), bf16_values)  # bf16 is exact in TF32
    assert torch.equal(tensor_core_operand(torch.tensor([float("inf"), -float("inf")])),
                       torch.tensor([float("inf"), -float("inf")]))


# Measured (seed 0, s = 512, 8 heads x 256, indexer 32 x 128; operands rounded to nearest /
# truncated), relative to the fp32 GEMMs: bf16-valued inputs (the model's dtype): value and dw
# identical (the score GEMMs multiply exactly), dq 2.0e-4 / 4.2e-4, dk 1.8e-4 / 4.1e-4 (d per_head
# rounded to TF32: ~0.4 of its unit roundoff 2^-11 / 2^-10). fp32 inputs: value 4.9e-6 / 1.6e-3
# (truncation biases every score toward 0), dw 4.4e-4 / 1.7e-3, dq 1.2e-2 / 1.1e-2, dk 1.1e-2 /
# 1.0e-2 (ReLU masks flip where a rounded score crosses 0). Bounds: the unit roundoff for the
# bf16-valued dq/dk (~2.4x the measurement), ~2.5x the measurement for fp32 inputs; the
# gradients reach bf16 parameters, rounded to bf16 (2^-8 = 3.9e-3) on the way.
TF32_BOUNDS = {  # (input values, truncate): value, dq, dk, dw
    ("bf16", False): dict(value=1e-6, dq=2**-11, dk=2**-11, dw=1e-6),
    ("bf16", True): dict(value=1e-6, dq=2**-10, dk=2**-10, dw=1e-6),
    ("fp32", False): dict(value=5e-5, dq=3e-2, dk=3e-2, dw=1e-3),
    ("fp32", True): dict(value=4e-3, dq=3e-2, dk=3e-2, dw=4e-3),
}


def _dense_inputs(values: str, s=512, n=8, D=256, H=32, d=128):
    gen = torch.Generator().manual_seed(0)
    rnd = (lambda x: x.bfloat16().float()) if values == "bf16" else (lambda x: x)
    r = lambda *shape, sc=1.0: rnd(torch.randn(*shape, generator=gen) * sc)  # noqa: E731
    # main attention logits ~N(0, 4) (peakier than random), indexer logits ~N(0, 0.3)
    return r(s, 1, n, D, sc=2.0), r(s, 1, n, D), r(1, s, H, d), r(1, s, d), r(1, s, H, sc=(H * d) ** -0.5)


def _dense_run(inputs, tensor_cores, truncate=False):
    import model_providers.glm5.model.dsa.kl as kl_module

    query, key, iq, ik, iw = inputs
    iq, ik, iw = (t.clone().requires_grad_() for t in (iq, ik, iw))
    rounding = kl_module.tensor_core_operand
    kl_module.tensor_core_operand = functools.partial(rounding, truncate=truncate)
    try:
        kl = kl_module.dense_kl(iq, ik, iw, query, key, query.shape[-1] ** -0.5, chunk=128,
                                tensor_cores=tensor_cores)
    finally:
        kl_module.tensor_core_operand = rounding
    kl.backward()
    return kl.detach(), iq.grad, ik.grad, iw.grad


@pytest.mark.parametrize("values", ["bf16", "fp32"])
def test_dense_kl_tensor_core_error_is_bounded(values):
    inputs = _dense_inputs(values)
    ref = _dense_run(inputs, tensor_cores=False)
    default = _dense_run(inputs, tensor_cores=None)  # CPU: fp32 GEMMs unless asked
    assert all(torch.equal(a, b) for a, b in zip(default, ref))
    for truncate in (False, True):
        out = _dense_run(inputs, tensor_cores=True, truncate=truncate)
        err = {key: _rel(a, b) for key, a, b in zip(("value", "dq", "dk", "dw"), out, ref)}
        bound = TF32_BOUNDS[(values, truncate)]
        assert all(err[key] <= bound[key] for key in err), (values, truncate, err)
        if values == "fp32":  # the path does round: a no-op would pass any bound
            assert err["dq"] > 1e-5, err
