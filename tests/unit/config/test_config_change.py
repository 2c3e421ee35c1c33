"""A resumed run compared with its checkpoint's config: what alters the training is listed with
both values; layout, logging and other run mechanics may change; stages not yet begun may
change; extending a finished schedule is named as such (issue 17, case 7)."""

from __future__ import annotations

import copy

import pytest

from pretrain.config.schema import compose, to_run_config
from pretrain.config.resume_changes import CurriculumOrderChanged, training_changes
from pretrain.curriculum import StageConfig, StageLRConfig, plan


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
    mid, stream = training_changes(old, new, "pretrain", 30)  # mid-run: the schedule itself changes
    assert mid == "steps: 60 in the checkpoint -> 100 now"
    assert stream.startswith("data stream samples (the length its sample index is built for): 960 in the "
                             "checkpoint -> 1600 now; megatron orders")  # ... and its data's order


def test_curriculum_stages_begun_are_compared_and_later_ones_may_change():
    old = _stages()
    later = _stages("curriculum.stages.4.lr.peak=1e-4", "curriculum.stages.6.steps=12")
    assert training_changes(old, later, "extend_256", 3) == []
    begun = _stages("curriculum.stages.1.lr.peak=1e-4", "curriculum.stages.2.mixture=code_reasoning")
    changes = training_changes(old, begun, "extend_256", 3)
    assert "stage 'pretrain_code_reasoning': optimizer.lr: 0.002 in the checkpoint -> 0.0001 now" in changes
    assert "stage 'extend_256': data.mixture: 'default' in the checkpoint -> 'code_reasoning' now" in changes
    assert any(c.startswith("stage 'extend_256': data.mixtures.<active>.") for c in changes)


def _reordered(edit):
    """The tiny curriculum's stages after ``edit`` (a function of the list of StageConfig)."""
    rc = to_run_config(compose([]))
    rc.curriculum.stages = edit(copy.deepcopy(rc.curriculum.stages))
    stages, problems = plan(rc)
    assert problems == []
    return stages


TAIL = ("stages before or at the resumed one cannot be inserted, removed or moved, not even with "
        "checkpoint.allow_config_change=true (restore the order, or start a new run dir with "
        "checkpoint.init_from=<the checkpoint>)")
BEGUN = "['pretrain_general', 'pretrain_code_reasoning', 'extend_256']"


def _insert_warmup(stages):
    stages.insert(1, StageConfig(name="warm_128", steps=2, seq_length=128, global_batch_size=16,
                                  lr=StageLRConfig(warmup_steps=0)))
    return stages


@pytest.mark.parametrize("edit, message", [
    (_insert_warmup,  # same stream as pretrain_general: every later offset on it would move too
     f"(inserted: 'warm_128'): {BEGUN} in the checkpoint -> "
     "['pretrain_general', 'warm_128', 'pretrain_code_reasoning', 'extend_256'] now; "),
    (lambda st: [s for s in st if s.name != "pretrain_code_reasoning"],
     f"(removed: 'pretrain_code_reasoning'): {BEGUN} in the checkpoint -> "
     "['pretrain_general', 'extend_256'] now; "),
    (lambda st: [st[1], st[0]] + st[2:],
     f"(reordered): {BEGUN} in the checkpoint -> "
     "['pretrain_code_reasoning', 'pretrain_general', 'extend_256'] now; "),
    (lambda st: [st[0], st[2], st[1]] + st[3:],  # the checkpoint's own stage moved earlier
     f"(moved after it: 'pretrain_code_reasoning'): {BEGUN} in the checkpoint -> "
     "['pretrain_general', 'extend_256'] now; "),
    (lambda st: [st[0], st[3], st[1], st[2]] + st[4:],  # a stage not yet begun moved before it
     f"(moved before it: 'extend_512'): {BEGUN} in the checkpoint -> "
     "['pretrain_general', 'extend_512', 'pretrain_code_reasoning', 'extend_256'] now; "),
], ids=["insert-before", "remove-before", "reorder-before", "move-resumed-stage", "move-later-before"])
def test_stages_before_the_resumed_one_keep_their_order(edit, message):
    """Inserted, removed or moved before (or at) the checkpoint's stage: one line naming the
    stages and both orders; an error that allow_config_change does not accept."""
    with pytest.raises(CurriculumOrderChanged) as e:
        training_changes(_stages(), _reordered(edit), "extend_256", 3)
    assert e.value.brief() == ("cannot resume: the curriculum's stages up to the checkpoint's stage "
                               f"'extend_256' changed {message}{TAIL}")


