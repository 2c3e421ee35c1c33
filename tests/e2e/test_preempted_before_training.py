"""A preemption signal before the first step, to a real ``python -m pretrain.train``: during the
wait for a live run's run-dir lock (SIGTERM) and during the sample-index build (SIGUSR1, the build
held by :mod:`tests.support.hold_data_build`), the run stops at once with one line naming the
signal and where it came, exit status 75, no traceback, and nothing of a run written: no
``config.yaml``, metrics or checkpoint, no complete index from the interrupted build, and the live
holder's lock untouched."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.launch import QUIET, REPO, train_command, train_env

pytestmark = pytest.mark.heavy


def _start(argv, tmp_path):
    err = open(tmp_path / "stderr", "w+")  # a file, not a pipe: a full pipe would block the run
    proc = subprocess.Popen(argv, cwd=REPO, env=train_env(1), stdout=subprocess.DEVNULL, stderr=err)
    return proc, err


def _signal_when(proc, err, ready, sig, what, timeout=400):
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            err.seek(0)
            proc.kill()
            raise AssertionError(f"no {what} (status {proc.poll()}):\n{err.read()[-4000:]}")
        time.sleep(0.1)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err.seek(0)
    return err.read()


def _nothing_of_a_run(run_dir):
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "checkpoints").exists()


def test_sigterm_while_waiting_for_a_live_runs_lock(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / "run.lock"  # held by this test's process: a live run on this host
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None,
                                "started": time.time()}))
    held = lock.read_bytes()
    proc, err = _start(train_command([*QUIET, f"trainer.run_dir={run_dir}", "trainer.steps=2",
                                      "trainer.lock_wait_s=120"]), tmp_path)
    text = _signal_when(proc, err, lambda: "is in use" in open(tmp_path / "stderr").read(),
                        signal.SIGTERM, "wait for the lock")
    assert proc.returncode == 75, text[-4000:]
    assert text.strip().splitlines()[-1] == (
        "error: SIGTERM during the wait for the run dir lock: stopped before training; exit 75 (preempted)")
    assert "Traceback" not in text
    assert lock.read_bytes() == held
    _nothing_of_a_run(run_dir)


def test_sigusr1_during_the_data_build(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "building"
    proc, err = _start([sys.executable, "-m", "tests.support.hold_data_build", f"--marker={marker}",
                        *QUIET, f"trainer.run_dir={run_dir}", "trainer.steps=2"], tmp_path)
    text = _signal_when(proc, err, marker.exists, signal.SIGUSR1, "index build")
    assert proc.returncode == 75, text[-4000:]
    assert text.strip().splitlines()[-1] == (
        "error: SIGUSR1 during the data build: stopped before training; exit 75 (preempted)")
    assert "Traceback" not in text
    assert not (run_dir / "run.lock").exists()
    _nothing_of_a_run(run_dir)
    indices = list((run_dir / "data_index").glob("*"))
    assert indices == [] or not any((index / ".complete").exists() for index in indices), indices
