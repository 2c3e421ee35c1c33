"""Read an offline W&B run back with wandb's own reader (``wandb leet inspect --json``, which
decodes the run's ``.wandb`` transaction log record by record)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def records(run_path: str) -> list[dict]:
    """Every record of one offline run (a run folder or its .wandb file)."""
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    proc = subprocess.run([wandb_cli, "leet", "inspect", "--json", run_path], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        raise AssertionError(f"wandb leet inspect failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def run_id(recs: list[dict]) -> str:
    (run,) = [r["run"] for r in recs if r["type"] == "run"]
    return run["run_id"]


def history(recs: list[dict]) -> dict[int, dict]:
    """step -> the logged values (W&B's own ``_step``/``_runtime``/``_timestamp`` removed)."""
    out = {}
    for r in recs:
        if r["type"] == "history":
            item = {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            out[int(r["history"]["step"]["num"])] = item
    return out