def test_stages_after_the_resumed_one_may_be_added_removed_or_moved():
    old = _stages()
    appended = _reordered(lambda st: st + [StageConfig(name="extra_1024", steps=3, seq_length=1024,
                                                       global_batch_size=2, micro_batch_size=2, dsa_mode="sparse",
                                                       lr=StageLRConfig(warmup_steps=0))])
    assert training_changes(old, appended, "extend_256", 3) == []
    right_after = _reordered(lambda st: st[:3] + [StageConfig(name="extra_256", steps=2, seq_length=256,
                                                              global_batch_size=8,
                                                              lr=StageLRConfig(warmup_steps=0))] + st[3:])
    assert training_changes(old, right_after, "extend_256", 6) == []  # finished: extra_256 runs next
    assert training_changes(old, _reordered(lambda st: st[:3] + st[4:]), "extend_256", 3) == []


def test_a_begun_stage_that_moves_in_its_data_stream_is_listed():
    """dsa_warmup continues extend_1024's stream (long_context at 1024) after its 4 x 2 samples."""
    old = _stages()
    longer = _stages("curriculum.stages.4.steps=6")
    assert training_changes(old, longer, "dsa_warmup", 3) == [
        "stage 'extend_1024': steps: 4 in the checkpoint -> 6 now",
        "stage 'dsa_warmup': data offset (samples of its data stream read by earlier stages): "
        "8 in the checkpoint -> 12 now",
        f"stage 'dsa_warmup': {STREAM} 36 in the checkpoint -> 40 now; {REORDERS} 14 {KEEP}"]
    own_stream = _stages("curriculum.stages.4.mixture=default")  # extend_1024 leaves the stream
    changes = training_changes(old, own_stream, "dsa_warmup", 3)
    assert changes[-3:] == [
        "stage 'dsa_warmup': data stream continues stage: 'extend_1024' in the checkpoint -> None now",
        "stage 'dsa_warmup': data offset (samples of its data stream read by earlier stages): "
        "8 in the checkpoint -> 0 now",
        f"stage 'dsa_warmup': {STREAM} 36 in the checkpoint -> 28 now (the stream's stages: {LONG_1024} in "
        f"the checkpoint -> ['dsa_warmup', 'dsa_sparse'] now); {REORDERS} 14 {KEEP}"]
    assert training_changes(old, longer, "extend_512", 3) == []  # extend_1024 not begun: free


STREAM = "data stream samples (the length its sample index is built for):"
REORDERS = ("megatron orders even the stream's first samples by its length (a concat corpus whose epoch "
            "count changes is reshuffled), so this stage would go on from sample")
KEEP = "of another order than the one it trained on: keep the stream's stages as they were until this stage has ended"
LONG_1024 = "['extend_1024', 'dsa_warmup', 'dsa_sparse']"  # long_context at 1024: one stream


def _append_sparse(stages):
    """A stage after dsa_sparse on the same data: it continues their stream (4 x 2 more samples)."""
    return stages + [StageConfig(name="sparse_more", steps=4, seq_length=1024, global_batch_size=2,
                                 micro_batch_size=2, mixture="long_context", dsa_mode="sparse",
                                 lr=StageLRConfig(warmup_steps=0))]


def test_a_stage_appended_on_the_resumed_stages_stream_is_listed():
    """The stream's index is built for all its stages' samples, and megatron orders its first
    samples by that count: the rest of the resumed stage would read another order (measured on
    the default data: a concat corpus whose epoch count changes is reshuffled from sample 0)."""
    old, appended = _stages(), _reordered(_append_sparse)
    assert training_changes(old, appended, "dsa_warmup", 3) == [
        f"stage 'dsa_warmup': {STREAM} 36 in the checkpoint -> 44 now (the stream's stages: {LONG_1024} "
        f"in the checkpoint -> {LONG_1024[:-1]}, 'sparse_more'] now); {REORDERS} 14 {KEEP}"]
    [sparse] = training_changes(old, appended, "dsa_sparse", 5)
    assert sparse.startswith(f"stage 'dsa_sparse': {STREAM} 36 in the checkpoint -> 44 now") and \
        f"{REORDERS} 34 of" in sparse  # 24 before it + 5 x 2 of its own
    assert training_changes(old, appended, "dsa_warmup", 8) == []  # ended: sparse_more is not begun
    assert training_changes(old, appended, "dsa_sparse", 6) == []
    assert training_changes(old, appended, "extend_512", 2) == []  # another stream (512)


