"""The tests' rank pool (tests/support/rank_pool.py) runs jobs as ``python -m pretrain.train``
would, one after another in the same ranks: a failed job reports the run's own error and ends
its pool, and the next job gets a fresh pool. (That a pool's runs train exactly as fresh
processes do is held by the resume tests: a run killed in its own process and finished in a pool
logs the straight run's numbers bit for bit.)"""

import pytest

from tests.support import rank_pool
from tests.support.launch import read_metrics, run_train


@pytest.mark.heavy
def test_a_failed_job_reports_its_error_and_the_next_job_runs_in_a_fresh_pool(tmp_path):
    ok = run_train([f"trainer.run_dir={tmp_path / 'a'}", "trainer.steps=2"])
    pool = rank_pool._POOLS[1, "plain"]
    bad = [f"trainer.run_dir={tmp_path / 'b'}", "trainer.steps=2", "optimizer.lr=-1"]
    with pytest.raises(AssertionError, match=r"(?s)ConfigError: invalid run config.*optimizer\.lr=-1"):
        run_train(bad)
    assert not pool.alive()
    again = run_train([f"trainer.run_dir={tmp_path / 'c'}", "trainer.steps=2"])
    assert rank_pool._POOLS[1, "plain"] is not pool
    assert again["final_loss"] == ok["final_loss"]  # the same seed and data: the same first step


@pytest.mark.heavy
def test_a_dense_run_after_a_dsa_run_in_the_same_ranks_logs_no_indexer_kl(tmp_path):
    """megatron's per-layer loss trackers are process-global: a DSA job's indexer KL tracker
    must not outlive it (a dense job after it logged ``indexer_kl`` 0.0 at every step)."""
    run_train([f"trainer.run_dir={tmp_path / 'warmup'}", "trainer.steps=2", "model.dsa.mode=warmup"])
    warmup = read_metrics(str(tmp_path / "warmup"))
    assert "indexer_kl" in warmup[0]
    run_train([f"trainer.run_dir={tmp_path / 'dense'}", "trainer.steps=2", "model.dsa.mode=dense"])
    assert not [k for k in read_metrics(str(tmp_path / "dense"))[0] if k.startswith("indexer_kl")]
