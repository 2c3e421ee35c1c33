"""The cores pytest-xdist workers share (tests/support/core_gate.py), with real processes as
workers: two one-core holders run side by side, a whole-machine holder waits for both cores and
is not overtaken by a one-core holder that asked after it, and a one-core test that starts a
multi-rank run gets its core back after it."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests.support.launch import REPO

#: a worker: holds what argv[1] says ("one", "all", "one-then-all"), writes "<name>.got" once it
#: holds it, waits for "<name>.go", writes "<name>.release" and gives the cores back;
#: "one-then-all" also writes "<name>.back" once it holds its one core again
WORKER = """
import os, sys, time
from tests.support import core_gate
kind, name, folder = sys.argv[1:]
def mark(what):
    path = os.path.join(folder, name + what)
    with open(path + ".tmp", "w") as f:
        f.write(repr(time.monotonic()))
    os.replace(path + ".tmp", path)
def wait(what):
    while not os.path.exists(os.path.join(folder, name + what)):
        time.sleep(0.01)
with core_gate.hold(all_cores=kind == "all"):
    if kind == "one-then-all":
        with core_gate.whole_machine():
            mark(".got"); wait(".go"); mark(".release")
        mark(".back")
    else:
        mark(".got"); wait(".go"); mark(".release")
"""


@pytest.fixture
def gate(tmp_path):
    run_id = uuid.uuid4().hex
    env = dict(os.environ, PYTEST_XDIST_WORKER_COUNT="2", PYTEST_XDIST_TESTRUNUID=run_id,
               PYTHONPATH=REPO)
    procs = []

    def start(kind: str, name: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, kind, name, str(tmp_path)], cwd=REPO, env=env))
        return procs[-1]

    locks = os.path.join(tempfile.gettempdir(), f"glm5-cores-{run_id}")
    yield start, tmp_path, locks
    for p in procs:
        p.kill()
        p.wait()
    shutil.rmtree(locks, ignore_errors=True)


def _wait_for(path, timeout=60.0) -> float:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)
    return float(path.read_text())


def _gate_taken(folder: str) -> bool:
    with open(os.path.join(folder, "gate"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _wait_until_gate_taken(folder: str, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(os.path.join(folder, "gate")) and _gate_taken(folder)):
        assert time.monotonic() < deadline, "nobody waits at the gate"
        time.sleep(0.01)


def test_two_one_core_holders_run_side_by_side(gate):
    start, folder, _ = gate
    a, b = start("one", "a"), start("one", "b")
    _wait_for(folder / "a.got")
    _wait_for(folder / "b.got")  # both hold a core at once
    for name in "ab":
        (folder / f"{name}.go").touch()
    assert a.wait(60) == 0 and b.wait(60) == 0


def test_every_core_waits_for_the_holders_and_is_not_overtaken(gate):
    start, folder, locks = gate
    a = start("one", "a")
    _wait_for(folder / "a.got")
    whole = start("all", "whole")
    _wait_until_gate_taken(locks)  # whole holds the free core and waits at the gate for a's
    late = start("one", "late")
    time.sleep(0.5)
    assert not (folder / "whole.got").exists() and not (folder / "late.got").exists()
    (folder / "a.go").touch()
    got_whole = _wait_for(folder / "whole.got")
    time.sleep(0.5)
    assert not (folder / "late.got").exists(), "a one-core test ran beside one holding every core"
    (folder / "whole.go").touch()
    assert _wait_for(folder / "late.got") > _wait_for(folder / "whole.release") > got_whole
    (folder / "late.go").touch()
    assert a.wait(60) == whole.wait(60) == late.wait(60) == 0


def test_a_multi_rank_run_trades_its_core_for_all_and_gets_it_back(gate):
    start, folder, _ = gate
    other = start("one", "other")
    _wait_for(folder / "other.got")
    run = start("one-then-all", "run")
    time.sleep(0.5)
    assert not (folder / "run.got").exists(), "a multi-rank run started beside another test"
    (folder / "other.go").touch()
    assert _wait_for(folder / "run.got") > _wait_for(folder / "other.release")
    (folder / "run.go").touch()
    _wait_for(folder / "run.back")
    assert run.wait(60) == other.wait(60) == 0
