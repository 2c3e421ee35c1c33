"""Disk full during a checkpoint save (issue 17, case 10): the run stops with a message naming
the checkpoint, the cause and the space left; the partial folder is removed; the previous
checkpoint and ``latest`` stay intact and the rerun resumes from them."""

from __future__ import annotations

import errno
import os
import subprocess
import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from checkpointing import state as checkpoint
from tests.support.launch import QUIET, REPO, train_command, train_env


def test_the_cause_is_found_inside_torch_checkpoint_failures(tmp_path):
    inner = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.distcp"))
    wrapped = CheckpointException("save", {0: (inner, traceback.extract_stack())})  # torch's shape
    try:
        raise RuntimeError("Worker failure") from wrapped
    except RuntimeError as e:
        msg = checkpoint.save_failure(str(tmp_path / "iter_0000004"), str(tmp_path / "iter_0000004.tmp"), e)
    assert msg.startswith(f"saving checkpoint {tmp_path / 'iter_0000004'} failed: no space left on device; ")
    assert "GiB free of" in msg and "iter_0000004.tmp was removed" in msg
    perm = checkpoint.save_failure("/c/iter_1", "/c/iter_1.tmp", PermissionError(errno.EACCES, "Permission denied", "/c"))
    assert perm.startswith("saving checkpoint /c/iter_1 failed: Permission denied (/c)")


@pytest.fixture
def small_disk(tmp_path):
    """A 28 MiB tmpfs: one tiny checkpoint (~17 MiB) fits, a second one does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=28m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_run_with_the_cause_and_keeps_the_previous_checkpoint(small_disk):
    run_dir = small_disk / "run"
    args = [*QUIET, f"trainer.run_dir={run_dir}", "trainer.steps=4", "checkpoint.save_every=2",
            "checkpoint.keep_last=0"]
    proc = subprocess.run(train_command(args), cwd=REPO, env=train_env(1), capture_output=True, text=True,
                          timeout=600)
    ckpts = run_dir / "checkpoints"
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"saving checkpoint {ckpts / 'iter_0000004'} failed: no space left on device" in out, out[-3000:]
    assert sorted(os.listdir(ckpts)) == ["iter_0000002", "latest"]  # no .tmp left behind
    assert (ckpts / "latest").read_text() == "iter_0000002"
    assert checkpoint.verify(str(ckpts / "iter_0000002")) is None
