"""Each Triton kernel against its torch reference, and its speed at GLM-5 shapes next to flash SDPA."""

from __future__ import annotations

import torch

from benchmarks.gpu_check.common import TOL, _gen, _ms, _rel, _tflops


def _sparse_selection(device: str, rows: int, first: int, k: int):
    """idx, valid [1, rows, k] for queries at positions first..: k distinct keys spread evenly
    over 0..t (key 0 among them: a key every query selects), or keys 0..k-1 while t < k
    (``benchmarks.dsa_gpu._selection`` for any k and device)."""
    t = torch.arange(first, first + rows, device=device)[:, None]
    j = torch.arange(k, device=device)[None, :]
    idx = torch.where(t + 1 >= k, (j * (t + 1)) // k, j)
    return idx[None], (idx <= t)[None]


def _sparse_shapes(device: str) -> dict:
    from benchmarks.dsa_gpu import HEADS, LATENT, ROPE, TOPK

    if device == "cuda":  # GLM-5 per TP rank; the check at 4K (512 queries), timing at 32K (all)
        return dict(heads=HEADS, dv=LATENT, rope=ROPE, k=TOPK, check_L=4096, check_rows=512,
                    time_L=32768, dtype=torch.bfloat16)
    return dict(heads=4, dv=32, rope=16, k=8, check_L=40, check_rows=16, time_L=None, dtype=torch.float32)


def flash_sdpa(device: str, L: int, reps: int) -> dict:
    """Dense causal SDPA (flash) at GLM-5's dense MLA head (64 x 256), length L, bf16: the
    reference speed for the attention kernels (``benchmarks.dsa_gpu._dense_ms``)."""
    from benchmarks.dsa_gpu import DENSE_DIM, HEADS, _dense_ms

    if device != "cuda":
        return {"ok": True, "skipped": "timing: GPU only"}
    fwd, fwd_bwd, backend = _dense_ms(L, reps)
    flop = 2 * HEADS * L * (L + 1) / 2 * 2 * DENSE_DIM
    return {"ok": True, "L": L, "heads": HEADS, "dim": DENSE_DIM, "backend": backend,
            "fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(fwd_bwd, 3),
            "fwd_tflops": _tflops(flop, fwd), "fwd_bwd_tflops": _tflops(3.5 * flop, fwd_bwd)}


def kernel_sparse_mla(device: str, reps: int, flash: dict) -> dict:
    """Sparse MLA forward and backward (default precision mode; both modes' errors) against
    ``sparse_latent_attention`` in fp32 on the same values; backward bitwise over two runs."""
    from model_providers.glm5.model.dsa.kernels.sparse_mla_triton import (PRECISE, sparse_mla_backward,
                                                                          sparse_mla_forward)
    from model_providers.glm5.model.dsa.sparse_attention import sparse_latent_attention

    sh = _sparse_shapes(device)
    n, dv, rope, k, dtype = sh["heads"], sh["dv"], sh["rope"], sh["k"], sh["dtype"]
    D = dv + rope
    scale = D ** -0.5
    L, rows = sh["check_L"], sh["check_rows"]
    g = _gen(device, 1)
    q = torch.randn(1, rows, n, D, device=device, generator=g).to(dtype)
    kv = torch.randn(1, L, D, device=device, generator=g).to(dtype)
    go = torch.randn(1, rows, n, dv, device=device, generator=g).to(dtype)
    idx, valid = _sparse_selection(device, rows, L - rows, k)
    q32, kv32 = (t.float().requires_grad_() for t in (q, kv))
    ro, rhp = sparse_latent_attention(q32, kv32, idx, valid, scale, dv)
    rq, rkv = torch.autograd.grad(ro, (q32, kv32), go.float())
    tol = TOL[device]["sparse_mla"]
    out = {"shape": {"L": L, "queries": rows, "heads": n, "dim": f"{dv}+{rope}", "k": k, "dtype": str(dtype)},
           "default_precise": PRECISE, "tol": tol,
           "floor": {name: _rel(r.to(dtype), r) for name, r in (("o", ro), ("dq", rq), ("dkv", rkv))}}
    for precise in (PRECISE, not PRECISE):
        o, lse, hp = sparse_mla_forward(q, kv, idx, valid, scale, dv, precise=precise)
        dq, dkv = sparse_mla_backward(q, kv, idx, valid, o, lse, go, scale, dv, precise=precise)
        dq2, dkv2 = sparse_mla_backward(q, kv, idx, valid, o, lse, go, scale, dv, precise=precise)
        errs = {"o": _rel(o, ro), "head_probs": _rel(hp, rhp), "dq": _rel(dq, rq), "dkv": _rel(dkv, rkv)}
        out["precise" if precise else "fast"] = {
            **errs, "bitwise": bool(torch.equal(dq, dq2) and torch.equal(dkv, dkv2))}
    chosen = out["precise" if PRECISE else "fast"]
    # the rule behind the default (sparse_mla_triton's docstring), on this device's numbers
    out["fast_over_floor"] = {x: out["fast"][x] / out["floor"][x] for x in ("o", "dq", "dkv")
                              if out["floor"][x] > 0}
    out["fwd_rel_err"] = chosen["o"]
    out["bwd_rel_err"] = max(chosen["dq"], chosen["dkv"])
    out["ok"] = bool(max(chosen[x] for x in ("o", "dq", "dkv")) <= tol and chosen["bitwise"]
                     and chosen["head_probs"] <= 1e-4)
    del q, kv, go, q32, kv32, ro, rq, rkv
    if sh["time_L"]:  # every position a query at 32K (benchmarks.dsa_gpu.time_sparse's FLOPs)
        L = sh["time_L"]
        g = _gen(device, 4)
        q = torch.randn(1, L, n, D, device=device, generator=g).to(dtype)
        kv = torch.randn(1, L, D, device=device, generator=g).to(dtype)
        go = torch.randn(1, L, n, dv, device=device, generator=g).to(dtype)
        idx, valid = _sparse_selection(device, L, 0, k)
        pairs = valid.sum().item()
        flop_fwd = 2 * n * pairs * (D + dv)
        flop_bwd = 2 * n * pairs * (3 * D + 2 * dv)
        o, lse, _ = sparse_mla_forward(q, kv, idx, valid, scale, dv)
        fwd = _ms(device, lambda: sparse_mla_forward(q, kv, idx, valid, scale, dv), reps)
        bwd = _ms(device, lambda: sparse_mla_backward(q, kv, idx, valid, o, lse, go, scale, dv), reps)
        out.update(time_L=L, fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=_tflops(flop_fwd, fwd),
                   bwd_tflops=_tflops(flop_bwd, bwd), fwd_bwd_tflops=_tflops(flop_fwd + flop_bwd, fwd + bwd))
        if flash.get("fwd_bwd_ms"):
            out["vs_flash_fwd_bwd"] = round((fwd + bwd) / flash["fwd_bwd_ms"], 3)
        del q, kv, go, o, lse
        torch.cuda.empty_cache()
    return out


def kernel_indexer(device: str, reps: int, dtype: str) -> dict:
    """``index_logits_triton`` (``dtype`` bf16 | fp8) against ``fp8.index_logits`` (bf16) /
    ``fp8_logits_reference`` on the same quantised inputs (fp8): max |diff| / max |ref| over the
    visible logits, the same -inf pattern; then its time on a 4096-query chunk of a 32K sequence."""
    from model_providers.glm5.model.dsa.fp8 import fp8_logits_reference, index_logits, quantize_fp8
    from model_providers.glm5.model.dsa.kernels import index_logits_triton

    H, d = 32, 128
    sq, sk = (512, 4096) if device == "cuda" else (12, 40)
    g = _gen(device, 7)

    def inputs(sq, sk):
        q = torch.randn(1, sq, H, d, device=device, generator=g)
        k = torch.randn(1, sk, d, device=device, generator=g)
        w = torch.randn(1, sq, H, device=device, generator=g) * (H * d) ** -0.5
        return q, k, w

    q, k, w = inputs(sq, sk)
    off = sk - sq
    q_pos = torch.arange(off, sk, device=device)
    got = index_logits_triton(q, k, w, q_pos, dtype)
    if dtype == "fp8":
        ref = fp8_logits_reference(*quantize_fp8(q, pow2_scales=True), *quantize_fp8(k, pow2_scales=True), w, off)
    else:
        ref = index_logits(q, k, w, off, dtype="bf16")
    fin = torch.isfinite(ref)
    rel = float((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max())
    tol = TOL[device][f"indexer_{dtype}"]
    same_inf = bool(torch.equal(torch.isneginf(got), torch.isneginf(ref)))
    out = {"shape": {"queries": sq, "keys": sk, "heads": H, "dim": d}, "rel_err": rel, "tol": tol,
           "same_inf": same_inf, "ok": bool(rel <= tol and same_inf)}
    if device == "cuda":
        L, rows = 32768, 4096
        q, k, w = inputs(rows, L)
        q_pos = torch.arange(L - rows, L, device=device)
        buf = torch.empty(1, rows, L, device=device)
        ms = _ms(device, lambda: index_logits_triton(q, k, w, q_pos, dtype, out=buf), reps)
        pairs = rows * (L - rows) + rows * (rows + 1) / 2
        out.update(time_L=L, time_queries=rows, ms=ms, tflops=_tflops(2 * H * d * pairs, ms))
        del q, k, w, buf
        torch.cuda.empty_cache()
    return out


def kernel_indexer_kl(device: str, reps: int) -> dict:
    """The fused indexer KL with gradients (``kernels.indexer_kl_triton.sparse_kl_triton``, the
    CPU kernel's contract) against ``kl.sparse_kl``'s torch path (mean KL and its gradients)."""
    from model_providers.glm5.model.dsa.kernels.indexer_kl_triton import sparse_kl_triton
    from model_providers.glm5.model.dsa.kl import sparse_kl

    b, H, d = 1, 32 if device == "cuda" else 4, 128 if device == "cuda" else 16
    s, L, k = (512, 4096, 2048) if device == "cuda" else (16, 40, 8)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = _gen(device, 9)

    def inputs(s, L, k):
        iq = torch.randn(b, s, H, d, device=device, generator=g).to(dtype)
        ik = torch.randn(b, L, d, device=device, generator=g).to(dtype)
        iw = torch.randn(b, s, H, device=device, generator=g) * (H * d) ** -0.5
        idx, valid = _sparse_selection(device, s, L - s, k)
        target = torch.rand(b, s, k, device=device, generator=g).masked_fill(~valid, 0.0)
        return iq, ik, iw, idx, valid, target / target.sum(-1, keepdim=True)

    iq, ik, iw, idx, valid, target = inputs(s, L, k)
    total, dq, dk, dw = sparse_kl_triton(iq, ik, iw, idx, valid, target, True)
    rq, rk, rw = (t.float().requires_grad_() for t in (iq, ik, iw))
    ref = sparse_kl(rq, rk, rw, idx, valid, target.clone(), chunk=64)
    ref = ref[0] if isinstance(ref, tuple) else ref
    gq, gk, gw = torch.autograd.grad(ref, (rq, rk, rw))
    n = b * s
    errs = {"kl": abs(float(total) / n - float(ref)) / abs(float(ref)), "dq": _rel(dq / n, gq),
            "dk": _rel(dk / n, gk), "dw": _rel(dw / n, gw)}
    tol = TOL[device]["indexer_kl"]
    out = {"shape": {"queries": s, "keys": L, "k": k, "heads": H, "dim": d, "dtype": str(dtype)},
           "errors": errs, "rel_err": max(errs.values()), "tol": tol, "ok": max(errs.values()) <= tol}
    if device == "cuda":
        s, L = 4096, 32768
        iq, ik, iw, idx, valid, target = inputs(s, L, k)
        ms = _ms(device, lambda: sparse_kl_triton(iq, ik, iw, idx, valid, target, True), reps)
        pairs = valid.sum().item()
        flop = 3 * 2 * H * d * pairs  # scores, dq, dk GEMMs (the second sweep's recompute not counted)
        out.update(time_L=L, time_queries=s, ms=ms, tflops=_tflops(flop, ms))
        del iq, ik, iw, idx, valid, target
        torch.cuda.empty_cache()
    return out


def kernel_document_attention(device: str, reps: int, flash: dict) -> dict:
    """Packed-document dense attention (``kernels.document_attention_triton``) against
    ``dense_attention.dense_attention``'s blocked torch path, forward and backward, then its
    forward + backward time at 32K in 4 documents (GLM-5's dense MLA head, 64 x (192 + 64), v 256)."""
    from model_providers.glm5.model.dsa.dense_attention import dense_attention
    from model_providers.glm5.model.dsa.kernels.document_attention_triton import document_attention_triton
    from model_providers.glm5.model.dsa.visibility import TokenLayout

    n, qk, v = (64, 256, 256) if device == "cuda" else (2, 16, 16)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = _gen(device, 11)

    def inputs(L: int, cuts: list[int]):
        docs = torch.zeros(1, L, dtype=torch.long)
        for c in cuts:
            docs[:, c:] += 1
        layout = TokenLayout.build(L, L, docs.to(device), device=device)
        q, k_ = (torch.randn(L, 1, n, qk, device=device, generator=g).to(dtype) for _ in range(2))
        val = torch.randn(L, 1, n, v, device=device, generator=g).to(dtype)
        go = torch.randn(L, 1, n * v, device=device, generator=g).to(dtype)
        lens = torch.diff(torch.tensor([0, *cuts, L]))
        pairs = float((lens * (lens + 1) / 2).sum())
        return layout, q, k_, val, go, pairs

    L = 4096 if device == "cuda" else 40
    layout, q, k_, val, go, _ = inputs(L, [L // 3, L // 2 + 5])
    scale = qk ** -0.5

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k_, val)]
        o = fn(*leaves, layout, scale)
        return (o, *torch.autograd.grad(o, leaves, go.to(dt)))

    got = run(document_attention_triton, dtype)
    ref = run(dense_attention, torch.float32)
    errs = {name: _rel(a, r) for name, a, r in zip(("o", "dq", "dk", "dv"), got, ref)}
    tol = TOL[device]["document_attention"]
    out = {"shape": {"L": L, "heads": n, "qk": qk, "v": v, "documents": 3, "dtype": str(dtype)},
           "errors": errs, "fwd_rel_err": errs["o"], "bwd_rel_err": max(errs["dq"], errs["dk"], errs["dv"]),
           "tol": tol, "ok": max(errs.values()) <= tol}
    if device == "cuda":
        L = 32768
        layout, q, k_, val, go, pairs = inputs(L, [L // 4, L // 2, 3 * L // 4])
        leaves = [t.requires_grad_() for t in (q, k_, val)]

        def fwd():
            with torch.no_grad():
                document_attention_triton(*leaves, layout, scale)

        def fwd_bwd():
            torch.autograd.grad(document_attention_triton(*leaves, layout, scale), leaves, go)

        flop = 2 * n * pairs * (qk + v)
        f, fb = _ms(device, fwd, reps), _ms(device, fwd_bwd, reps)
        out.update(time_L=L, time_documents=4, fwd_ms=f, fwd_bwd_ms=fb, fwd_tflops=_tflops(flop, f),
                   fwd_bwd_tflops=_tflops(3.5 * flop, fb))
        if flash.get("fwd_bwd_ms"):  # flash at the same length sees 4x the pairs (one document)
            out["flash_fwd_bwd_tflops_same_L"] = flash.get("fwd_bwd_tflops")
        del q, k_, val, go, leaves
        torch.cuda.empty_cache()
    return out
