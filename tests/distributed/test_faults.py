"""Fault tolerance in real training runs (tiny GLM-5, fp32, one process):

- a step whose loss is NaN (injected from outside by :mod:`tests.support.nan_injection`) is
  skipped and logged: nothing is applied (weights and Adam state after it are bit-identical to
  before it), the LR schedule does not advance, training goes on;
- N bad steps in a row reload the last checkpoint: the state saved right after the reload is
  bit-identical to that checkpoint and the LR schedule continues from it;
- a truncated file in the newest checkpoint is detected and the run resumes, with a warning, from
  the previous one, reproducing the lost steps bit for bit.
"""

import math
import subprocess

import pytest
import torch

from tests.support import nan_injection
from tests.support.launch import QUIET, REPO, checkpoint_tensors, read_metrics, train_command, train_env

COMMON = ["trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.seq_length=64",
          "checkpoint.keep_last=0", "logger.progress_bar=false"]


def _train(overrides, nan_at_steps) -> str:
    """One-process run whose losses at ``nan_at_steps`` are NaN."""
    proc = subprocess.run(nan_injection.command(nan_at_steps, [*QUIET, *COMMON, *overrides]), cwd=REPO,
                          env=train_env(1), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def _same_state(tmp_path, a, b) -> bool:
    ta, tb = checkpoint_tensors(a, tmp_path), checkpoint_tensors(b, tmp_path)
    assert ta.keys() == tb.keys() and "optimizer.state.exp_avg.embedding.word_embeddings.weight" in ta
    return all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory):
    """3 steps, step 2's loss NaN, a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("nan") / "run"
    _train([f"trainer.run_dir={run_dir}", "trainer.steps=3", "checkpoint.save_every=1"], [2])
    return run_dir


@pytest.mark.heavy
def test_nan_step_is_skipped_and_logged(skipped_run, tmp_path):
    m = read_metrics(str(skipped_run))
    assert [r["skipped"] for r in m] == [False, True, False]
    assert math.isnan(m[1]["loss"]) and math.isnan(m[1]["lm_loss"]) and math.isnan(m[1]["grad_norm"])
    assert all(math.isfinite(m[i][k]) for i in (0, 2) for k in ("loss", "grad_norm"))
    # lr is the LR a step used: the skipped step 2 did not advance the schedule, so step 3 reuses it
    assert m[1]["lr"] != m[0]["lr"] and m[2]["lr"] == m[1]["lr"]
    ckpts = skipped_run / "checkpoints"
    assert _same_state(tmp_path, ckpts / "iter_0000001", ckpts / "iter_0000002")  # nothing applied
    assert not _same_state(tmp_path, ckpts / "iter_0000002", ckpts / "iter_0000003")


@pytest.mark.heavy
def test_truncated_checkpoint_falls_back_to_previous(skipped_run):
    before = read_metrics(str(skipped_run))
    newest = skipped_run / "checkpoints" / "iter_0000003"
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = _train([f"trainer.run_dir={skipped_run}", "trainer.steps=3", "checkpoint.save_every=1"], [2])
    assert (f"resuming from {skipped_run / 'checkpoints' / 'iter_0000002'}, the newest complete "
            f"checkpoint: iter_0000003: {shard.name} has") in out, out[-3000:]
    after = read_metrics(str(skipped_run))
    assert after[2]["loss"] == before[2]["loss"] and after[2]["grad_norm"] == before[2]["grad_norm"]
    lines = (skipped_run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4  # step 3 was trained again, and only step 3
    assert (skipped_run / "checkpoints" / "latest").read_text() == "iter_0000003"


@pytest.mark.heavy
def test_bad_steps_in_a_row_reload_last_checkpoint(tmp_path):
    """7 steps, checkpoint at 3 and 6; step 2 bad alone, steps 5 and 6 bad in a row -> reload
    iter_3 at step 6 (undoing step 4), then save iter_6, then step 7 from there."""
    run_dir = tmp_path / "run"
    out = _train([f"trainer.run_dir={run_dir}", "trainer.steps=7", "checkpoint.save_every=3",
                  "faults.reload_after_bad_steps=2"], [2, 5, 6])
    ckpts = run_dir / "checkpoints"
    assert f"step 6: non-finite steps in a row; reloaded {ckpts / 'iter_0000003'}" in out, out[-3000:]
    m = read_metrics(str(run_dir))
    assert [r["skipped"] for r in m] == [False, True, False, False, True, True, False]
    assert [r["checkpoint_reloads"] for r in m] == [0, 0, 0, 0, 0, 0, 1]
    assert _same_state(tmp_path, ckpts / "iter_0000003", ckpts / "iter_0000006")
    # applied updates: 1, 3, 4 -> back to 1, 3 at the reload -> step 7 is the 3rd, like step 4
    assert m[6]["lr"] == m[3]["lr"]


@pytest.mark.heavy
@pytest.mark.all_cores  # a two-rank run of its own
def test_sigterm_to_one_rank_stops_all_at_the_same_step(tmp_path):
    """SIGTERM reaches only rank 1 of 2 (torchrun, no Slurm): the ranks agree to stop after the
    same step, the checkpoint of that step is complete, and the ranks exit with 75."""
    import json
    import os
    import signal
    import time

    import psutil

    from checkpointing import state as checkpoint
    from pretrain.reliability.faults import PREEMPTED_EXIT

    run_dir = tmp_path / "run"
    steps = 8
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen(
            train_command([*QUIET, *COMMON, f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
                           "trainer.micro_batch_size=2"], nproc=2),
            cwd=REPO, env=train_env(2), stdout=out_f, stderr=err_f)
    try:
        deadline = time.time() + 400
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(str(run_dir))) < 2:
            assert proc.poll() is None and time.time() < deadline, "no second step"
            time.sleep(0.2)
        (rank1,) = [c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == "1"]
        rank1.send_signal(signal.SIGTERM)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = out_path.read_text(), err_path.read_text()
    # rank 0 never got a signal: that it stopped logging and joined the (collective) save of the
    # same step shows the agreement; torchrun reports the ranks' exit status
    stopped = len(read_metrics(str(run_dir)))
    assert 2 <= stopped < steps, stopped
    assert f"exitcode  : {PREEMPTED_EXIT}" in err, err[-3000:]
    latest = checkpoint.latest_checkpoint(str(run_dir / "checkpoints"))
    assert os.path.basename(latest) == f"iter_{stopped:07d}"
    assert checkpoint.verify(latest) is None
    lines = [ln for ln in out.splitlines() if ln.startswith('{"run_dir"')]
    if lines:  # torchrun may stop rank 0 between its barrier and its print
        assert json.loads(lines[-1])["preempted"] and json.loads(lines[-1])["steps"] == stopped
