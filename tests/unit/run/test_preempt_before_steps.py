"""Preemption before the first step, in one process: inside ``PreemptionSignal.stopping`` a
SIGTERM/SIGUSR1 (or one that came before the block) raises ``Preempted`` at once; outside it only
sets the flag; the run-dir lock's wait ends on it with the holder's lock file untouched."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from pretrain.reliability.faults import Preempted, PreemptionSignal
from pretrain.reliability.run_lock import LOCK_NAME, RunDirLock


@pytest.fixture
def preemption():
    pre = PreemptionSignal()
    try:
        yield pre
    finally:
        pre.restore()


def _signal_soon(sig, after_s=0.2):
    threading.Timer(after_s, os.kill, (os.getpid(), sig)).start()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_inside_stopping_raises_at_once(preemption, sig):
    _signal_soon(sig)
    with pytest.raises(Preempted) as e:
        preemption.sleep(600, "the data build")  # ended by the signal, not the 600 s
    name = signal.Signals(sig).name
    assert (e.value.signal_name, e.value.where) == (name, "the data build")
    assert e.value.line() == f"{name} during the data build: stopped before training; exit 75 (preempted)"
    os.kill(os.getpid(), sig)  # after the block: the flag again, no raise
    assert preemption.received == name


def test_a_signal_before_the_block_raises_on_entering_it(preemption):
    os.kill(os.getpid(), signal.SIGTERM)  # outside any block: only the flag
    assert preemption.received == "SIGTERM"
    with pytest.raises(Preempted, match="the wait for the run dir lock"):
        with preemption.stopping("the wait for the run dir lock"):
            raise AssertionError("the block must not start")


def test_preempted_crosses_ranks_pickled():
    import pickle

    e = pickle.loads(pickle.dumps(Preempted("SIGUSR1", "the data build")))
    assert (e.signal_name, e.where) == ("SIGUSR1", "the data build")


def test_sigterm_ends_the_wait_for_a_live_holders_lock(preemption, tmp_path):
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": "7", "started": time.time()}
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(json.dumps(holder))
    before = lock_file.read_bytes()
    lock = RunDirLock(str(tmp_path), wait_s=600, poll_s=0.05,
                      pause=lambda s: preemption.sleep(s, "the wait for the run dir lock"))
    _signal_soon(signal.SIGTERM)
    with pytest.raises(Preempted, match="the wait for the run dir lock"):
        lock.acquire()
    assert lock_file.read_bytes() == before  # the live holder's lock is as it was
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
