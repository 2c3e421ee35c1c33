"""The process that writes an async checkpoint save: spawned (not a fork of the training
process), with the default signal handling, and gone as soon as the training process is killed.

Each test starts this module as a small program (``python -m tests.e2e.test_async_writer_process
DIR``): one gloo rank with the project's preemption handler installed starts an async save of a
small sharded state through ``CheckpointWriter``, whose file writer is held (it creates
``held.<pid>`` in the ``.tmp`` folder and sleeps) so the save stays in flight while the test looks
at the processes. The hold is installed when this module is imported with ``HOLD_ASYNC_WRITE``
set: in the program, and in a spawned writer, which imports the program's main module."""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import os
import signal
import subprocess
import sys
import time

import pytest

HOLD_ENV = "HOLD_ASYNC_WRITE"
SIGNALS = {"SIGINT": signal.SIGINT, "SIGUSR1": signal.SIGUSR1, "SIGTERM": signal.SIGTERM}


def _held_write(*args, **kwargs):
    """megatron's per-file writer, held: the save stays in flight."""
    write_bucket = kwargs["write_bucket"]
    open(os.path.join(os.path.dirname(str(write_bucket[0])), f"held.{os.getpid()}"), "w").close()
    while True:
        time.sleep(1)


if os.environ.get(HOLD_ENV):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    FileSystemWriterAsync.write_preloaded_data = staticmethod(_held_write)


def _program(ckpt_dir: str) -> None:
    """One gloo rank starts an async save and waits (the test kills it)."""
    from checkpointing import writer as writer_mod
    from checkpointing.state import TrainState
    from parallel.config import ParallelConfig
    from parallel.initialize import DistEnv, initialize
    from pretrain.reliability.faults import PreemptionSignal
    from tests.unit.checkpointing.test_save_failures import small_state

    initialize(ParallelConfig(), seed=5, env=DistEnv.one_process())
    PreemptionSignal()  # a training process's SIGTERM and SIGUSR1 handler
    writer_mod.full_state = lambda *a, **k: small_state(a[3].step)
    w = writer_mod.CheckpointWriter(ckpt_dir, keep_last=0, async_save=True)
    w.save(None, None, None, TrainState(step=4, stage="s"), "x: 1\n", ParallelConfig())
    print("saving", flush=True)
    while True:
        time.sleep(1)


def _wait_for(what: str, check, proc, limit_s: float = 300):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the program exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {limit_s} s")


def _signal_dispositions(pid: int) -> dict:
    """``{signal name: 'caught'|'ignored'|'blocked'|'default'}`` from /proc/<pid>/status."""
    masks = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn", "SigCgt"):
                masks[key] = int(value.strip(), 16)
    out = {}
    for name, num in SIGNALS.items():
        bit = 1 << (num - 1)
        out[name] = ("caught" if masks["SigCgt"] & bit else "ignored" if masks["SigIgn"] & bit
                     else "blocked" if masks["SigBlk"] & bit else "default")
    return out


@pytest.fixture
def held_save(tmp_path):
    """The program with its async save held in flight: ``(program, held writer pids, tmp folder)``;
    everything it started is killed afterwards."""
    import psutil

    from tests.support.launch import REPO

    ckpts = tmp_path / "checkpoints"
    tmp = ckpts / "iter_0000004.tmp"
    env = {**os.environ, HOLD_ENV: "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.test_async_writer_process", str(ckpts)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    descendants = []
    try:
        held = _wait_for("held writer", lambda: tmp.is_dir() and [int(f[5:]) for f in os.listdir(tmp)
                                                                  if f.startswith("held.")], proc)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        yield proc, held, descendants
    finally:
        for p in [proc, *descendants]:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


@pytest.mark.heavy
def test_the_writer_is_spawned_with_default_signal_handling(held_save):
    import psutil

    proc, held, _ = held_save
    writers = set(held)  # megatron 0.19 writes with threads of the writer: it holds the save itself
    assert len(writers) == 1, writers
    writer = psutil.Process(writers.pop())
    program = psutil.Process(proc.pid)
    assert writer.ppid() == proc.pid  # the program's child ...
    assert "spawn_main" in " ".join(writer.cmdline()), writer.cmdline()  # ... a fresh interpreter
    assert writer.cmdline() != program.cmdline()
    assert _signal_dispositions(proc.pid)["SIGTERM"] == "caught"  # the program's handler ...
    for pid in [writer.pid, *held]:  # ... is not the writer's
        assert _signal_dispositions(pid) == {"SIGINT": "default", "SIGUSR1": "default", "SIGTERM": "default"}, pid


@pytest.mark.heavy
def test_the_writer_dies_with_a_killed_training_process(held_save):
    import psutil

    proc, held, descendants = held_save
    assert held and all(p.is_running() for p in descendants)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert [(p.pid, " ".join(p.cmdline())[:80]) for p in alive if p.is_running()] == []


if __name__ == "__main__":
    _program(sys.argv[1])
