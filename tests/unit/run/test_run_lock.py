"""The run-dir lock: one live run per run dir; a live holder makes the next run wait, then refuse
naming it; a dead holder's lock (gone process, stale heartbeat, torn file) is taken over with a
warning, by exactly one of several runs racing for it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from pretrain.reliability import run_lock
from pretrain.reliability.run_lock import LOCK_NAME, RunDirLock, RunDirLocked


def _write_holder(run_dir, host, pid, age_s=0.0, job="4242"):
    path = os.path.join(run_dir, LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid, "slurm_job_id": job, "started": time.time() - age_s}, f)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_makes_the_next_run_wait_then_refuse(tmp_path):
    first = RunDirLock(str(tmp_path), wait_s=0)
    assert first.acquire() is None
    second = RunDirLock(str(tmp_path), wait_s=0.6, poll_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(RunDirLocked) as e:
        second.acquire()
    assert time.monotonic() - t0 >= 0.6
    msg = str(e.value)
    assert f"run dir {tmp_path} is in use by another run (pid {os.getpid()} on {socket.gethostname()}" in msg
    assert "waited 1 s (trainer.lock_wait_s)" in msg and "another run dir" in msg
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    assert second.acquire() is None  # free now
    second.release()


def test_the_waiting_run_starts_once_the_holder_releases(tmp_path):
    first = RunDirLock(str(tmp_path), wait_s=0)
    first.acquire()
    import threading
    threading.Timer(0.5, first.release).start()
    second = RunDirLock(str(tmp_path), wait_s=30, poll_s=0.1)
    t0 = time.monotonic()
    assert second.acquire() is None
    assert 0.4 < time.monotonic() - t0 < 10
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    second.release()


def test_a_dead_holder_on_this_host_is_taken_over_with_a_warning(tmp_path):
    pid = _dead_pid()
    _write_holder(str(tmp_path), socket.gethostname(), pid)
    lock = RunDirLock(str(tmp_path), wait_s=0)
    warning = lock.acquire()
    assert warning.startswith(f"took over the run dir lock {tmp_path / LOCK_NAME} of a run that is gone "
                              f"(pid {pid} on {socket.gethostname()}, Slurm job 4242")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_holder_on_another_host_is_dead_only_when_its_heartbeat_is_stale(tmp_path):
    _write_holder(str(tmp_path), "node-17", 1, age_s=5)
    with pytest.raises(RunDirLocked, match=r"pid 1 on node-17, Slurm job 4242, started .*, heartbeat 5 s ago"):
        RunDirLock(str(tmp_path), wait_s=0).acquire()
    _write_holder(str(tmp_path), "node-17", 1, age_s=run_lock.STALE_AFTER_S + 30)
    lock = RunDirLock(str(tmp_path), wait_s=0)
    assert "pid 1 on node-17" in lock.acquire()
    lock.release()


def test_a_torn_lock_file_counts_as_live_until_it_goes_stale(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_bytes(b'{"host": "no')
    with pytest.raises(RunDirLocked):
        RunDirLock(str(tmp_path), wait_s=0).acquire()
    old = time.time() - run_lock.STALE_AFTER_S - 1
    os.utime(path, (old, old))
    lock = RunDirLock(str(tmp_path), wait_s=0)
    assert "an unreadable lock file" in lock.acquire()
    lock.release()


def test_the_holder_refreshes_its_heartbeat_and_release_keeps_a_foreign_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.1)
    lock = RunDirLock(str(tmp_path), wait_s=0)
    lock.acquire()
    path = tmp_path / LOCK_NAME
    old = time.time() - 1000
    os.utime(path, (old, old))
    time.sleep(0.5)
    assert time.time() - path.stat().st_mtime < 5
    _write_holder(str(tmp_path), "node-3", 7)  # someone else's lock now (e.g. after a take-over)
    lock.release()
    assert json.loads(path.read_text())["host"] == "node-3"


def _contend(run_dir, barrier, results):
    barrier.wait()
    try:
        RunDirLock(run_dir, wait_s=0).acquire()  # held until the process exits
        results.put("acquired")
    except RunDirLocked:
        results.put("refused")
    barrier.wait()


def test_of_runs_racing_for_a_dead_lock_exactly_one_gets_it(tmp_path):
    ctx = mp.get_context("fork")  # the contenders touch no torch: a spawned one re-imported it (~3 s each)
    for _ in range(3):
        _write_holder(str(tmp_path), socket.gethostname(), _dead_pid())
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_contend, args=(str(tmp_path), barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert got == ["acquired", "refused", "refused", "refused"]
