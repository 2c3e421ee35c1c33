"""A checkpoint save that fails on one rank only, on two gloo ranks (real processes): every step
only rank 0 takes -- the folder, the removal of interrupted saves, torch's
``.metadata``, megatron's ``metadata.json``, the rename, ``latest``, retention -- and rank 1's part of the
tensor write, each failed with ENOSPC on that rank alone, synchronous and async: both ranks raise
``CheckpointSaveError`` with the one-line message (no rank is left waiting in a collective), no
``.tmp`` folder is left, the previous checkpoint and ``latest`` are intact and the next save on
both ranks is published. The cases run one after another in one pair of processes
(``tests.support.save_failure_ranks``); each process has a hard timeout, so a rank that hangs
fails the test, naming the case it hung in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from parallel.initialize import free_port
from tests.support.launch import REPO, train_env
from tests.support.save_failure_ranks import CASES, RANK0_STEPS

HARD_TIMEOUT_S = 300  #: for all the cases (about 30 s); a rank left waiting also fails after the
#: ranks' 1-minute group timeout


def _records(root, rank: int) -> list[dict]:
    path = root / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run_ranks(root) -> tuple[dict, str]:
    """Both ranks to their end or the hard timeout; returns each rank's records and their output."""
    port = free_port()
    procs, logs = [], []
    for rank in (0, 1):
        log = open(root / f"rank{rank}.out", "w+")
        logs.append(log)
        argv = [sys.executable, "-m", "tests.support.save_failure_ranks", str(rank), "2", str(port),
                str(root)]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=train_env(2), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    deadline = time.monotonic() + HARD_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # each rank and what it started (its async writer), by session
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    output = ""
    for rank, log in enumerate(logs):
        log.seek(0)
        output += f"--- rank {rank} (exit {procs[rank].returncode}) ---\n{log.read()[-4000:]}\n"
        log.close()
    return {rank: _records(root, rank) for rank in (0, 1)}, output


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_failures")
    records, output = _run_ranks(root)

    def event(r) -> str:  # where a rank broke: what each rank's failing save raised (None: returned)
        if r.get("start"):
            return "start"
        return f"raised {r['failed_save']!r}" if "failed_save" in r else "crashed" if "crash" in r else "ok"

    story = "\n".join(f"rank {rank}: " + "; ".join(f"{r['case']}: {event(r)}" for r in recs[-4:]
                                                    if "case" in r) for rank, recs in records.items())
    by_rank = {}
    for rank, recs in records.items():
        started = [r["case"] for r in recs if r.get("start")]
        crashed = [r for r in recs if "crash" in r]
        assert not crashed, (
            f"rank {rank} in case {crashed[0]['case']!r}:\n{crashed[0]['crash']}\n{story}\n{output}")
        hung = started[-1] if started else None
        assert recs and recs[-1].get("done"), f"rank {rank} hung in {hung!r}\n{story}\n{output}"
        by_rank[rank] = {r["case"]: r["result"] for r in recs if "result" in r}
    return by_rank


@pytest.mark.heavy
@pytest.mark.all_cores  # two ranks of its own
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_a_save_failing_on_one_rank_fails_on_both_and_the_next_is_published(outcomes, case):
    for rank in (0, 1):
        out = outcomes[rank][case]
        final = out["final"]
        assert out["error"] is not None, f"rank {rank}: the save did not fail"
        assert "\n" not in out["error"]
        assert out["error"].startswith(f"saving checkpoint {final} failed: no space left on device; "), (
            f"rank {rank}: {out['error']}")
        assert not out["in_flight"]
        assert out["after"] == out["before"]  # no iter_0000004(.tmp), latest as it was
        assert not any(n.startswith("iter_0000004") for n in out["after"])
        assert out["latest_after"] == "iter_0000002"
        assert out["previous_verifies"] is None
        assert out["next"] == ["iter_0000006", "latest"]  # published, iter 2 pruned (keep_last=1)
        assert out["latest_next"] == "iter_0000006"
        assert out["next_verifies"] is None


def test_every_rank0_step_of_the_one_rank_test_is_a_case():
    from tests.unit.checkpointing.test_save_failures import _steps

    assert set(_steps()) <= set(RANK0_STEPS)
