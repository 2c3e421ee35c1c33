"""The Triton document-attention kernel (packed documents and context-parallel positions, the GPU
path of ``dense_attention``) in the CPU interpreter against an fp64 explicit-mask reference:
output and the q, k, v gradients, with several query and key blocks per sequence (small tiles),
documents split differently per sample, a CP rank's two zigzag runs against the whole sequence,
non-contiguous inputs; bf16 inputs within 2x the torch path's bf16 error (the blocked SDPA,
which keeps the probabilities in fp32); the backward bitwise reproducible; ``first_visible_key`` equal to the document
starts. One subprocess runs every case (TRITON_INTERPRET is read when the kernels are
imported)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import collect_in_interpreter

pytestmark = pytest.mark.heavy

DOCS = [[0] * 17 + [1] * 50 + [2] * 33, [0] * 5 + [1] * 60 + [2] * 35]
CASES = {  # s, heads, qk, v, documents, CP rank (of 2) or None, dtype
    "packed": (100, 2, 24, 20, True, None, "fp32"),
    "one document": (100, 3, 16, 16, False, None, "fp32"),
    "cp rank 0 packed": (100, 2, 24, 20, True, 0, "fp32"),
    "cp rank 1": (100, 2, 16, 32, False, 1, "fp32"),
    "packed bf16": (100, 2, 24, 20, True, None, "bf16"),
}


def _reference(q, k, v, layout, scale):
    s, b, n, _ = q.shape
    scores = torch.einsum("sbnd,lbnd->bnsl", q, k) * scale
    scores = scores.masked_fill(layout.hidden(0, s)[:, None], float("-inf"))
    return torch.einsum("bnsl,lbnd->sbnd", scores.softmax(-1), v).reshape(s, b, -1)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _case(name):
    import model_providers.glm5.model.dsa.kernels.document_attention_triton as kernel
    from model_providers.glm5.model.dsa.dense_attention import dense_attention
    from model_providers.glm5.model.dsa.visibility import TokenLayout
    from parallel.context_parallel import zigzag_positions

    L, n, d, dv, packed, cp_rank, dt = CASES[name]
    dtype = torch.float32 if dt == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(len(name))
    q_pos = None if cp_rank is None else zigzag_positions(L // 2, 2, cp_rank)
    s = L if q_pos is None else len(q_pos)
    b = 2
    layout = TokenLayout.build(s, L, torch.tensor(DOCS) if packed else None, q_pos)
    q = torch.randn(s, b, n, d, generator=g).to(dtype)
    k = torch.randn(L, b, n + 1, d, generator=g).to(dtype)[:, :, 1:]  # a strided view
    v = torch.randn(L, b, n, dv, generator=g).to(dtype)
    grad = torch.randn(s, b, n * dv, generator=g).to(dtype)

    def run(path, inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        out = path(*inputs, layout, 0.3)
        out.backward(grad.to(out.dtype))
        return [out.detach()] + [t.grad for t in inputs]

    got = run(kernel.document_attention_triton, (q, k, v))
    again = run(kernel.document_attention_triton, (q, k, v))
    exact = run(_reference, (q.double(), k.double(), v.double()))
    torch_path = run(lambda *a: dense_attention(*a, block_rows=16), (q, k, v))
    res = {"kernel": [_rel(a, e) for a, e in zip(got, exact)],
           "torch": [_rel(a, e) for a, e in zip(torch_path, exact)],
           "bitwise": all(torch.equal(a, b) for a, b in zip(got, again))}
    if packed:
        first = kernel.first_visible_key(layout.q_pos, layout.doc_k, b)
        starts = [[next(j for j in range(L) if row[j] == row[p]) for p in layout.q_pos.tolist()]
                  for row in DOCS]
        res["first_key_ok"] = first.tolist() == starts
    return res


def _collect():
    import model_providers.glm5.model.dsa.kernels.document_attention_triton as kernel
    from model_providers.glm5.model.dsa.kernels.interpreter import bf16_as_on_gpu

    torch.set_num_threads(1)
    bf16_as_on_gpu()
    # small tiles: several query blocks and key blocks per sequence
    kernel.FWD_CONFIG = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    kernel.BWD_KV_CONFIG = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    kernel.BWD_Q_CONFIG = dict(block_m=16, block_n=32, num_warps=4, num_stages=1)
    from triton.runtime.interpreter import InterpretedFunction

    return {"interpreted": isinstance(kernel._fwd_kernel, InterpretedFunction),
            "cases": {name: _case(name) for name in CASES}}


@pytest.fixture(scope="module")
def results() -> dict:
    return collect_in_interpreter("tests.unit.model.test_dsa_document_attention")


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_explicit_mask_reference(results, name):
    r = results["cases"][name]
    if CASES[name][-1] == "fp32":
        assert max(r["kernel"]) <= 1e-5, r
    else:  # bf16: P and dS enter their GEMMs in bf16 (flash attention's rounding), which the
        # CPU path keeps in fp32: within 2x its error of the exact result (measured: 1.0-1.8x)
        assert all(k <= 2 * t for k, t in zip(r["kernel"], r["torch"])), r
        assert max(r["kernel"]) <= 5e-3, r


@pytest.mark.parametrize("name", list(CASES))
def test_backward_is_bitwise_reproducible(results, name):
    assert results["cases"][name]["bitwise"]


def test_first_visible_key_is_the_document_start(results):
    assert all(r["first_key_ok"] for r in results["cases"].values() if "first_key_ok" in r)


def test_kernel_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from model_providers.glm5.model.dsa.kernels.document_attention_triton import document_attention_triton
    from model_providers.glm5.model.dsa.visibility import TokenLayout

    x = torch.zeros(4, 1, 1, 16)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
        document_attention_triton(x, x, x, TokenLayout.build(4, 4), 1.0)
