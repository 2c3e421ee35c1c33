"""Getting checkpoints onto disk: every rank writes its own shard, in the background when asked.

A save goes to ``iter_<step>.tmp`` through megatron's fully parallel save strategy (the
data-parallel ranks split the writing of what they hold in common, each writes only its shard of
the optimizer state: ``state.OPTIMIZER_FORMAT``; a stage's final checkpoint is written in the
format any layout loads where the next stage needs that). With ``async_save`` megatron's async queue
stages this rank's shard in host memory and a forked writer process writes it while training goes
on; :meth:`CheckpointWriter.poll` (between steps) finishes saves whose files every rank has
written. Only then -- megatron has written its metadata -- does rank 0 write the manifest, fsync,
rename the folder to ``iter_<step>``, replace ``latest`` and prune (:func:`publish`), so a crash or
kill while a save is in flight leaves the previous checkpoint the newest complete one, and the
partial ``.tmp`` folder is named when the run resumes (``files.latest_checkpoint``). One save is
in flight at a time: a new one first finishes the previous.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from checkpointing.files import (LATEST, STAGE_FINAL, CheckpointSaveError, apply_retention, fsync,
                                 fsync_tree, iter_dir, partial_saves, save_failure, write_atomic,
                                 write_manifest)
from checkpointing.state import TrainState, full_state
from parallel.megatron_compat import cross_process_write_results


def publish(ckpt_dir: str, tmp: str, final: str, stage_final: str | None, keep_last: int) -> None:
    """Rank 0, once every rank's files are written: mark a stage's final checkpoint, write the
    manifest, make it durable, rename it into place, then ``latest``, then retention."""
    if stage_final is not None:
        write_atomic(os.path.join(tmp, STAGE_FINAL), stage_final)
    write_manifest(tmp)
    fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync(ckpt_dir)
    write_atomic(os.path.join(ckpt_dir, LATEST), os.path.basename(final))
    apply_retention(ckpt_dir, keep_last)


def remove_partial_saves(ckpt_dir: str) -> list[str]:
    """Rank 0, with no save in flight: delete the ``iter_*.tmp`` folders (saves a crash or kill
    interrupted); returns their names."""
    gone = partial_saves(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    for d in gone:
        shutil.rmtree(os.path.join(ckpt_dir, d), ignore_errors=True)
    return gone


@dataclass
class SaveReport:
    """What one save cost: ``blocking_s`` the step loop waited (the whole save when synchronous),
    ``total_s`` from its start until it was published."""

    path: str
    stage_final: bool
    blocking_s: float
    total_s: Optional[float] = None  #: None while the files are still being written


class CheckpointWriter:
    """The saves of one stage (one parallel layout): megatron's fully parallel save strategy,
    whose distribution of the shared tensors over the data-parallel ranks is computed once and
    reused (the state dict's structure is fixed within a stage), and its async queue."""

    def __init__(self, ckpt_dir: str, keep_last: int, async_save: bool):
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        self.ckpt_dir, self.keep_last, self.async_save = ckpt_dir, keep_last, async_save
        self.strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy(),
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            do_cache_distribution=True)
        self.queue = AsyncCallsQueue() if async_save else None
        self.in_flight: Optional[tuple[SaveReport, str, float]] = None  #: (report, tmp, start)

    def save(self, model_chunks, optimizer, scheduler, state: TrainState, config_yaml: str, par,
             stage_final: bool = False, reshardable: bool = False) -> SaveReport:
        """Start (async) or do (sync) a save of ``state.step``; a previous save in flight is
        finished first. The state dict is captured now: training may go on at once.
        ``par``: the layout the optimizer state is written for; ``reshardable``: in the format
        any layout loads (a stage boundary where the layout changes)."""
        self.finish()
        t0 = time.perf_counter()
        final = iter_dir(self.ckpt_dir, state.step)
        tmp = final + ".tmp"
        if dist.get_rank() == 0:
            os.makedirs(self.ckpt_dir, exist_ok=True)
            remove_partial_saves(self.ckpt_dir)  # no save is in flight: these were interrupted
            os.makedirs(tmp)
        dist.barrier()
        sd = full_state(model_chunks, optimizer, scheduler, state, config_yaml, par, reshardable)
        marker = state.stage if stage_final else None
        report = SaveReport(final, stage_final, 0.0)
        try:
            with cross_process_write_results() if self.async_save else contextlib.nullcontext():
                request = dist_checkpointing.save(sd, tmp, sharded_strategy=self.strategy,
                                                  async_sharded_save=self.async_save)
        except (Exception, CheckpointException) as e:  # every rank raises: megatron gathers the
            # write results; torch's CheckpointException is a BaseException
            self._fail(final, tmp, e)
        publish_fn = lambda: self._publish(tmp, final, marker)  # noqa: E731
        if request is None:
            publish_fn()
            report.blocking_s = report.total_s = time.perf_counter() - t0
            return report
        request.add_finalize_fn(publish_fn)
        self.queue.schedule_async_request(request)
        report.blocking_s = time.perf_counter() - t0
        self.in_flight = (report, tmp, t0)
        return report

    def poll(self, blocking: bool = False) -> Optional[SaveReport]:
        """Between steps, on every rank: publish the save in flight if every rank's writer is done
        (``blocking``: wait for it). Returns its report once published. The check is one small
        all-reduce, made only while a save is in flight."""
        if self.in_flight is None:
            return None
        report, tmp, t0 = self.in_flight
        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except (Exception, CheckpointException) as e:
            self.in_flight = None
            self._fail(report.path, tmp, e)
        if not done:
            return None
        self.in_flight = None
        report.total_s = time.perf_counter() - t0
        return report

    def finish(self) -> Optional[SaveReport]:
        """Wait for the save in flight and publish it (before a stage ends, a checkpoint is read,
        or the process exits)."""
        return self.poll(blocking=True)

    def _publish(self, tmp: str, final: str, stage_final: Optional[str]) -> None:
        if dist.get_rank() == 0:
            publish(self.ckpt_dir, tmp, final, stage_final, self.keep_last)
        dist.barrier()

    def _fail(self, final: str, tmp: str, e: BaseException):
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(save_failure(final, tmp, e)) from e
