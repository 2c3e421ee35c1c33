"""Resume is exact: 6 steps straight equals 3 steps, a SIGKILL, and a restart that resumes from
the step-3 checkpoint by itself (same losses bit for bit, same final weights and Adam state)."""

import os
import signal
import subprocess
import time

import pytest
import torch

from tests.launch import (QUIET, REPO, checkpoint_tensors, read_metrics, run_train,
                          train_command, train_env)

STEPS = 6
COMMON = [f"trainer.steps={STEPS}", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"]


def _kill_after_checkpoint(overrides, latest_file, wanted, timeout=300):
    proc = subprocess.Popen(train_command([*QUIET, *overrides]), cwd=REPO, env=train_env(1),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if latest_file.exists() and latest_file.read_text().strip() == wanted:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        raise AssertionError("no checkpoint appeared in time")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.heavy
def test_kill_and_resume_matches_straight_run(tmp_path):
    straight = tmp_path / "straight"
    run_train([*COMMON, f"trainer.run_dir={straight}"])

    resumed = tmp_path / "resumed"
    overrides = [*COMMON, f"trainer.run_dir={resumed}", "checkpoint.save_every=3"]
    _kill_after_checkpoint(overrides, resumed / "checkpoints" / "latest", "iter_0000003")
    assert not (resumed / "checkpoints" / "iter_0000006").exists()
    summary = run_train(overrides)
    assert summary["steps"] == STEPS

    want, have = read_metrics(str(straight)), read_metrics(str(resumed))
    assert [r["step"] for r in have] == list(range(1, STEPS + 1))
    for a, b in zip(want, have):
        for key in ("loss", "lm_loss", "mtp_loss", "lr", "grad_norm", "consumed_tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])

    w_straight = checkpoint_tensors(straight / "checkpoints" / "iter_0000006", tmp_path)
    w_resumed = checkpoint_tensors(resumed / "checkpoints" / "iter_0000006", tmp_path)
    assert w_straight.keys() == w_resumed.keys()
    assert "embedding.word_embeddings.weight" in w_straight
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in w_straight
    for k in w_straight:  # weights and optimizer state
        assert torch.equal(w_straight[k], w_resumed[k]), k
