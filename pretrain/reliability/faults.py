"""Faults a long run must survive: preemption signals and non-finite steps.

- **Preemption.** Slurm warns a job with ``USR1`` (``--signal=B:USR1@<grace>``, forwarded to the
  tasks by ``slurm/pretrain.sh``) and stops it with ``SIGTERM``. Either only sets a flag; after
  each step every rank all-reduces the flag, so all ranks stop after the *same* step, save a
  checkpoint and exit with :data:`PREEMPTED_EXIT`, which the batch script answers with
  ``scontrol requeue``. The requeued job resumes from ``latest``. Before the first step there is
  nothing to save: a signal during a wait or build that may last minutes (the run-dir lock, the
  data build: :meth:`PreemptionSignal.stopping`) raises :class:`Preempted` at once, and one that
  came elsewhere before stepping is agreed on once the process group and the lock are up; the
  run stops with one line and :data:`PREEMPTED_EXIT`. Under torchrun, ``python -m
  pretrain.torchrun`` keeps that status (torchrun's own is 1 for any failed rank).
- **Non-finite steps.** megatron's optimizer skips a step on found-inf only with an fp16 loss
  scaler; with fp32/bf16 it would apply NaN. :func:`step_is_finite` checks this rank's loss and
  gradient buffers before ``optimizer.step`` and agrees across all ranks; a bad step is skipped
  (no update, no LR-schedule advance, logged with ``skipped: true``). After
  ``faults.reload_after_bad_steps`` bad steps in a row, :class:`NonFinitePolicy` asks the loop to
  reload the last checkpoint's weights, optimizer and schedule while the data position moves on,
  so the batches that led to the blow-up are not replayed.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from parallel.device import current_device

#: exit status of a run stopped by USR1/SIGTERM after saving (sysexits' EX_TEMPFAIL: try again)
PREEMPTED_EXIT = 75


@dataclass
class FaultsConfig:
    reload_after_bad_steps: int = 3  #: reload the last checkpoint after this many non-finite steps in a row (0 = only skip)
    max_reloads: int = 3  #: raise instead of reloading once more than this many reloads happened in one job
    diverged_after: int = 3  #: a run whose last this-many steps were all skipped ends with exit status 1 (0 = never)


def check(cfg: FaultsConfig) -> list[str]:
    """Config problems, named by field and value."""
    problems = []
    if cfg.reload_after_bad_steps < 0:
        problems.append(f"faults.reload_after_bad_steps={cfg.reload_after_bad_steps} must be >= 0")
    if cfg.max_reloads < 0:
        problems.append(f"faults.max_reloads={cfg.max_reloads} must be >= 0")
    if cfg.diverged_after < 0:
        problems.append(f"faults.diverged_after={cfg.diverged_after} must be >= 0")
    return problems


def divergence(history: list[dict], cfg: FaultsConfig) -> str | None:
    """Why the run counts as diverged (its last ``diverged_after`` steps were all skipped), or None."""
    trailing = 0
    for rec in reversed(history):
        if not rec.get("skipped"):
            break
        trailing += 1
    if not cfg.diverged_after or trailing < cfg.diverged_after:
        return None
    first, last = history[-trailing]["step"], history[-1]["step"]
    return (f"the run diverged: its last {trailing} steps ({first}-{last}) were all skipped "
            f"(non-finite loss or gradients), so they trained nothing; the checkpoints hold the "
            f"weights from before step {first}. Lower the LR or inspect the data of those steps "
            f"(faults.diverged_after={cfg.diverged_after})")


class Preempted(BaseException):
    """A preemption signal before the first step: the run stops where it is (there is nothing
    to save yet) and exits with :data:`PREEMPTED_EXIT`. A BaseException, like KeyboardInterrupt,
    so that library code catching Exception (DataTrove's pipeline, megatron's builders) lets it
    through; ``signal_name`` and ``where`` are its args (it crosses ranks pickled)."""

    def __init__(self, signal_name: str, where: str):
        super().__init__(signal_name, where)
        self.signal_name, self.where = signal_name, where

    def line(self) -> str:
        return (f"{self.signal_name} during {self.where}: stopped before training; "
                f"exit {PREEMPTED_EXIT} (preempted)")


class PreemptionSignal:
    """Remembers that USR1 or SIGTERM arrived; :meth:`agreed` is the collective decision. Inside
    :meth:`stopping` a signal raises :class:`Preempted` instead."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.received: Optional[str] = None
        self.agreed_signal: Optional[str] = None  #: after :meth:`agreed`: the signal any rank got
        self._stopping: Optional[str] = None  #: where the run is while a signal stops it at once
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        where, self._stopping = self._stopping, None  # one raise: cleanup after it is not cut
        if where is not None:
            raise Preempted(self.received, where)

    @contextlib.contextmanager
    def stopping(self, where: str):
        """A block before the first step (a wait, a data build) that a signal ends at once --
        one that came before the block too -- by raising :class:`Preempted` naming ``where``.
        Only for blocks whose writes never look complete before they are (temp folders renamed
        when done, marker files written last): the exception may come between any two
        bytecodes. Blocking calls are cut when they return to Python: ``time.sleep`` and a
        blocking ``flock`` at once (EINTR), a C loop when it ends."""
        self._stopping = where  # before the check: a signal in between raises from the handler
        try:
            if self.received:
                self._stopping = None
                raise Preempted(self.received, where)
            yield
        finally:
            self._stopping = None

    def sleep(self, seconds: float, where: str) -> None:
        """``time.sleep`` that a signal (or one before it) ends with :class:`Preempted`."""
        with self.stopping(where):
            time.sleep(seconds)

    def agreed(self) -> bool:
        """True on every rank when any rank got a signal (one all-reduce of one int: the
        largest signal number, kept as :attr:`agreed_signal`)."""
        flag = torch.tensor([int(signal.Signals[self.received]) if self.received else 0],
                            dtype=torch.int32, device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        self.agreed_signal = signal.Signals(signum).name if signum else None
        return bool(signum)

    def restore(self) -> None:
        self._stopping = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def step_is_finite(local_loss: torch.Tensor, ddp_chunks) -> bool:
    """Whether the loss (on the ranks that hold it) and every gradient buffer element are finite,
    agreed by all ranks. Grad buffers are megatron DDP's flat ``grad_data`` (dense and expert
    buffers), already reduced over data-parallel ranks, so any NaN/Inf in the global gradient
    shows up on some rank and hence, after the MAX all-reduce, on all."""
    finite = torch.isfinite(local_loss).all()
    for chunk in ddp_chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            finite = finite & torch.isfinite(buffer.grad_data).all()
    flag = (~finite).to(torch.int32).reshape(1)  # on the device: one sync, after the all-reduce
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())


