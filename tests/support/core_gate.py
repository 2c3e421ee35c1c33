"""The machine's cores shared between pytest-xdist workers: a test keeps one core busy, a
multi-rank run all of them.

``make test`` runs two workers on CI's two cores. A one-process test (or a one-rank run) keeps
one core busy, so two of them run side by side; ranks of a multi-rank run step in lockstep, and a
rank that shares its core with another worker's test stalls its peers at every collective (two
workers without this gate ran the suite slower than one). So each test holds a core while it
runs (:func:`hold`, from ``tests/conftest.py``), a test marked ``all_cores`` holds every core,
and a multi-rank run started by a one-core test (:func:`whole_machine`, from the rank pools)
trades its core for all of them for the run's duration.

Cores are ``flock`` locks on files shared by the run's workers. Whoever waits for cores first
takes the ``gate`` lock and keeps it until it has them, so a test that wants every core is not
overtaken by one-core tests; a holder never waits for the gate while holding a core (an escalation
gives its core back first), so no two workers wait on each other. Without xdist (one worker) or
with ``PYTEST_XDIST_WORKER_COUNT`` 1 every call is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

_held: list = []  #: this worker's open core locks


def active() -> bool:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def _cores() -> int:
    return int(os.environ["PYTEST_XDIST_WORKER_COUNT"])


def _lock_file(name: str):
    folder = os.path.join(tempfile.gettempdir(), f"glm5-cores-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}")
    os.makedirs(folder, exist_ok=True)
    return open(os.path.join(folder, name), "a+")


def _acquire(n: int) -> None:
    with _lock_file("gate") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        free = list(range(_cores()))
        for i in list(free):  # the free ones first, then wait for the rest in order
            if len(_held) == n:
                break
            f = _lock_file(f"core{i}")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            _held.append(f)
            free.remove(i)
        for i in free:
            if len(_held) == n:
                break
            f = _lock_file(f"core{i}")
            fcntl.flock(f, fcntl.LOCK_EX)
            _held.append(f)
        fcntl.flock(gate, fcntl.LOCK_UN)


def _release() -> None:
    while _held:
        _held.pop().close()  # closing the file drops its flock


@contextlib.contextmanager
def hold(all_cores: bool = False):
    """One core (every core with ``all_cores``) for the block: a test's whole run."""
    if not active():
        yield
        return
    _acquire(_cores() if all_cores else 1)
    try:
        yield
    finally:
        _release()


@contextlib.contextmanager
def whole_machine():
    """Every core for the block (a multi-rank run), back to what was held before it."""
    if not active() or len(_held) == _cores():
        yield
        return
    before = len(_held)
    _release()
    _acquire(_cores())
    try:
        yield
    finally:
        _release()
        _acquire(before)
