"""Stage changes must not slow the stages after them: N identical short stages in one process
(the tiny GLM-5, one rank, dense, sequence 128, global batch 16, the default mixture), median
s/step of each stage and its ratio to the first stage's. Target: every ratio <= 1.1.

    .venv/bin/python benchmarks/stages.py [--stages 3] [--steps 6] [--nproc 1]

Each stage starts from the previous stage's final checkpoint (save, rebuild of model, optimizer,
process groups and data, load), as in every curriculum; the first step of each stage is left out
of its median (it includes first-touch allocations).
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.runs import read_metrics, run_train  # noqa: E402


def curriculum(stages: int, steps: int) -> str:
    stage = ("{{name: stage_{i}, steps: %d, seq_length: 128, global_batch_size: 16, "
             "micro_batch_size: 4, lr: {{peak: 1.0e-3, end: 1.0e-3, style: constant, warmup_steps: 0}}, "
             "mixture: default, dsa_mode: dense}}") % steps
    lines = ["stages:"] + [f"  - {stage.format(i=i + 1)}" for i in range(stages)]
    return "\n".join(lines + ["start: null", "only: null", "plot: false", ""])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "conf", "curriculum"))
        with open(os.path.join(tmp, "conf", "curriculum", "bench.yaml"), "w") as f:
            f.write(curriculum(args.stages, args.steps))
        run_dir = os.path.join(tmp, "run")
        run_train([f"hydra.searchpath=[file://{tmp}/conf]", "curriculum=bench",
                   f"trainer.run_dir={run_dir}", "checkpoint.save_at_end=false"],
                  nproc=args.nproc, timeout=24 * 3600)
        records = read_metrics(run_dir)
    by_stage: dict[str, list[float]] = {}
    for r in records:
        by_stage.setdefault(r["stage"], []).append(r["step_time_s"])
    medians = {name: statistics.median(times[1:] or times) for name, times in by_stage.items()}
    first = next(iter(medians.values()))
    print(f"\n{args.stages} identical stages x {args.steps} steps, {args.nproc} rank(s)")
    print(f"{'stage':<10} {'median s/step':>14} {'vs stage 1':>11}")
    for name, m in medians.items():
        print(f"{name:<10} {m:>14.3f} {m / first:>10.2f}x")
    worst = max(m / first for m in medians.values())
    print(f"worst ratio {worst:.2f}x (target <= 1.10x)")


if __name__ == "__main__":
    main()
