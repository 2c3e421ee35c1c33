"""``checkpoint.init_from`` gets the verification resume gets (issue 17, case 6): a damaged
checkpoint is named before any compute, a run's checkpoints folder (or the run dir) stands for
its newest complete checkpoint, and anything else is refused with a hint."""

from __future__ import annotations

import pytest

from checkpointing import state as checkpoint
from pretrain.config.schema import compose, to_run_config
from pretrain.config.validation import ConfigError, plan_run
from tests.support.checkpoints import fake_checkpoint


def test_a_checkpoints_folder_or_run_dir_stands_for_its_newest_complete_checkpoint(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    fake_checkpoint(ckpts, 2)
    newest = fake_checkpoint(ckpts, 4)
    assert checkpoint.resolve_init_from(str(ckpts)) == (str(newest), None)
    assert checkpoint.resolve_init_from(str(tmp_path / "run")) == (str(newest), None)
    assert checkpoint.resolve_init_from(str(newest)) == (str(newest), None)


def test_a_damaged_checkpoint_is_named_before_any_compute(tmp_path):
    folder = fake_checkpoint(tmp_path, 2)
    (folder / "__0_0.distcp").write_text("y" * 10)
    rc = to_run_config(compose(["curriculum=none", f"checkpoint.init_from={folder}"]))
    with pytest.raises(ConfigError) as e:
        plan_run(rc, 1)
    assert e.value.problems == [f"checkpoint.init_from={folder}: damaged checkpoint "
                                f"(__0_0.distcp has 10 bytes, 1000 expected)"]


def test_not_a_checkpoint(tmp_path):
    assert checkpoint.resolve_init_from(str(tmp_path / "nope")) == (
        None, f"checkpoint.init_from={tmp_path / 'nope'}: no such folder")
    (tmp_path / "notes").mkdir()
    _, why = checkpoint.resolve_init_from(str(tmp_path / "notes"))
    assert why == (f"checkpoint.init_from={tmp_path / 'notes'} is not a checkpoint folder (no "
                   f"metadata.json); give an iter_* folder, a run's checkpoints/ folder or an HF import")