def test_a_new_stream_length_is_one_error_line_or_recorded(monkeypatch, tmp_path):
    import json

    from pretrain.config.errors import ConfigError

    rc = to_run_config(compose([]))
    rc.curriculum.stages = _append_sparse(rc.curriculum.stages)
    state = {"stage": "dsa_warmup", "stage_step": 3, "step": 43}
    with pytest.raises(ConfigError) as e:
        _resume_check(monkeypatch, tmp_path, [], rc, state)
    assert e.value.brief() == (
        "the config trains differently from the one ckpt/iter_0000003 was trained with (to accept and "
        f"record it: checkpoint.allow_config_change=true): stage 'dsa_warmup': {STREAM} 36 in the checkpoint "
        f"-> 44 now (the stream's stages: {LONG_1024} in the checkpoint -> {LONG_1024[:-1]}, 'sparse_more'] "
        f"now); {REORDERS} 14 {KEEP}")
    assert not (tmp_path / "config_history.jsonl").exists()
    rc.checkpoint.allow_config_change = True
    _resume_check(monkeypatch, tmp_path, [], rc, state)
    [entry] = [json.loads(line) for line in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert entry["step"] == 43 and entry["changes"] == [e.value.problems[0]]


def test_another_shard_count_is_another_sample_order():
    old = _stages("curriculum=none")  # tasks 0 = one shard per worker (2)
    assert training_changes(old, _stages("curriculum=none", "data.preprocess.workers=4"), "pretrain", 3) == [
        "data.shards_per_corpus: 2 in the checkpoint -> 4 now"]


def _resume_check(monkeypatch, tmp_path, old_overrides, new_rc, state):
    """pretrain.train's resume check against a checkpoint trained with ``old_overrides`` (its
    common state read from memory: the check reads nothing else of it)."""
    from omegaconf import OmegaConf

    from checkpointing import state as checkpoint
    from pretrain import train

    yaml = OmegaConf.to_yaml(compose(list(old_overrides)), resolve=True)
    monkeypatch.setattr(checkpoint, "read_common", lambda path: {"config_yaml": yaml})
    stages, problems = plan(new_rc)
    assert problems == []
    train._check_config_change(new_rc, stages, "ckpt/iter_0000003", state, str(tmp_path), 0)


def test_allow_config_change_records_a_moved_offset_but_not_a_new_order(monkeypatch, tmp_path):
    import json

    longer = to_run_config(compose(["curriculum.stages.4.steps=6", "checkpoint.allow_config_change=true"]))
    _resume_check(monkeypatch, tmp_path, [], longer, {"stage": "dsa_warmup", "stage_step": 3, "step": 43})
    [entry] = [json.loads(line) for line in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert entry["step"] == 43 and entry["changes"][1:] == [
        "stage 'dsa_warmup': data offset (samples of its data stream read by earlier stages): "
        "8 in the checkpoint -> 12 now",
        f"stage 'dsa_warmup': {STREAM} 36 in the checkpoint -> 40 now; {REORDERS} 14 {KEEP}"]
    (tmp_path / "config_history.jsonl").unlink()
    reordered = to_run_config(compose(["checkpoint.allow_config_change=true"]))
    reordered.curriculum.stages = [reordered.curriculum.stages[i] for i in (1, 0, 2, 3, 4, 5, 6)]
    with pytest.raises(CurriculumOrderChanged, match=r"^cannot resume:\n  - the curriculum's stages up to"):
        _resume_check(monkeypatch, tmp_path, [], reordered, {"stage": "extend_256", "stage_step": 3, "step": 29})
    assert not (tmp_path / "config_history.jsonl").exists()  # refused: nothing recorded
