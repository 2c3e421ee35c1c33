"""Resume is exact: 6 steps straight equals 3 steps, a SIGKILL, and a restart that resumes from
the step-3 checkpoint by itself (same losses bit for bit, same final weights and Adam state)."""

import pytest
import torch

from tests.support.launch import assert_resumed_equals_straight, kill_after_checkpoint, run_train

STEPS = 6
COMMON = [f"trainer.steps={STEPS}", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"]


@pytest.mark.heavy
def test_kill_and_resume_matches_straight_run(tmp_path):
    straight = tmp_path / "straight"
    run_train([*COMMON, f"trainer.run_dir={straight}"])

    resumed = tmp_path / "resumed"
    overrides = [*COMMON, f"trainer.run_dir={resumed}", "checkpoint.save_every=3"]
    kill_after_checkpoint(overrides, resumed / "checkpoints" / "latest", "iter_0000003")
    assert not (resumed / "checkpoints" / "iter_0000006").exists()
    summary = run_train(overrides)
    assert summary["steps"] == STEPS

    w_straight, w_resumed = assert_resumed_equals_straight(straight, resumed, STEPS, tmp_path)
    assert "embedding.word_embeddings.weight" in w_straight
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in w_straight
    for k in w_straight:  # weights and optimizer state
        assert torch.equal(w_straight[k], w_resumed[k]), k
