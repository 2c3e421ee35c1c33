"""Getting checkpoints onto disk: every rank writes its own shard, in the background when asked.

A save goes to ``iter_<step>.tmp`` through megatron's fully parallel save strategy (the
data-parallel ranks split the writing of what they hold in common, each writes only its shard of
the optimizer state: ``state.OPTIMIZER_FORMAT``; a stage's final checkpoint is written in the
format any layout loads where the next stage needs that). With ``async_save`` this rank's shard is
staged in host memory and written by a writer process while training goes on;
:meth:`CheckpointWriter.poll` (between steps) finishes saves whose files every rank has
written. Only then -- megatron has written its metadata -- does rank 0 write the manifest, fsync,
rename the folder to ``iter_<step>``, replace ``latest`` and prune (:func:`publish`), so a crash or
kill while a save is in flight leaves the previous checkpoint the newest complete one, and the
partial ``.tmp`` folder is named when the run resumes (``files.latest_checkpoint``). One save is
in flight at a time: a new one first finishes the previous.

The writer process. megatron's ``AsyncCallsQueue()`` forks the training process for every save
(``TemporalAsyncCaller``): a fork of a process that initialised CUDA and NCCL, which inherits the
preemption signal handler (it ignored SIGTERM) and outlived a SIGKILLed run for good. Its
``persistent=True`` caller spawns one worker instead, but that worker opens a CUDA context of its
own, divides by ``torch.cuda.device_count()`` (zero on CPU ranks), takes the live tensors and hangs
the run when it dies. The queue here is megatron's with the project's caller
(``parallel.megatron_compat.async_writer``): one *spawned* writer per training process, started
at the first async save and reused, that only writes host memory the training process staged,
dies with the training process (``PR_SET_PDEATHSIG``) and has the default signal handling.

A save that cannot be written -- a full or read-only file system at any step: the folder, the
removal of interrupted saves, the files, the metadata, publishing, retention -- raises
:class:`~checkpointing.files.CheckpointSaveError` on every rank at the same point (a failure on
rank 0 alone is shared by one all-reduce first, so no rank waits for it in a collective; so is the
errno of a failed tensor write, which torch names on the coordinator only), after
the partial folder was removed and anything publishing had changed was put back: the previous
checkpoint and ``latest`` are as they were. ``pretrain.train`` prints it as one ``error:`` line.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from checkpointing.files import (LATEST, STAGE_FINAL, CheckpointSaveError, _causes, apply_retention,
                                 fsync, fsync_tree, iter_dir, partial_saves, save_failure, write_atomic,
                                 write_manifest)
from checkpointing.state import TrainState, full_state
from parallel.megatron_compat import deferred_rank_zero_writes, take_deferred_write_failure
from parallel.megatron_compat.async_writer import spawned_writer_queue

_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")  #: how an OSError's str() names its errno


def publish(ckpt_dir: str, tmp: str, final: str, stage_final: str | None, keep_last: int) -> None:
    """Rank 0, once every rank's files are written: mark a stage's final checkpoint, write the
    manifest, make it durable, rename it into place, then ``latest``, then retention. When a step
    fails, what the earlier ones changed is put back (the new folder is gone, ``latest`` names
    what it named) and the OSError raised."""
    pointer = os.path.join(ckpt_dir, LATEST)
    before = _read_bytes(pointer)
    renamed = False
    try:
        if stage_final is not None:
            write_atomic(os.path.join(tmp, STAGE_FINAL), stage_final)
        write_manifest(tmp)
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        renamed = True
        fsync(ckpt_dir)
        write_atomic(pointer, os.path.basename(final))
        apply_retention(ckpt_dir, keep_last)
    except OSError:
        _put_back(pointer, before, final if renamed else None)
        raise


def _read_bytes(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _put_back(pointer: str, before: Optional[bytes], published: Optional[str]) -> None:
    """Best effort, after a failed publish: ``latest`` as it was, no ``latest.tmp``, no new folder."""
    for leftover in (f"{pointer}.tmp", published):
        if leftover and os.path.isdir(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover and os.path.exists(leftover):
            os.remove(leftover)
    try:
        if _read_bytes(pointer) != before:
            if before is None:
                os.remove(pointer)
            else:
                with open(pointer, "wb") as f:
                    f.write(before)
    except OSError:
        pass  # the disk refuses even that: resume scans the folders, latest is only a hint


def remove_partial_saves(ckpt_dir: str) -> list[str]:
    """Rank 0, with no save in flight: delete the ``iter_*.tmp`` folders (saves a crash or kill
    interrupted); returns their names. A folder that cannot be removed raises its OSError."""
    gone = partial_saves(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    for d in gone:
        shutil.rmtree(os.path.join(ckpt_dir, d), onerror=_raise_unless_gone)
    return gone


def _raise_unless_gone(function, path, exc_info) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def _prepare(ckpt_dir: str, tmp: str) -> None:
    os.makedirs(ckpt_dir, exist_ok=True)
    remove_partial_saves(ckpt_dir)  # no save is in flight: these were interrupted
    os.makedirs(tmp)


def shared_failure(error: Optional[OSError]) -> Optional[OSError]:
    """Every rank's view of an OSError that happened on some ranks (rank 0's own writes): one
    all-reduce of its errno. A rank that did not see it gets an OSError with the same errno."""
    code = torch.tensor([0 if error is None else (error.errno or 0) + 1], dtype=torch.int64,
                        device=torch.cuda.current_device())
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    if code.item() == 0:
        return None
    if error is not None:
        return error
    err = int(code.item()) - 1
    return OSError(err, os.strerror(err) if err else "a write on another rank failed")


def _with_shared_cause(e: CheckpointException) -> BaseException:
    """torch's failure of a sharded write names the ranks' errors on the coordinator only, and
    as text: megatron's finalize (``save_state_dict_async_finalize``) gathers each rank's write
    result (its writer's OSError became ``RuntimeError("Worker failure: [Errno 28] ...")``,
    pickled without its cause) and broadcasts a flag, so every other rank -- the one whose file
    write failed too -- raised ``CheckpointException ranks:dict_keys([])``, a line naming no
    cause. Every rank raises it at the same point: one all-reduce shares the errno (an OSError's,
    else the ``[Errno N]`` of the text), and a rank whose exception carries no OSError with it
    reports it as that OSError, caused by ``e``."""
    found = next((c for c in _causes(e) if isinstance(c, OSError) and c.errno), None)
    texts = (_ERRNO_TEXT.search(str(c)) for c in _causes(e))
    code = found.errno if found is not None else next((int(m.group(1)) for m in texts if m), 0)
    shared = shared_failure(OSError(code, os.strerror(code)) if code else None)
    if found is not None or shared is None:
        return e
    shared.__cause__ = e
    return shared


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
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        self.ckpt_dir, self.keep_last, self.async_save = ckpt_dir, keep_last, async_save
        self.strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy(),
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            do_cache_distribution=True)
        self.queue = spawned_writer_queue() if async_save else None
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
        self._on_rank0(final, tmp, lambda: _prepare(self.ckpt_dir, tmp))
        sd = full_state(model_chunks, optimizer, scheduler, state, config_yaml, par, reshardable)
        marker = state.stage if stage_final else None
        report = SaveReport(final, stage_final, 0.0)
        try:
            with deferred_rank_zero_writes():
                # "mcore": megatron's own async request, which async_writer.SpawnedWriter runs
                # (0.19's default, "nvrx", needs nvidia-resiliency-ext's writer process instead)
                request = dist_checkpointing.save(sd, tmp, sharded_strategy=self.strategy,
                                                  async_sharded_save=self.async_save, async_strategy="mcore")
        except (Exception, CheckpointException) as e:  # every rank raises: megatron gathers the
            # write results; torch's CheckpointException is a BaseException
            self._fail(final, tmp, e)
        self._on_rank0(final, tmp, take_deferred_write_failure)  # .metadata and metadata.json when sync
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
            with deferred_rank_zero_writes():  # megatron's finalize writes the metadata on rank 0
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
        def metadata_then_publish():
            kept = take_deferred_write_failure()  # megatron's metadata, written on rank 0
            if kept is not None:
                raise kept
            publish(self.ckpt_dir, tmp, final, stage_final, self.keep_last)

        self._on_rank0(final, tmp, metadata_then_publish)

    def _on_rank0(self, final: str, tmp: str, step: Callable) -> None:
        """``step()`` on rank 0 (a function returning an OSError reports it, one raising it too);
        every rank raises the save's failure when it failed."""
        error = None
        if dist.get_rank() == 0:
            try:
                error = step()
            except OSError as e:
                error = e
            error = error if isinstance(error, OSError) else None
        error = shared_failure(error)
        if error is not None:
            self._fail(final, tmp, error)

    def _fail(self, final: str, tmp: str, e: BaseException):
        if isinstance(e, CheckpointSaveError):
            raise e
        if isinstance(e, CheckpointException):
            e = _with_shared_cause(e)
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(save_failure(final, tmp, e)) from e
