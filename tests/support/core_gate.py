"""One multi-rank run at a time across pytest-xdist workers; one-process tests go on beside it.

``make test`` runs two workers on CI's two cores. Two multi-rank runs at once (up to 8 ranks on 2
cores) stall each other at every collective (two workers without any gate ran the suite slower
than one), so a multi-rank run holds the machine's one *rank slot*: a test marked ``all_cores``
for its whole run (:func:`hold`, from ``tests/conftest.py``), a run started by any other test for
the run's duration (:func:`whole_machine`, from the launch helpers and the rank pools).

A one-process test (or a one-rank run) takes no slot: it runs beside a multi-rank run, whose
ranks then share the cores with it. Waiting instead (each test holding a core, a multi-rank run
both) left a core idle while a multi-rank run waited for the other worker's test to end and in
the ranks' pipeline bubbles and collectives: 1.65 busy cores on average over a traced suite, 1.85
with the slot alone, 21:27 -> 19:13 (benchmarks/RESULTS.md, "Test suite time").

The slot is a ``flock`` lock on a file shared by the run's workers. Without xdist (one worker)
or with ``PYTEST_XDIST_WORKER_COUNT`` 1 every call is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

_held: list = []  #: this worker's open slot lock (at most one)


def active() -> bool:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def _slot_file():
    folder = os.path.join(tempfile.gettempdir(), f"glm5-cores-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}")
    os.makedirs(folder, exist_ok=True)
    return open(os.path.join(folder, "ranks"), "a+")


@contextlib.contextmanager
def _rank_slot():
    f = _slot_file()
    fcntl.flock(f, fcntl.LOCK_EX)
    _held.append(f)
    try:
        yield
    finally:
        _held.remove(f)
        f.close()  # closing the file drops its flock


@contextlib.contextmanager
def hold(all_cores: bool = False):
    """A test's whole run: the rank slot for a test marked ``all_cores`` (it starts ranks of its
    own), nothing for any other."""
    if not active() or not all_cores:
        yield
        return
    with _rank_slot():
        yield


@contextlib.contextmanager
def whole_machine():
    """The rank slot for the block (a multi-rank run), unless this worker holds it already."""
    if not active() or _held:
        yield
        return
    with _rank_slot():
        yield
