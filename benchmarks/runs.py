"""Training runs for the benchmarks: ``python -m pretrain.train`` in processes of its own (under
torchrun for more ranks), as a user launches it. The benchmarks read per-step times after warm-up
from the run's metrics.jsonl, which a process's import time does not reach."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from parallel.initialize import free_port
from pretrain.train import read_metrics as _read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: every benchmark run: no W&B, no progress bar, one stage (trainer.steps) with a short warm-up
#: (a benchmark that trains a curriculum passes curriculum=... and its stages' schedules)
OFFLINE = ["logger.wandb.mode=disabled", "logger.progress_bar=false"]
ONE_STAGE = ["scheduler.warmup_steps=1", "curriculum=none"]


def run_train(overrides: list[str], nproc: int = 1, timeout: int = 3600) -> dict:
    """Train to the end; the JSON summary the run prints. Exits naming the run's output when it
    fails."""
    own_stages = any(o.startswith("curriculum=") for o in overrides)
    argv = [*OFFLINE, *([] if own_stages else ONE_STAGE), *overrides]
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1" if nproc > 1 else
               os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    proc = subprocess.run([*launch, "-m", "pretrain.train", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"error: training run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_metrics(run_dir: str) -> list[dict]:
    """The run's metrics.jsonl, the last record of each step."""
    return _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
