"""Tiny GLM-5 throughput on CPU ranks, and the cost of the CPU emulation.

1. tokens/s of full training steps (megatron schedule, DDP, optimizer) at 1 rank and at 4 ranks
   (TP2 x PP2, same global batch), median over steps after warm-up;
2. one rank, model forward+backward with vs without the CUDA->CPU TorchFunctionMode
   (interleaved repetitions, medians).

    .venv/bin/python benchmarks/throughput.py [--steps 12] [--reps 15]
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.runs import read_metrics, run_train  # noqa: E402


def training_tokens_per_s(steps: int) -> list[tuple[str, int, float, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, extra in (("1 rank", 1, []), ("TP2xPP2", 4, ["parallel=tp2_pp2"])):
            run_dir = os.path.join(tmp, name.replace(" ", "_"))
            run_train([f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
                       "checkpoint.save_at_end=false", *extra], nproc=nproc)
            recs = read_metrics(run_dir)[2:]
            rows.append((name, nproc, statistics.median(r["tokens_per_s"] for r in recs),
                         statistics.median(r["step_time_s"] for r in recs)))
    return rows


def emulation_overhead(reps: int) -> tuple[float, float]:
    import torch

    from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.megatron_compat import cpu_emulation
    from parallel.config import ParallelConfig
    from parallel.initialize import initialize

    par = ParallelConfig()
    initialize(par, seed=1234)
    cfg = GLM5Config()
    model = build_model_chunks(cfg, to_transformer_config(cfg, par, PrecisionConfig()), "local")[0]
    ids = torch.randint(0, 256, (4, 128))
    pos = torch.arange(128).expand(4, 128)

    def fwd_bwd() -> float:
        t0 = time.perf_counter()
        model(ids, pos, None, labels=ids).mean().backward()
        return time.perf_counter() - t0

    for _ in range(3):
        fwd_bwd()
    with_mode, without = [], []
    for _ in range(reps):
        with_mode.append(fwd_bwd())
        with cpu_emulation.device_mode_suspended():
            without.append(fwd_bwd())
    return statistics.median(with_mode), statistics.median(without)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()

    rows = training_tokens_per_s(args.steps)
    base = rows[0][2]
    print("\nTiny GLM-5 training throughput (global batch 16 x 128 tokens, fp32, CPU, median)")
    print(f"{'layout':<10} {'ranks':>5} {'tokens/s':>10} {'step s':>8} {'vs 1 rank':>10}")
    for name, nproc, tps, step in rows:
        print(f"{name:<10} {nproc:>5} {tps:>10.0f} {step:>8.3f} {tps / base:>9.2f}x")

    with_mode, without = emulation_overhead(args.reps)
    print("\nCPU emulation overhead (one rank, model forward+backward, 4 x 128 tokens, median)")
    print(f"{'variant':<28} {'seconds':>8} {'ratio':>7}")
    print(f"{'without TorchFunctionMode':<28} {without:>8.4f} {1.0:>7.2f}")
    print(f"{'with TorchFunctionMode':<28} {with_mode:>8.4f} {with_mode / without:>7.2f}")


if __name__ == "__main__":
    main()
