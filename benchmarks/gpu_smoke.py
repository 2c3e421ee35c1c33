"""``python -m benchmarks.gpu_smoke [--device cuda|cpu] [--out smoke.json]``: what a fresh GPU node
runs first (one GPU, a few minutes, no data files, no internet).

1. the environment (Python, torch, CUDA, GPU, triton, megatron-core, Transformer Engine, apex);
2. the tiny GLM-5 in bf16 for ``--steps`` steps through the training step itself (megatron DDP,
   optimizer, schedule, loss) on synthetic tokens: local layer spec dense, then sparse DSA; the
   Transformer Engine spec too where ``transformer_engine`` imports; per step: time, loss, grad
   norm, host syncs; peak device memory per run;
3. the fp8 indexer kernel (Triton) against the torch reference of the same quantised inputs;
4. sparse MLA forward + backward in bf16 against fp32 torch math on the same inputs.

Everything is written as one JSON object (stdout and ``--out``). Each part records its own error
and the script goes on, so one failure does not hide the others; the exit status is non-zero if
any part failed. ``--device cpu`` runs the same under the strict CUDA emulation (device placement
checked, host syncs counted): the test suite runs it so the smoke cannot rot.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _version(module: str):
    try:
        return getattr(importlib.import_module(module), "__version__", "present")
    except Exception as e:  # noqa: BLE001 -- absent or broken: say which
        return f"unavailable ({type(e).__name__})"


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "device": device,
           "triton": _version("triton"), "megatron_core": _version("megatron.core"),
           "transformer_engine": _version("transformer_engine"), "apex": _version("apex")}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    return env


class _SyntheticTokens:
    """Indexable samples like the training datasets': tokens, labels, loss mask, positions."""

    def __init__(self, vocab: int, seq: int, seed: int = 0):
        self.vocab, self.seq, self.seed = vocab, seq, seed

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq)}


def _host_sync_counter(device: str):
    """Returns (start, stop) -> count of device->host syncs in between, from torch's sync debug
    warnings (CUDA; on CPU the strict emulation counts them inside the step: None here)."""
    if device == "cpu":
        return (lambda: None), (lambda: None)
    state = {}

    def start():
        state["ctx"] = warnings.catch_warnings(record=True)
        state["log"] = state["ctx"].__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop():
        torch.cuda.set_sync_debug_mode("default")
        state["ctx"].__exit__(None, None, None)
        return sum("synchroniz" in str(w.message) for w in state["log"])

    return start, stop


