"""A run under torchrun that is preempted ends with exit status 75, as the batch script's requeue
logic needs: ``python -m pretrain.torchrun`` (torchrun's options) with 2 gloo ranks on the tiny
model gets SIGTERM, as Slurm signals a job step's task, after the run's second step. It passes the
signal to both ranks and waits; they agree on a step, save it and exit with 75; it exits with 75
after one line saying so. Plain torchrun, signalled the same way, kills the ranks 30 s later at the
latest and ends with status 1 (see :mod:`pretrain.torchrun`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from parallel.initialize import free_port
from tests.support.launch import QUIET, REPO, read_metrics, train_env

COMMON = ["trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.seq_length=64",
          "checkpoint.keep_last=0", "logger.progress_bar=false"]


@pytest.mark.heavy
@pytest.mark.all_cores  # a two-rank run of its own
def test_sigterm_to_torchrun_ends_with_75_after_a_complete_checkpoint(tmp_path):
    from checkpointing import state as checkpoint
    from pretrain.reliability.faults import PREEMPTED_EXIT

    run_dir, steps = tmp_path / "run", 8
    argv = [sys.executable, "-m", "pretrain.torchrun", "--nproc-per-node=2", f"--master-port={free_port()}",
            "-m", "pretrain.train", *QUIET, *COMMON, f"trainer.run_dir={run_dir}", f"trainer.steps={steps}"]
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(argv, cwd=REPO, env=train_env(2), stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 400
            while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(str(run_dir))) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, "no second step"
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
        err.seek(0)
        text = err.read()
    assert proc.returncode == PREEMPTED_EXIT, text[-4000:]
    assert re.search(r"^pretrain\.torchrun: ranks? [01](, 1)? stopped for preemption; exit 75$", text, re.M), text[-3000:]
    assert "Traceback" not in text
    stopped = len(read_metrics(str(run_dir)))
    assert 2 <= stopped < steps, stopped
    latest = checkpoint.latest_checkpoint(str(run_dir / "checkpoints"))
    assert os.path.basename(latest) == f"iter_{stopped:07d}"
    assert checkpoint.verify(latest) is None
