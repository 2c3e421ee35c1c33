"""Launches that stop before training, run in this process (``pretrain.train.run`` as ``python -m
pretrain.train`` calls it):

- one the resume checks refuse leaves the run dir as it was: the checks run before the data
  build, the run-dir lock and the logs, so no ``data_index/``, ``.locks/``, ``logs/``,
  ``run.lock`` or ``config.yaml`` appears or changes (shown on a finished run whose
  ``data_index/``, ``.locks/`` and ``logs/`` were removed; a changed sequence length needs a new
  sample index, which a launch that builds before it checks would write);
- ``checkpoint.init_from`` whose checkpoint is deleted (its run's retention) while this run
  checks it or loads it: one error naming the folder and that it disappeared, no traceback from
  the load, no checkpoint or metrics record written."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.in_process_launch import leftovers_put_back, tree
from tests.support.launch import QUIET, run_train


@pytest.fixture
def in_process_launch():
    """``pretrain.train.run`` here, and afterwards whatever a refused launch leaves in this
    process put back (its log routing, signal handlers, a process group, if it started one)."""
    def launch(overrides):
        from pretrain import train
        from pretrain.config.command_line import resolve
        from pretrain.config.schema import compose

        overrides = [*QUIET, *overrides]
        return train.run(*resolve(compose(overrides), overrides), overrides=overrides)

    with leftovers_put_back():
        yield launch


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_train([f"trainer.run_dir={run_dir}", "trainer.steps=2"])
    return run_dir


def test_a_refused_resume_leaves_the_run_dir_as_it_was(finished, tmp_path, in_process_launch):
    from pretrain.config.errors import ConfigError

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    for made_by_the_launch in ("data_index", ".locks", "logs"):
        shutil.rmtree(run_dir / made_by_the_launch, ignore_errors=True)  # the pool builds without .locks/
    before = tree(run_dir)
    assert "checkpoints/iter_0000002/manifest.json" in before and "config.yaml" in before

    with pytest.raises(ConfigError) as e:
        in_process_launch([f"trainer.run_dir={run_dir}", "trainer.steps=2", "trainer.seq_length=64"])
    assert "trainer.seq_length: 128 in the checkpoint -> 64 now" in e.value.brief()
    after = tree(run_dir)
    assert sorted(set(after) - set(before)) == []  # no data_index/, .locks/, logs/, run.lock
    assert after == before  # and nothing there changed (config.yaml, metrics.jsonl, checkpoints)


def _checkpoint_copy(finished, tmp_path):
    """A checkpoint folder of its own (the test deletes it), as another run's retention would."""
    source = tmp_path / "other_run" / "iter_0000002"
    shutil.copytree(finished / "checkpoints" / "iter_0000002", source)
    return source


def test_init_from_deleted_while_checked_is_named(finished, tmp_path, monkeypatch):
    from checkpointing import files

    source = _checkpoint_copy(finished, tmp_path)
    verify = files.verify

    def deleted_meanwhile(folder):
        shutil.rmtree(source)  # the source run's keep_last retention, between the check's steps
        return verify(folder)

    monkeypatch.setattr(files, "verify", deleted_meanwhile)
    assert files.resolve_init_from(str(source)) == (None, (
        f"checkpoint.init_from={source}: {source} disappeared while this run checked it (deleted "
        f"meanwhile, e.g. by the checkpoint retention of the run that wrote it)"))


def test_init_from_deleted_while_loaded_is_one_error_and_writes_nothing(finished, tmp_path, monkeypatch,
                                                                      in_process_launch):
    from checkpointing import state
    from pretrain.config.errors import ConfigError

    source = _checkpoint_copy(finished, tmp_path)
    load = state.load

    def deleted_meanwhile(path, *args, **kwargs):
        if os.path.abspath(path) == str(source):
            shutil.rmtree(source)  # after every check, as the weights are read
        return load(path, *args, **kwargs)

    monkeypatch.setattr(state, "load", deleted_meanwhile)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        in_process_launch([f"trainer.run_dir={run_dir}", "trainer.steps=2", f"checkpoint.init_from={source}"])
    assert e.value.brief() == (
        f"checkpoint.init_from={source}: {source} disappeared while this run loaded it (deleted "
        f"meanwhile, e.g. by the checkpoint retention of the run that wrote it); start from a "
        f"checkpoint that stays: a stage's final checkpoint (retention keeps those) or a copy")
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no traceback of the load
    assert not (run_dir / "checkpoints").exists()  # nothing trained, nothing saved
    assert (run_dir / "metrics.jsonl").read_text() == ""