def train_tiny(device: str, backend: str, dsa_mode: str, steps: int, seq: int) -> dict:
    """``steps`` training steps of the tiny GLM-5 (bf16, one rank) through pretrain.loop."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from model_providers.glm5.model.config import DSAConfig, GLM5Config, PrecisionConfig, to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig
    from parallel.initialize import initialize
    from pretrain.loop import configure_model_hooks, train_step
    from pretrain.optim import build_optimizer, build_scheduler
    from pretrain.config.schema import OptimizerConfig, SchedulerConfig, TrainerConfig

    par = ParallelConfig(cpu_emulation="strict")
    initialize(par, seed=1234)
    model = GLM5Config(dsa=DSAConfig(mode=dsa_mode, topk=min(64, seq // 2)), layer_backend=backend)
    precision = PrecisionConfig(dtype="bf16")
    tcfg = to_transformer_config(model, par, precision)
    chunks = build_model_chunks(model, tcfg, backend)
    ddp = [DistributedDataParallel(config=tcfg, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), module=c) for c in chunks]
    optimizer = build_optimizer(ddp, OptimizerConfig(lr=1e-3, min_lr=1e-4), "bf16", False)
    scheduler = build_scheduler(optimizer, OptimizerConfig(lr=1e-3, min_lr=1e-4),
                                SchedulerConfig(warmup_steps=1), steps)
    probe = configure_model_hooks(tcfg, ddp, optimizer)
    trainer = TrainerConfig(seq_length=seq, micro_batch_size=2, global_batch_size=4)
    data = _SyntheticTokens(model.vocab_size, seq)
    start, stop = _host_sync_counter(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    records = []
    for step in range(steps):
        start()
        t0 = time.perf_counter()
        stats = train_step(ddp, optimizer, scheduler, data, step * trainer.global_batch_size, trainer,
                           probe, model.mtp_num_steps)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        syncs = stop()
        records.append({"step": step + 1, "seconds": round(seconds, 4), "lm_loss": stats.lm_loss,
                        "grad_norm": stats.grad_norm, "skipped": stats.skipped,
                        "host_syncs": syncs if syncs is not None else stats.host_syncs})
    out = {"steps": records, "params": sum(p.numel() for c in chunks for p in c.parameters())}
    if device == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    finite = all(r["lm_loss"] == r["lm_loss"] and not r["skipped"] for r in records)
    if not finite:
        raise RuntimeError(f"non-finite or skipped steps: {records}")
    return out


def indexer_kernel(device: str) -> dict:
    """Triton fp8 indexer logits vs the torch reference on the same quantised inputs."""
    from model_providers.glm5.model.dsa.fp8 import index_logits

    if device != "cuda":
        return {"skipped": "the Triton kernel needs a GPU here (tests run it under TRITON_INTERPRET=1)"}
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for sq, sk in ((512, 4096), (2048, 32768)):
        q = torch.randn(1, sq, 32, 128, device="cuda", generator=g)
        k = torch.randn(1, sk, 128, device="cuda", generator=g)
        w = torch.randn(1, sq, 32, device="cuda", generator=g) * 0.1
        off = sk - sq
        ref = index_logits(q, k, w, off, backend="torch")
        got = index_logits(q, k, w, off, backend="triton")
        finite = torch.isfinite(ref)
        rel = float((got[finite] - ref[finite]).norm() / ref[finite].norm())
        times = {}
        for backend in ("torch", "triton"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                index_logits(q, k, w, off, backend=backend)
            torch.cuda.synchronize()
            times[backend] = (time.perf_counter() - t0) / 5
        bf16 = _timed(lambda: index_logits(q, k, w, off, dtype="bf16"))
        out[f"sq{sq}_sk{sk}"] = {"rel_err_vs_torch": rel, "same_mask": bool(
            torch.equal(torch.isfinite(got), finite)), "triton_ms": times["triton"] * 1e3,
            "torch_fp8_ms": times["torch"] * 1e3, "bf16_ms": bf16 * 1e3}
    return out


def _timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def sparse_attention(device: str) -> dict:
    """bf16 sparse MLA forward + backward vs the same computation in fp32."""
    from model_providers.glm5.model.dsa.sparse_attention import sparse_latent_attention

    s, L, n, lora, rope, k = (256, 4096, 16, 512, 64, 512) if device == "cuda" else (32, 128, 4, 64, 16, 16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, n, lora + rope, generator=g)
    kv = torch.randn(1, L, lora + rope, generator=g)
    scores = torch.randn(1, s, L, generator=g)
    pos = torch.arange(L - s, L)
    scores = scores.masked_fill(torch.arange(L)[None, None, :] > pos[None, :, None], float("-inf"))
    idx = scores.topk(k, dim=-1).indices
    valid = idx <= pos[None, :, None]
    go = torch.randn(1, s, n, lora, generator=g)

    def run(dtype):
        qd = q.to(device=device, dtype=dtype).detach().requires_grad_()
        kvd = kv.to(device=device, dtype=dtype).detach().requires_grad_()
        out, _ = sparse_latent_attention(qd, kvd, idx.to(device), valid.to(device),
                                         (lora + rope) ** -0.5, lora)
        out.backward(go.to(device=device, dtype=dtype))
        return out.float(), qd.grad.float(), kvd.grad.float()

    ref = run(torch.float32)
    got = run(torch.bfloat16)
    rel = {name: float((a - b).norm() / b.norm()) for name, a, b in zip(("out", "dq", "dkv"), got, ref)}
    res = {"shape": {"s": s, "L": L, "heads": n, "dim": lora + rope, "topk": k}, "bf16_rel_err": rel}
    if device == "cuda":
        res["bf16_fwd_bwd_ms"] = _timed(lambda: run(torch.bfloat16)) * 1e3
    return res


def sparse_vs_flash(device: str, L: int = 32768) -> dict:
    """One layer's attention core at length L, bf16, forward + backward: the sparse MLA core
    (heads 16, latent 512 + rope 64, top-k 2048, today's torch implementation) against dense
    causal SDPA (flash) at MLA's per-head shapes (qk 192, v 128). Median of 3 after a warm-up."""
    import statistics

    import torch.nn.functional as F

    from model_providers.glm5.model.dsa.sparse_attention import sparse_latent_attention

    if device != "cuda":
        return {"skipped": "GPU only"}
    n, lora, rope, k = 16, 512, 64, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, L, n, lora + rope, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    kv = torch.randn(1, L, lora + rope, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    pos = torch.arange(L, device="cuda")
    idx = (pos[:, None] - torch.arange(k, device="cuda")[None, :]).clamp_min(0)[None]  # last k keys
    valid = (pos[:, None] >= torch.arange(k, device="cuda")[None, :])[None]
    go = torch.randn(1, L, n, lora, device="cuda", dtype=torch.bfloat16, generator=g)
    qd = torch.randn(1, n, L, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    kd = torch.randn(1, n, L, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    vd = torch.randn(1, n, L, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    god = torch.randn(1, n, L, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    def sparse():
        out, _ = sparse_latent_attention(q, kv, idx, valid, (lora + rope) ** -0.5, lora)
        out.backward(go)

    def dense():
        F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(god)

    res = {"L": L, "heads": n, "topk": k}
    for name, fn in (("dense_sdpa", dense), ("sparse_torch", sparse)):
        fn()
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res[f"{name}_fwd_bwd_ms"] = round(statistics.median(times) * 1e3, 2)
    res["sparse_over_dense"] = round(res["sparse_torch_fwd_bwd_ms"] / res["dense_sdpa_fwd_bwd_ms"], 3)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible (use --device cpu)")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    report = {"environment": environment(args.device)}
    parts = [("local_dense", lambda: train_tiny(args.device, "local", "dense", args.steps, args.seq)),
             ("local_sparse", lambda: train_tiny(args.device, "local", "sparse", args.steps, args.seq))]
    te = importlib.util.find_spec("transformer_engine") is not None and args.device == "cuda"
    parts.append(("te_dense", (lambda: train_tiny(args.device, "te", "dense", args.steps, args.seq)) if te
                  else None))
    parts += [("fp8_indexer_kernel", lambda: indexer_kernel(args.device)),
              ("sparse_attention_bf16", lambda: sparse_attention(args.device)),
              ("sparse_vs_flash_32k", lambda: sparse_vs_flash(args.device))]
    failed = False
    t_start = time.perf_counter()
    for name, part in parts:
        if part is None:
            report[name] = {"skipped": "transformer_engine does not import (or no GPU)"}
            continue
        t0 = time.perf_counter()
        try:
            report[name] = part()
        except Exception as e:  # noqa: BLE001 -- record and go on to the next part
            failed = True
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                            "traceback": traceback.format_exc()[-4000:]}
        report[name]["wall_s"] = round(time.perf_counter() - t0, 2)
    report["total_wall_s"] = round(time.perf_counter() - t_start, 2)
    report["ok"] = not failed
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
