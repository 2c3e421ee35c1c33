"""FP8 lightning-indexer scoring (model_providers/glm5/model/dsa/fp8.py and the Triton kernel):
blockwise e4m3 quantisation within its documented error bound, FP8 logits within the logit
bound, the Triton kernel (CPU interpreter, in a subprocess) equal to the torch FP8 reference,
and top-k recall of the FP8 and bf16 paths against fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from model_providers.glm5.model.dsa.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_REL_ERR,
    dequantize_fp8,
    fp8_logits_error_bound,
    fp8_logits_reference,
    index_logits,
    quantization_error_bound,
    quantize_fp8,
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=300)


def _inputs(b, sq, sk, H, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, H, d, generator=g)
    k = torch.randn(b, sk, d, generator=g)
    w = torch.randn(b, sq, H, generator=g) * (H * d) ** -0.5
    return q, k, w


@pytest.mark.parametrize("pow2", [False, True])
def test_quantisation_roundtrip_within_bound(pow2):
    g = torch.Generator().manual_seed(1)
    # Rows of 4 blocks of 128 whose magnitudes span 1e-3..1e3 within the same row: a per-row
    # (instead of per-128) scale pushes the small blocks into e4m3 subnormals and breaks the bound.
    x = torch.randn(64, 3, 512, generator=g)
    x = x * torch.logspace(-3, 3, 4).repeat_interleave(128)
    x[0, 0, :128] = 0.0  # all-zero block
    x[0, 1, 128:256] *= 1e-5  # amax below the 1e-4 floor
    xq, s = quantize_fp8(x, pow2_scales=pow2)
    assert xq.dtype == FP8_DTYPE and xq.shape == x.shape and s.shape == (64, 3, 4)
    assert torch.isfinite(s).all() and (s > 0).all()
    xd = dequantize_fp8(xq, s)
    err = (xd - x).abs()
    assert (err <= quantization_error_bound(x, s)).all(), (err / quantization_error_bound(x, s)).max()
    assert (xd[0, 0, :128] == 0).all()
    assert xq.float().abs().max() <= FP8_MAX

    amax = x.unflatten(-1, (4, 128)).abs().amax(-1).clamp_min(1e-4)
    if pow2:
        mant, _ = torch.frexp(s)
        assert (mant == 0.5).all(), "pow2 scales must be exact powers of two"
        assert (s >= amax / FP8_MAX).all() and (s < 2 * amax / FP8_MAX).all()
    else:
        torch.testing.assert_close(s, amax / FP8_MAX, rtol=0, atol=0)
    # The 2^-4 relative bound is tight in the normal range: random values come close to it.
    normal = (x / s.repeat_interleave(128, -1)).abs() >= 2.0**-6
    rel = (err / x.abs())[normal]
    assert rel.max() <= FP8_REL_ERR + 2.0**-22 and rel.max() > 0.9 * FP8_REL_ERR, rel.max() / FP8_REL_ERR


def _causal_ok(logits, q_offset):
    sq, sk = logits.shape[-2:]
    masked = torch.arange(sk)[None, :] > (torch.arange(sq)[:, None] + q_offset)
    return bool((torch.isneginf(logits) == masked).all())


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_logits_within_documented_bound(pow2):
    b, sq, sk, H, d, off = 2, 64, 96, 8, 256, 32  # d = 256: two scale blocks per head
    q, k, w = _inputs(b, sq, sk, H, d, seed=2)
    f32 = index_logits(q, k, w, off, dtype="fp32")
    f8 = index_logits(q, k, w, off, dtype="fp8", pow2_scales=pow2, chunk_size=24)
    assert f8.shape == f32.shape == (b, sq, sk) and f8.dtype == torch.float32
    assert _causal_ok(f32, off) and _causal_ok(f8, off)
    vis = torch.isfinite(f32)
    err = (f8 - f32)[vis].abs()
    bound = fp8_logits_error_bound(q, k, w, pow2)[vis]
    ratio = (err / bound).max().item()
    rel = (err.mean() / f32[vis].abs().mean()).item()
    print(f"\nfp8 vs fp32 (pow2={pow2}): max err/bound {ratio:.3f}, mean rel err {rel:.4f}")
    assert ratio <= 1.0
    assert rel > 1e-3, "the fp8 path is not quantising"
    # bf16: the same argument with u = 2^-8 on q, k and on the rounded matmul output.
    bf = index_logits(q, k, w, off, dtype="bf16")
    assert _causal_ok(bf, off)
    s_abs = torch.einsum("bthd,bsd->bths", q.abs(), k.abs())
    bf_bound = ((3 * 2.0**-8 + 2.0**-12) * s_abs * w.abs().unsqueeze(-1)).sum(2)[vis]
    bf_err = (bf - f32)[vis].abs()
    assert (bf_err <= bf_bound).all()
    assert 0 < bf_err.mean() < err.mean() / 4


def test_reference_matches_fp32_math_on_dequantised_inputs_and_chunking():
    q, k, w = _inputs(1, 37, 45, 4, 128, seed=3)
    q8, qs = quantize_fp8(q, True)
    k8, ks = quantize_fp8(k, True)
    ref = fp8_logits_reference(q8, qs, k8, ks, w, q_offset=8)
    direct = index_logits(dequantize_fp8(q8, qs), dequantize_fp8(k8, ks), w, 8, dtype="fp32")
    torch.testing.assert_close(ref, direct, rtol=1e-6, atol=1e-6)
    # chunks are GEMMs of other row counts, which BLAS may block otherwise: each evaluation's
    # sum_h w_h relu(q_h . k) is off by gamma_d sum_h |w_h| |q_h| . |k| (dot products in fp32, of
    # fp8 values within 2^-4 of q and k) + gamma_h the same (the head sum); in bf16 a score that
    # lands on the other side of a rounding boundary moves by 2^-8 of itself. Twice: either side.
    u = 2.0 ** -24
    d, heads = q.shape[-1], q.shape[-2]
    scale = (torch.einsum("bthd,bsd->bths", q.abs(), k.abs()) * w.abs().unsqueeze(-1)).sum(2)
    relative = {"fp32": (d + heads) * u, "fp8": (d + heads) * u * (1 + 2.0 ** -4) ** 2,
                "bf16": 2.0 ** -8 + (d + heads) * u}
    for dtype in ("fp32", "bf16", "fp8"):
        whole = index_logits(q, k, w, 8, dtype=dtype)
        chunked = index_logits(q, k, w, 8, dtype=dtype, chunk_size=5)
        finite = torch.isfinite(whole)
        assert torch.equal(finite, torch.isfinite(chunked)), dtype
        assert bool(((chunked - whole)[finite].abs() <= 2 * relative[dtype] * scale[finite]).all()), dtype
    nc = index_logits(q, k, w, 8, dtype="fp8", causal=False)
    assert torch.isfinite(nc).all()
    with pytest.raises(ValueError):
        index_logits(q, k, w, 0, dtype="fp16")


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from model_providers.glm5.model.dsa.fp8 import quantize_fp8, fp8_logits_reference, index_logits
    from model_providers.glm5.model.dsa.kernels import indexer_fp8_triton as K
    from triton.runtime.interpreter import InterpretedFunction
    res = {"interpreted": isinstance(K._fp8_index_kernel, InterpretedFunction), "cases": []}
    H, d, sk = 4, 128, 48
    cases = [  # b, sq, q_offset, causal, pow2, precise_acc
        (1, 16, 32, True, True, False), (1, 40, 8, True, True, False), (1, 23, 5, True, False, False),
        (2, 40, 0, False, True, False), (1, 33, 15, True, True, True)]
    for i, (b, sq, off, causal, pow2, precise) in enumerate(cases):
        g = torch.Generator().manual_seed(i)
        q = torch.randn(b, sq, H, d, generator=g) * 3
        k = torch.randn(b, sk, d, generator=g)
        w = torch.randn(b, sq, H, generator=g) * (H * d) ** -0.5
        q8, qs = quantize_fp8(q, pow2); k8, ks = quantize_fp8(k, pow2)
        ref = fp8_logits_reference(q8, qs, k8, ks, w, off, causal)
        # Last case writes into a row-strided view of a wider buffer (out=).
        buf = torch.full((b, sq, sk + 5), 7.0)[..., :sk] if i == len(cases) - 1 else None
        out = K.fp8_index_logits_triton(q8, qs, k8, ks, w, off, causal, out=buf, block_m=16,
                                        block_n=16, precise_acc=precise)
        assert buf is None or out.data_ptr() == buf.data_ptr()
        same_inf = bool((torch.isneginf(out) == torch.isneginf(ref)).all())
        fin = torch.isfinite(ref)
        diff = (out[fin] - ref[fin]).abs()
        finite_or_inf = bool((torch.isfinite(out) | torch.isneginf(out)).all())
        res["cases"].append({"case": [b, sq, off, causal, pow2, precise], "same_inf": same_inf,
                             "n_inf": int((~fin).sum()), "all_finite_or_inf": finite_or_inf,
                             "excess": float((diff - 1e-5 - 1e-5 * ref[fin].abs()).max()),
                             "max_abs": float(diff.max()), "ref_max": float(ref[fin].abs().max())})
    # The dispatcher's triton backend (quantisation + kernel) against its torch backend.
    q = torch.randn(1, 29, H, d); k = torch.randn(1, sk, d); w = torch.randn(1, 29, H) * 0.02
    a = index_logits(q, k, w, 19, dtype="fp8", backend="triton")
    r = index_logits(q, k, w, 19, dtype="fp8", backend="torch")
    fin = torch.isfinite(r)
    res["dispatch"] = {"same_inf": bool((torch.isneginf(a) == torch.isneginf(r)).all()),
                       "max_abs": float((a[fin] - r[fin]).abs().max())}
    print(json.dumps(res))
    """
)


