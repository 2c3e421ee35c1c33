"""The rank slot pytest-xdist workers share (tests/support/core_gate.py), with real processes as
workers: two one-process tests run side by side, a second multi-rank run waits for the first,
and a one-process test runs beside a multi-rank run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests.support.launch import REPO

#: a worker: holds what argv[1] says ("one": nothing, "all": the slot for the whole test,
#: "one-then-all": the slot for a run inside the test), writes "<name>.got" once it
#: holds it, waits for "<name>.go", writes "<name>.release" and gives the slot back;
#: "one-then-all" also writes "<name>.back" after the run
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


def test_two_one_core_holders_run_side_by_side(gate):
    start, folder, _ = gate
    a, b = start("one", "a"), start("one", "b")
    _wait_for(folder / "a.got")
    _wait_for(folder / "b.got")  # both hold a core at once
    for name in "ab":
        (folder / f"{name}.go").touch()
    assert a.wait(60) == 0 and b.wait(60) == 0


def test_a_second_multi_rank_holder_waits_for_the_first(gate):
    start, folder, _ = gate
    first = start("all", "first")
    _wait_for(folder / "first.got")
    second = start("one-then-all", "second")  # a one-process test starting a multi-rank run
    time.sleep(0.5)
    assert not (folder / "second.got").exists(), "two multi-rank runs at once"
    (folder / "first.go").touch()
    assert _wait_for(folder / "second.got") > _wait_for(folder / "first.release")
    (folder / "second.go").touch()
    _wait_for(folder / "second.back")
    assert first.wait(60) == second.wait(60) == 0


def test_a_one_process_test_runs_beside_a_multi_rank_run(gate):
    start, folder, _ = gate
    run = start("one-then-all", "run")
    _wait_for(folder / "run.got")
    other = start("one", "other")
    _wait_for(folder / "other.got")  # while the run holds the slot
    assert not (folder / "run.release").exists()
    for name in ("run", "other"):
        (folder / f"{name}.go").touch()
    assert run.wait(60) == other.wait(60) == 0
