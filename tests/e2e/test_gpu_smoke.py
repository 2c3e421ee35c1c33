"""The GPU smoke (``python -m benchmarks.gpu_smoke``) runs on CPU too, under the strict CUDA
emulation, so the script a new GPU node runs first cannot rot: every part either passes or says
why it was skipped, and the training steps are finite with their host syncs counted."""

import json
import subprocess
import sys

import pytest

from tests.support.launch import REPO, train_env


@pytest.mark.heavy
def test_gpu_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu", "--seq", "64",
                           "--steps", "2", "--out", str(out)], cwd=REPO, env=train_env(1),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["environment"]["device"] == "cpu"
    for run in ("local_dense", "local_sparse"):
        steps = report[run]["steps"]
        assert len(steps) == 2 and all(s["lm_loss"] == s["lm_loss"] and not s["skipped"] for s in steps)
        assert all(s["host_syncs"] >= 3 for s in steps), steps
    errors = report["sparse_attention_bf16"]["bf16_rel_err"]
    assert max(errors.values()) <= 2e-2, errors
    for part in ("te_dense", "fp8_indexer_kernel", "sparse_vs_flash_32k"):
        assert "skipped" in report[part]
