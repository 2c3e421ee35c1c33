"""A checkpoint save on a full or read-only file system (one gloo rank, in-process): every
filesystem step of a save -- the folder, the removal of interrupted saves, megatron's rank-0
metadata, publishing, retention -- fails as a ``CheckpointSaveError`` whose one line names the
checkpoint and the OS error, leaving no ``.tmp`` folder and the previous checkpoint and ``latest``
as they were. The state saved is a small sharded state dict in place of a model's (the writer,
megatron's save and the publishing are the real ones)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from checkpointing import files, writer as writer_mod
from checkpointing.files import CheckpointSaveError
from checkpointing.state import TrainState
from parallel.config import ParallelConfig

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def small_state(step: int) -> dict:
    """What ``full_state`` returns, in small: a sharded tensor and common entries."""
    from megatron.core.dist_checkpointing import ShardedTensor

    weight = torch.arange(4096.0) + step
    return {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0),
            "train_state": {"step": step}, "config_yaml": "x: 1\n"}


def save(w, step: int, stage_final: bool = False):
    report = w.save(None, None, None, TrainState(step=step, stage="s"), "x: 1\n", ParallelConfig(),
                    stage_final=stage_final)
    w.finish()
    return report


@pytest.fixture
def run_dir(tmp_path, one_rank, monkeypatch):
    """A checkpoints folder holding one complete save (iter 2, named by ``latest``)."""
    monkeypatch.setattr(writer_mod, "full_state", lambda *a, **k: small_state(a[3].step))
    ckpts = tmp_path / "checkpoints"
    save(writer_mod.CheckpointWriter(str(ckpts), keep_last=1, async_save=False), 2)
    assert sorted(os.listdir(ckpts)) == ["iter_0000002", "latest"]
    return ckpts


def _fail_on(monkeypatch, target, name, when=lambda *a, **k: True):
    real = getattr(target, name)

    def failing(*args, **kwargs):
        if when(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", str(args[0]) if args else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)


def _steps():
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    return {
        # rank 0's folder for the save
        "makedirs": (os, "makedirs", lambda path, *a, **k: str(path).endswith(".tmp")),
        # an interrupted save's folder that cannot be removed
        "partial-save cleanup": (writer_mod.shutil, "rmtree", lambda path, *a, **k: str(path).endswith(".tmp")
                                 and "onerror" in k),
        # the rank-0-only writes: torch's .metadata, megatron's metadata.json
        ".metadata": (FileSystemWriterAsync, "finish", lambda *a, **k: True),
        "metadata.json": (serialization, "save_config", lambda *a, **k: True),
        # publishing: the rename into place, then latest
        "rename": (writer_mod.os, "rename", lambda src, dst: str(src).endswith(".tmp")),
        "latest": (writer_mod, "write_atomic", lambda path, text: path.endswith("latest")),
        # retention, after latest was replaced
        "retention": (writer_mod, "apply_retention", lambda *a, **k: True),
    }


STEPS = ["makedirs", "partial-save cleanup", ".metadata", "metadata.json", "rename", "latest", "retention"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("step", STEPS)
def test_a_refused_step_fails_the_save_in_one_line_and_leaves_the_run_dir_as_it_was(
        run_dir, monkeypatch, step, async_save):
    if step == "partial-save cleanup":
        (run_dir / "iter_0000003.tmp").mkdir()  # a save a kill interrupted
    before = sorted(os.listdir(run_dir))
    target, name, when = _steps()[step]
    w = writer_mod.CheckpointWriter(str(run_dir), keep_last=1, async_save=async_save)
    _fail_on(monkeypatch, target, name, when)
    with pytest.raises(CheckpointSaveError) as info:
        save(w, 4)
    monkeypatch.undo()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"saving checkpoint {run_dir / 'iter_0000004'} failed: no space left on device; ")
    assert sorted(os.listdir(run_dir)) == before  # no iter_0000004(.tmp), latest as it was
    assert (run_dir / "latest").read_text() == "iter_0000002"
    assert files.verify(str(run_dir / "iter_0000002")) is None
    assert w.in_flight is None


def test_after_a_refused_save_the_next_one_is_published(run_dir, monkeypatch):
    """The failure leaves nothing behind that stops a later save (the async writer too)."""
    w = writer_mod.CheckpointWriter(str(run_dir), keep_last=0, async_save=True)
    _fail_on(monkeypatch, writer_mod, "write_atomic", lambda path, text: path.endswith("latest"))
    with pytest.raises(CheckpointSaveError):
        save(w, 4)
    monkeypatch.undo()
    monkeypatch.setattr(writer_mod, "full_state", lambda *a, **k: small_state(a[3].step))
    save(w, 6)
    assert sorted(os.listdir(run_dir)) == ["iter_0000002", "iter_0000006", "latest"]
    assert (run_dir / "latest").read_text() == "iter_0000006"
    assert files.verify(str(run_dir / "iter_0000006")) is None
