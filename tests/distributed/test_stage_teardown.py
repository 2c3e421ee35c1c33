"""A stage change leaves nothing of the finished stage behind: its model chunks and optimizer
are freed, process groups are destroyed when the layout changes and kept when it does not, and
the process's thread count does not grow (2 gloo ranks, DP2 -> TP2 -> TP2 -> DP2)."""

import json
import subprocess
import sys

import pytest

from tests.support.launch import REPO, free_port, quiet, train_env

pytestmark = pytest.mark.all_cores  # a two-rank run of its own

STAGES = """
stages:
  - {name: dp2_a, steps: 1, seq_length: 64, global_batch_size: 4, micro_batch_size: 2,
     lr: {peak: 1.0e-3, end: 1.0e-3, style: constant, warmup_steps: 0}, dsa_mode: dense}
  - {name: tp2_a, steps: 1, seq_length: 64, global_batch_size: 4, micro_batch_size: 2,
     lr: {peak: 1.0e-3, end: 1.0e-3, style: constant, warmup_steps: 0}, parallel: {tp: 2, sequence_parallel: true}}
  - {name: tp2_b, steps: 1, seq_length: 64, global_batch_size: 4, micro_batch_size: 2,
     lr: {peak: 1.0e-3, end: 1.0e-3, style: constant, warmup_steps: 0}, parallel: {tp: 2, sequence_parallel: true}}
  - {name: dp2_b, steps: 1, seq_length: 64, global_batch_size: 4, micro_batch_size: 2,
     lr: {peak: 1.0e-3, end: 1.0e-3, style: constant, warmup_steps: 0}}
start: null
only: null
plot: false
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    root = tmp_path_factory.mktemp("teardown")
    (root / "conf" / "curriculum").mkdir(parents=True)
    (root / "conf" / "curriculum" / "four.yaml").write_text(STAGES)
    run_dir = root / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", "-m", "tests.support.stage_probe", *quiet(["curriculum=four"]),
           f"hydra.searchpath=[file://{root / 'conf'}]", "curriculum=four",
           f"trainer.run_dir={run_dir}", "checkpoint.save_at_end=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads((run_dir / f"stage_probe.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.heavy
def test_finished_stages_models_and_optimizers_are_freed(probes):
    for records in probes:
        assert [r["stage"] for r in records] == ["dp2_a", "tp2_a", "tp2_b", "dp2_b"]
        for r in records:
            assert r["alive"] == [], r


@pytest.mark.heavy
def test_groups_are_rebuilt_on_a_layout_change_and_kept_otherwise(probes):
    for records in probes:
        names = [r["tp_group"] for r in records]
        assert names[1] != names[0]  # DP2 -> TP2: new groups
        assert names[2] == names[1]  # TP2 -> TP2: the same groups
        assert names[3] != names[2]  # TP2 -> DP2: new groups again
        # megatron's groups (built during the first stage) are the only ones besides the default
        groups = [r["groups"] for r in records]
        assert groups[1] > 1 and groups[1:] == [groups[1]] * 3, groups


@pytest.mark.heavy
def test_thread_count_does_not_grow_across_stage_changes(probes):
    for records in probes:
        threads = [r["threads"] for r in records]
        # the first stage starts before megatron's groups exist; from then on every stage
        # starts with the same threads (gloo's per-group threads of destroyed groups exit)
        assert threads[2:] == [threads[1]] * 2, threads
