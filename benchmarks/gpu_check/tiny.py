"""The tiny GLM-5 trained a few steps through the training step, in each DSA mode."""

from __future__ import annotations

import time
import warnings

import torch

from benchmarks.gpu_check.common import _sync


class _FixedBatch:
    """Indexable samples like the training datasets' (tokens, labels, loss mask, positions); sample
    i is sample i mod ``n``, so every step sees the same global batch and the loss must fall."""

    def __init__(self, vocab: int, seq: int, n: int, seed: int = 0):
        self.vocab, self.seq, self.n, self.seed = vocab, seq, n, seed

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i % self.n)
        ids = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq)}


def _host_sync_counter(device: str):
    """(start, stop) -> count of device->host syncs in between, from torch's sync debug warnings
    (CUDA; on CPU the strict emulation counts them inside the step: None here)."""
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
    """``steps`` training steps of the tiny GLM-5 (bf16, one rank) through pretrain.step."""
    from model_providers.glm5.model.config import DSAConfig, GLM5Config, PrecisionConfig
    from parallel.config import ParallelConfig
    from parallel.initialize import initialize
    from pretrain.config.schema import OptimizerConfig, RunConfig, SchedulerConfig, TrainerConfig
    from pretrain.step import configure_model_hooks, train_step
    from pretrain.stage_build import build_stage

    par = ParallelConfig(cpu_emulation="strict")
    initialize(par, seed=1234)
    model = GLM5Config(dsa=DSAConfig(mode=dsa_mode, topk=min(64, seq // 2)), layer_backend=backend)
    trainer = TrainerConfig(seq_length=seq, micro_batch_size=2, global_batch_size=4)
    rc = RunConfig(model=model, parallel=par, precision=PrecisionConfig(dtype="bf16"), trainer=trainer,
                   optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4), scheduler=SchedulerConfig(warmup_steps=1))
    built = build_stage(rc, backend, steps=steps)
    tcfg, ddp, optimizer, scheduler = built.tcfg, built.ddp, built.optimizer, built.scheduler
    probe = configure_model_hooks(tcfg, ddp, optimizer)
    data = _FixedBatch(model.vocab_size, seq, trainer.global_batch_size)
    start, stop = _host_sync_counter(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    records = []
    for step in range(steps):
        start()
        t0 = time.perf_counter()
        stats = train_step(ddp, optimizer, scheduler, data, step * trainer.global_batch_size, trainer,
                           probe, model.mtp_num_steps)
        _sync(device)
        seconds = time.perf_counter() - t0
        syncs = stop()
        records.append({"step": step + 1, "seconds": round(seconds, 4), "lm_loss": stats.lm_loss,
                        "indexer_kl": sum(stats.indexer_kl), "grad_norm": stats.grad_norm,
                        "skipped": stats.skipped,
                        "host_syncs": syncs if syncs is not None else stats.host_syncs})
    # warm-up trains the indexers alone (the network is frozen): their KL is what must fall
    watched = "indexer_kl" if dsa_mode == "warmup" else "lm_loss"
    losses = [r[watched] for r in records]
    out = {"mode": dsa_mode, "backend": backend, "steps": records, "watched": watched,
           "params": sum(p.numel() for c in built.chunks for p in c.parameters()),
           "finite": all(v == v and abs(v) != float("inf") and not r["skipped"] for v, r in zip(losses, records)),
           "falling": len(losses) > 1 and losses[-1] < losses[0]}
    if device == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    if not (out["finite"] and out["falling"]):
        raise RuntimeError(f"{watched} not finite and falling: {losses}")
    return out