class NonFinitePolicy:
    """Counts skipped steps in a row and decides when to reload the last checkpoint."""

    def __init__(self, cfg: FaultsConfig):
        self.cfg = cfg
        self.bad_in_a_row = 0
        self.reloads = 0

    def should_reload(self, skipped: bool, step: int) -> bool:
        """Record one step's outcome; True when the checkpoint is to be reloaded now."""
        self.bad_in_a_row = self.bad_in_a_row + 1 if skipped else 0
        n = self.cfg.reload_after_bad_steps
        if not n or self.bad_in_a_row < n:
            return False
        if self.reloads >= self.cfg.max_reloads:
            raise RuntimeError(
                f"{self.bad_in_a_row} non-finite steps in a row up to step {step} after "
                f"{self.reloads} checkpoint reloads (faults.max_reloads={self.cfg.max_reloads}); giving up")
        self.reloads += 1
        self.bad_in_a_row = 0
        return True


def reload_last_checkpoint(ckpt_dir: str, model_chunks, optimizer, scheduler, step: int) -> str:
    """Weights, optimizer, LR schedule and RNG from the newest complete checkpoint; the caller
    keeps its step and data position (the batches since that checkpoint are not replayed)."""
    from checkpointing import state as checkpoint
    path = checkpoint.latest_checkpoint(ckpt_dir)
    if path is None:
        raise RuntimeError(f"non-finite steps in a row up to step {step} and no checkpoint in {ckpt_dir} "
                           "to reload (set checkpoint.save_every, or faults.reload_after_bad_steps=0)")
    checkpoint.load(path, model_chunks, optimizer, scheduler)
    if dist.get_rank() == 0:
        logging.getLogger(__name__).warning(
            "step %d: non-finite steps in a row; reloaded %s, data continues at this step", step, path)
    return path
