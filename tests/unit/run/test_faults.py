"""pretrain.reliability.faults and checkpoint integrity, in one process: config checks, the preemption flag,
the non-finite policy's counting, and which checkpoint ``latest_checkpoint`` trusts."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from checkpointing import state as checkpoint
from tests.support.checkpoints import fake_checkpoint
from pretrain.reliability.faults import FaultsConfig, NonFinitePolicy, PreemptionSignal, check


# --- config -----------------------------------------------------------------------------------


def test_config_problems_name_fields_and_values():
    problems = check(FaultsConfig(reload_after_bad_steps=-1, max_reloads=-2))
    assert problems == [
        "faults.reload_after_bad_steps=-1 must be >= 0",
        "faults.max_reloads=-2 must be >= 0",
    ]
    assert check(FaultsConfig(reload_after_bad_steps=0, max_reloads=0)) == []


def test_bad_faults_config_fails_before_compute():
    from hydra import compose, initialize_config_dir

    from pretrain.config.schema import register, to_run_config
    from pretrain.config.validation import ConfigError, plan_run
    from tests.support.launch import REPO

    register()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base=None):
        cfg = compose("config", overrides=["faults.reload_after_bad_steps=-3", "trainer.steps=14",
                                           "curriculum=none"])
    with pytest.raises(ConfigError, match=r"faults.reload_after_bad_steps=-3 must be >= 0"):
        plan_run(to_run_config(cfg), world_size=1)


# --- preemption flag ------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_sets_flag_and_keeps_running(sig):
    before = signal.getsignal(sig)
    pre = PreemptionSignal()
    try:
        assert pre.received is None
        os.kill(os.getpid(), sig)  # would end the process without the handler
        assert pre.received == signal.Signals(sig).name
    finally:
        pre.restore()
    assert signal.getsignal(sig) == before


# --- non-finite policy ---------------------------------------------------------------------------


def test_reload_after_n_bad_steps_in_a_row():
    policy = NonFinitePolicy(FaultsConfig(reload_after_bad_steps=2, max_reloads=1))
    outcomes = [policy.should_reload(bad, step) for step, bad in
                enumerate([True, False, True, True, True], start=1)]
    assert outcomes == [False, False, False, True, False]  # the count restarts after a good step
    assert policy.reloads == 1
    with pytest.raises(RuntimeError, match=r"faults.max_reloads=1"):
        policy.should_reload(True, 6)


def test_zero_means_only_skip():
    policy = NonFinitePolicy(FaultsConfig(reload_after_bad_steps=0))
    assert not any(policy.should_reload(True, s) for s in range(1, 50))


# --- checkpoint integrity ---------------------------------------------------------------------------


def test_manifest_lists_every_file_with_its_size(tmp_path):
    folder = fake_checkpoint(tmp_path, 4)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest == {"files": {"metadata.json": 2, ".metadata": 50, "__0_0.distcp": 1000}}
    assert checkpoint.verify(str(folder)) is None


@pytest.mark.parametrize("damage, why", [
    (lambda f: (f / "__0_0.distcp").write_text("y" * 10), "__0_0.distcp has 10 bytes, 1000 expected"),
    (lambda f: (f / ".metadata").unlink(), ".metadata is missing"),
    (lambda f: (f / "manifest.json").unlink(), "no readable manifest.json"),
    (lambda f: (f / "manifest.json").write_text('{"files": {"meta'), "no readable manifest.json"),
])
def test_damaged_latest_falls_back_to_previous_with_warning(tmp_path, caplog, damage, why):
    older = fake_checkpoint(tmp_path, 2)
    newer = fake_checkpoint(tmp_path, 4)
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(newer)
    damage(newer)
    with caplog.at_level(logging.WARNING, logger="checkpointing.files"):
        assert checkpoint.latest_checkpoint(str(tmp_path)) == str(older)
    assert f"resuming from {older}, the newest complete checkpoint: iter_0000004: {why}" in caplog.text


def test_dangling_latest_and_uncommitted_folders(tmp_path, caplog):
    older = fake_checkpoint(tmp_path, 2)
    (tmp_path / "latest").write_text("iter_0000009")  # its folder was deleted
    (tmp_path / "iter_0000011.tmp").mkdir()  # a save that never finished
    with caplog.at_level(logging.WARNING, logger="checkpointing.files"):
        assert checkpoint.latest_checkpoint(str(tmp_path)) == str(older)
    assert "latest names iter_0000009, which is missing" in caplog.text
    newer = fake_checkpoint(tmp_path, 6)
    (tmp_path / "latest").write_text(older.name)  # crash after the rename, before `latest`:
    caplog.clear()  # the folder is complete (renamed only after its manifest), so it counts
    with caplog.at_level(logging.WARNING, logger="checkpointing.files"):
        assert checkpoint.latest_checkpoint(str(tmp_path)) == str(newer)
    assert f"resuming from {newer}, the newest complete checkpoint: latest names iter_0000002" in caplog.text
    assert "iter_0000011.tmp is an incomplete save (interrupted while being written), not used" in caplog.text


def test_no_checkpoint_and_all_damaged(tmp_path):
    assert checkpoint.latest_checkpoint(str(tmp_path / "absent")) is None
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None
    folder = fake_checkpoint(tmp_path, 2)
    (folder / ".metadata").unlink()
    with pytest.raises(RuntimeError, match=r"no complete checkpoint .*iter_0000002: \.metadata is missing"
                                           r".*move them away, or start the run in another folder"):
        checkpoint.latest_checkpoint(str(tmp_path))
