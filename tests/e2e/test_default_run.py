"""The default run (what `make run` does, with only the run dir moved to a temp folder):
the tiny GLM-5 trains on CPU in under 3 minutes, loss clearly falling, leaving DESIGN.md's run
directory and a one-line JSON summary as the last stdout line."""

import json
import os
import subprocess
import time

import pytest
import yaml

from tests.launch import REPO, read_metrics, train_env


@pytest.mark.heavy
def test_default_run(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = subprocess.run(
        [os.path.join(REPO, ".venv", "bin", "python"), "-m", "pretrain.train", f"trainer.run_dir={run_dir}"],
        cwd=REPO, env=train_env(1), capture_output=True, text=True, timeout=600,
    )
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert elapsed < 180, f"default run took {elapsed:.0f} s"

    for key in ("run_dir", "steps", "consumed_tokens", "initial_loss", "final_loss", "stages"):
        assert key in summary
    assert summary["steps"] == 60 and summary["consumed_tokens"] == 60 * 16 * 128
    assert summary["final_loss"] < 0.6 * summary["initial_loss"], summary

    metrics = read_metrics(str(run_dir))
    assert len(metrics) == 60
    for key in ("step", "stage", "consumed_tokens", "loss", "lm_loss", "mtp_loss", "lr",
                "grad_norm", "tokens_per_s", "tflops_per_s", "moe_load_imbalance"):
        assert key in metrics[0], key
    lm = [r["lm_loss"] for r in metrics]
    assert sum(lm[-5:]) / 5 < sum(lm[:5]) / 5 - 1.0  # clearly falling

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["num_layers"] == 4 and config["trainer"]["steps"] == 60
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000060"
    assert (ckpts / "iter_0000060" / "metadata.json").exists()
    assert not list(ckpts.glob("*.tmp"))
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, "W&B offline run expected (default mode)"
