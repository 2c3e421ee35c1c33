"""Muon Split vs Adam on the tiny GLM-5: training loss after N steps at each one's tuned LR.

1. LR sweep: ``--sweep-steps`` steps per (optimizer, peak LR), cosine to LR/10, warmup 10;
   the LR with the lowest mean lm_loss over the last 10 steps wins (per optimizer);
2. ``--steps`` steps (default 200) for each optimizer at its winning LR; the table gives the final
   lm_loss and the mean over the last 10 steps, and muon_split / adam ratios.
Both optimizers: same data, seed, global batch (16 x 128), weight decay 0.1, fp32, one rank.
Muon's LR applies to its matrices (update RMS matched to Adam's); Adam's to everything else,
so one peak LR is swept for both groups together.

    .venv/bin/python benchmarks/muon.py [--steps 200] [--sweep-steps 60] [--lrs 1e-3,3e-3,1e-2]
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

OPTIMIZERS = ("adam", "muon_split")


def _overrides(name: str, lr: float) -> list[str]:
    lrs = [f"optimizer.lr={lr}", f"optimizer.min_lr={lr / 10}"]
    if name == "muon_split":
        lrs += [f"optimizer.muon.lr={lr}", f"optimizer.muon.min_lr={lr / 10}"]
    return [f"optimizer={name}", *lrs]


def train(tmp: str, name: str, lr: float, steps: int) -> list[dict]:
    run_dir = os.path.join(tmp, f"{name}-{lr:g}-{steps}")
    run_train([f"trainer.run_dir={run_dir}", f"trainer.steps={steps}", "checkpoint.save_at_end=false",
               "scheduler.warmup_steps=10", *_overrides(name, lr)], timeout=24 * 3600)
    return read_metrics(run_dir)


def tail_loss(records: list[dict], n: int = 10) -> float:
    return statistics.mean(r["lm_loss"] for r in records[-n:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sweep-steps", type=int, default=60)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    args = ap.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        best = {}
        print(f"\nLR sweep ({args.sweep_steps} steps, mean lm_loss of the last 10)")
        print(f"{'optimizer':<11} " + " ".join(f"{lr:>9g}" for lr in lrs))
        for name in OPTIMIZERS:
            losses = {lr: tail_loss(train(tmp, name, lr, args.sweep_steps)) for lr in lrs}
            best[name] = min(losses, key=losses.get)
            print(f"{name:<11} " + " ".join(f"{losses[lr]:>9.4f}" for lr in lrs), flush=True)

        rows = []
        for name in OPTIMIZERS:
            recs = train(tmp, name, best[name], args.steps)
            rows.append((name, best[name], recs[0]["lm_loss"], recs[-1]["lm_loss"], tail_loss(recs),
                         statistics.median(r["step_time_s"] for r in recs[2:])))
    adam = rows[0]
    print(f"\nTiny GLM-5, {args.steps} steps, global batch 16 x 128, fp32, one rank, tuned peak LR")
    print(f"{'optimizer':<11} {'peak LR':>8} {'first':>8} {'final':>8} {'last-10':>8} {'vs adam':>8} "
          f"{'s/step':>7}")
    for name, lr, first, final, last10, step_s in rows:
        print(f"{name:<11} {lr:>8g} {first:>8.4f} {final:>8.4f} {last10:>8.4f} {last10 / adam[4]:>7.3f}x "
              f"{step_s:>7.2f}")


if __name__ == "__main__":
    main()