def test_triton_kernel_in_interpreter_matches_reference():
    # triton 3.9 reads TRITON_INTERPRET when @triton.jit runs (module import), not at
    # `import triton`: a fresh process with the variable set is the reliable way.
    proc = _run_python(_INTERPRETER_SCRIPT, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["interpreted"]
    for c in res["cases"]:
        assert c["same_inf"] and c["all_finite_or_inf"], c
        assert c["excess"] <= 0.0, c  # |out - ref| <= 1e-5 + 1e-5 * |ref|
    assert sum(c["n_inf"] for c in res["cases"]) > 0
    assert res["dispatch"]["same_inf"] and res["dispatch"]["max_abs"] <= 1e-5, res["dispatch"]
    print("\ninterpreter max |kernel - reference|:", max(c["max_abs"] for c in res["cases"]))


def test_kernel_module_imports_without_gpu_and_refuses_cpu_tensors():
    from model_providers.glm5.model.dsa.kernels import HAVE_TRITON, indexer_fp8_triton as K

    assert HAVE_TRITON
    if K._interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process: CPU tensors are allowed")
    q8, qs = quantize_fp8(torch.randn(1, 4, 2, 128))
    k8, ks = quantize_fp8(torch.randn(1, 4, 128))
    with pytest.raises(RuntimeError, match="CUDA"):
        K.fp8_index_logits_triton(q8, qs, k8, ks, torch.ones(1, 4, 2))


def test_topk_recall_fp8_and_bf16_vs_fp32():
    """L = 4096 keys, top-512, GLM-5 indexer shape (H = 32, d = 128). Queries t < 512 keep every
    key (recall 1 trivially), so recall is measured on 7 chunks of 128 queries spread over
    t in [512, 4096), each scored against all its causal keys."""
    L, H, d, topk, c = 4096, 32, 128, 512, 128
    q, k, w = _inputs(1, L, L, H, d, seed=4)
    hits = {"fp8": [], "fp8_nopow2": [], "bf16": []}
    for lo in range(topk, L, 512):
        qc, wc = q[:, lo : lo + c], w[:, lo : lo + c]
        ref_idx = index_logits(qc, k, wc, lo, dtype="fp32").topk(topk, dim=-1).indices
        in_ref = torch.zeros(1, c, L, dtype=torch.bool).scatter_(-1, ref_idx, True)
        for name, kw in (("fp8", {"dtype": "fp8"}), ("fp8_nopow2", {"dtype": "fp8", "pow2_scales": False}),
                         ("bf16", {"dtype": "bf16"})):
            idx = index_logits(qc, k, wc, lo, **kw).topk(topk, dim=-1).indices
            hits[name].append(in_ref.gather(-1, idx).float().mean(-1).flatten())
    recall = {n: torch.cat(v).mean().item() for n, v in hits.items()}
    worst = {n: torch.cat(v).min().item() for n, v in hits.items()}
    print(f"\ntop-{topk} recall vs fp32 at L={L} (896 queries): "
          + ", ".join(f"{n} {recall[n]:.4f} (worst query {worst[n]:.3f})" for n in recall))
    assert recall["fp8"] >= 0.97 and recall["fp8_nopow2"] >= 0.97
    assert recall["bf16"] >= 0.97 and recall["bf16"] > recall["fp8"]


def test_gpu_benchmark_exits_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the benchmark would run")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "dsa_gpu.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "needs a CUDA GPU" in proc.stderr
