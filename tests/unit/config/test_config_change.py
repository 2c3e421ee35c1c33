"""A resumed run compared with its checkpoint's config: what alters the training is listed with
both values; layout, logging and other run mechanics may change; stages not yet begun may
change; extending a finished schedule is named as such (issue 17, case 7)."""

from __future__ import annotations

from pretrain.config.schema import compose, to_run_config
from pretrain.config.resume_changes import training_changes
from pretrain.curriculum import plan


def _stages(*overrides):
    stages, problems = plan(to_run_config(compose(overrides)))
    assert problems == []
    return stages


def test_sequence_length_and_lr_changes_are_listed_with_both_values():
    old = _stages("curriculum=none")
    new = _stages("curriculum=none", "trainer.seq_length=64", "optimizer.lr=1e-2")
    assert training_changes(old, new, "pretrain", 30) == [
        "optimizer.lr: 0.003 in the checkpoint -> 0.01 now",
        "trainer.seq_length: 128 in the checkpoint -> 64 now"]


def test_run_mechanics_may_change():
    old = _stages("curriculum=none")
    new = _stages("curriculum=none", "parallel.tp=2", "parallel.sequence_parallel=true",
                  "logger.log_every=5", "checkpoint.save_every=3", "trainer.eval_every=10",
                  "model.recompute=full", "data.preprocess.tasks=2", "data.preprocess.workers=4",
                  "faults.max_reloads=1",
                  "trainer.micro_batch_size=2", "data.cache_dir=/tmp/elsewhere")
    assert training_changes(old, new, "pretrain", 30) == []


def test_extending_a_finished_run_is_named():
    old = _stages("curriculum=none", "trainer.steps=60")
    new = _stages("curriculum=none", "trainer.steps=100")
    [change] = training_changes(old, new, "pretrain", 60)
    assert change.startswith("steps: 60 in the checkpoint -> 100 now (extends a finished schedule: the "
                             "extra steps would run at its final LR")
    [mid] = training_changes(old, new, "pretrain", 30)  # mid-run: the schedule itself changes
    assert mid == "steps: 60 in the checkpoint -> 100 now"


def test_curriculum_stages_begun_are_compared_and_later_ones_may_change():
    old = _stages()
    later = _stages("curriculum.stages.4.lr.peak=1e-4", "curriculum.stages.6.steps=12")
    assert training_changes(old, later, "extend_256", 3) == []
    begun = _stages("curriculum.stages.1.lr.peak=1e-4", "curriculum.stages.2.mixture=code_reasoning")
    changes = training_changes(old, begun, "extend_256", 3)
    assert "stage 'pretrain_code_reasoning': optimizer.lr: 0.002 in the checkpoint -> 0.0001 now" in changes
    assert "stage 'extend_256': data.mixture: 'default' in the checkpoint -> 'code_reasoning' now" in changes
    assert any(c.startswith("stage 'extend_256': data.mixtures.<active>.") for c in changes)
    gone = [s for s in _stages() if s.name != "pretrain_code_reasoning"]
    assert training_changes(old, gone, "extend_256", 3)[0] == (
        "stage 'pretrain_code_reasoning': the checkpoint trained this stage; the new config has no "
        "stage of that name")


def test_another_shard_count_is_another_sample_order():
    old = _stages("curriculum=none")  # tasks 0 = one shard per worker (2)
    assert training_changes(old, _stages("curriculum=none", "data.preprocess.workers=4"), "pretrain", 3) == [
        "data.shards_per_corpus: 2 in the checkpoint -> 4 now"]
