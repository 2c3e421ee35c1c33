"""Lose nothing, hide nothing (issue 17), through real training runs: a second run on a live
run dir is refused on every rank; a torn metrics.jsonl is repaired on resume; a resume with a
config that trains differently is refused (or recorded when allowed); a diverged run exits
non-zero with every skipped step visible."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.support.launch import QUIET, REPO, read_metrics, train_command, train_env


def _run(overrides, nproc=1, timeout=600):
    return subprocess.run(train_command([*QUIET, *overrides], nproc), cwd=REPO, env=train_env(nproc),
                          capture_output=True, text=True, timeout=timeout)


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reliability") / "run"
    _ok(_run([f"trainer.run_dir={run_dir}", "trainer.steps=4"]))
    return run_dir


@pytest.mark.all_cores  # a one-rank run and a two-rank one at once
def test_a_second_run_on_a_live_run_dir_waits_then_refuses_on_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(train_command([*QUIET, f"trainer.run_dir={run_dir}", "trainer.steps=12"]),
                             cwd=REPO, env=train_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    lock = run_dir / "run.lock"
    deadline = time.monotonic() + 300
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lock.exists(), first.communicate()
    holder = json.loads(lock.read_text())
    assert holder["pid"] == first.pid
    os.kill(first.pid, signal.SIGSTOP)  # the holder stays live (its process exists) until the second gives up
    try:
        second = _run([f"trainer.run_dir={run_dir}", "trainer.steps=12", "trainer.lock_wait_s=2",
                       "parallel=dp2_distopt"], nproc=2)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out[-2000:] + err[-4000:]
    assert second.returncode != 0
    assert f"is in use by another run (pid {first.pid} on {holder['host']}" in second.stderr
    # both ranks refused, each with its one error line (none hangs in a collective)
    assert second.stderr.count(f"error: run dir {run_dir} is in use by another run (pid {first.pid}") >= 2, second.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # one writer: no interleaved or duplicated records
    assert not lock.exists()  # released at the end


def test_a_torn_metrics_line_is_cut_on_resume_and_the_summary_still_reads(finished_run):
    metrics = finished_run / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 5, "loss": 3.1, "lm_lo')  # a kill mid-append
    proc = _run([f"trainer.run_dir={finished_run}", "trainer.steps=4"])
    summary = _ok(proc)
    assert f"{metrics}: cut a torn last record (line 5, " in proc.stderr
    assert metrics.read_text() == whole
    assert summary["steps"] == 4 and summary["final_loss"] == read_metrics(str(finished_run))[-1]["loss"]


def test_resuming_with_a_config_that_trains_differently_is_refused_or_recorded(finished_run):
    config = (finished_run / "config.yaml").read_text()
    proc = _run([f"trainer.run_dir={finished_run}", "trainer.steps=4", "trainer.seq_length=64",
                 "optimizer.lr=1e-2"])
    assert proc.returncode != 0
    assert "optimizer.lr: 0.003 in the checkpoint -> 0.01 now" in proc.stderr
    assert "trainer.seq_length: 128 in the checkpoint -> 64 now" in proc.stderr
    assert "checkpoint.allow_config_change=true" in proc.stderr
    assert (finished_run / "config.yaml").read_text() == config  # not rewritten
    extended = _run([f"trainer.run_dir={finished_run}", "trainer.steps=6"])
    assert extended.returncode != 0 and "steps: 4 in the checkpoint -> 6 now (extends a finished schedule" \
        in extended.stderr
    summary = _ok(_run([f"trainer.run_dir={finished_run}", "trainer.steps=6",
                        "checkpoint.allow_config_change=true"]))
    assert summary["steps"] == 6
    [entry] = [json.loads(line) for line in (finished_run / "config_history.jsonl").read_text().splitlines()]
    assert entry["step"] == 4 and entry["changes"][0].startswith("steps: 4 in the checkpoint -> 6 now")
    lrs = [r["lr"] for r in read_metrics(str(finished_run))]
    assert lrs[4] == lrs[5] == pytest.approx(3e-4)  # the extra steps run at the schedule's final LR


def test_a_diverged_run_ends_non_zero_and_shows_every_skipped_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run([f"trainer.run_dir={run_dir}", "trainer.steps=6", "optimizer.lr=1e6",
                 "faults.reload_after_bad_steps=0", "logger.log_every=100"])
    records = read_metrics(str(run_dir))
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped and skipped == list(range(skipped[0], 7)), skipped
    assert proc.returncode == 1
    for step in skipped:  # a console line per skipped step, though log_every hides the others
        assert any(line.startswith(f"step {step:>5} |") and line.endswith("SKIPPED (non-finite)")
                   for line in proc.stdout.splitlines())
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["skipped_steps"] == len(skipped)
    assert (f"error: the run diverged: its last {len(skipped)} steps ({skipped[0]}-6) were all skipped"
            in proc.stderr)
    assert os.path.isdir(run_dir / "checkpoints" / "iter_0000006")  # what it has is still saved
