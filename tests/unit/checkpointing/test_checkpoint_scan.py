"""Resume finds checkpoints by scanning and verifying the ``iter_*`` folders; ``latest`` is only a
hint, so a damaged one (empty, not a folder name, binary) never makes good checkpoints look
absent (issue 17, case 2)."""

from __future__ import annotations

import logging

import pytest

from checkpointing import state as checkpoint
from tests.support.checkpoints import fake_checkpoint


@pytest.mark.parametrize("content, why", [
    (b"", "holds '', not a checkpoint folder name"),
    (b"aaa_older_than_iter\n", "holds 'aaa_older_than_iter', not a checkpoint folder name"),
    (b"\xff\xfe\x00\x81garbage", "is unreadable (UnicodeDecodeError)"),
])
def test_a_damaged_latest_is_a_hint_the_scan_overrules(tmp_path, caplog, content, why):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 10)  # step 10 sorts after 2 by number, not as text
    (tmp_path / "latest").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="checkpointing.files"):
        assert checkpoint.latest_checkpoint(str(tmp_path)) == str(newest)
    assert f"resuming from {newest}, the newest complete checkpoint: {tmp_path / 'latest'} {why}" in caplog.text


def test_steps_compare_as_numbers_and_folders_of_other_names_are_ignored(tmp_path):
    fake_checkpoint(tmp_path, 999)
    newest = fake_checkpoint(tmp_path, 1000)
    (tmp_path / "iter_0001000.tmp").mkdir()
    (tmp_path / "iter_backup").mkdir()
    (tmp_path / "latest").write_text("iter_0000999")
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(newest)


def test_latest_naming_a_folder_that_is_gone_with_no_folders_left_is_an_error(tmp_path):
    (tmp_path / "latest").write_text("iter_0000004")
    with pytest.raises(RuntimeError, match=r"latest names iter_0000004, but .* holds no checkpoint folder"):
        checkpoint.latest_checkpoint(str(tmp_path))


def test_retention_keeps_the_newest_by_step_and_leaves_other_folders_alone(tmp_path):
    for step in (998, 999, 1000):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "iter_backup").mkdir()  # a user's folder: not a checkpoint, never removed
    checkpoint.apply_retention(str(tmp_path), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000999", "iter_0001000", "iter_backup", "latest"]
