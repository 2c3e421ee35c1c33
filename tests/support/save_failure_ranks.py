"""One rank of the two-rank save-failure test (``tests/distributed/test_save_failures_two_ranks.py``):

    python -m tests.support.save_failure_ranks RANK WORLD PORT ROOT

runs every case of :data:`CASES` one after another in this process (torch and megatron are
imported once): in a fresh ``ROOT/<case>/checkpoints`` holding one complete save (iter 2, named by
``latest``), a save of iter 4 fails on one rank only -- a step only rank 0 takes, or rank 1's part
of the tensor write -- then, with the failure gone, a save of iter 6 on every rank. Each rank
appends to ``ROOT/rank<RANK>.jsonl`` a ``start`` record before a case (a rank that hangs is known
by its last one), what the failing save raised as soon as it returns, and the case's outcome. An
exception other than the save's ``CheckpointSaveError`` is recorded and ends the process: the
group may be out of step.

The state saved is a small state dict in place of a model's (``writer.full_state`` replaced, as in
``tests/unit/checkpointing/test_save_failures.py``, whose table of rank-0-only steps is used):
a tensor sharded over the ranks (each writes its own ``.distcp`` file) and common entries (rank 0
writes them into its ``.distcp`` file: megatron 0.19's ``common_state``). The writer, megatron's
save, the async writer process and publishing are the real ones. That table fails the rank-0-only
writes by replacing torch's ``finish`` and megatron's ``save_config`` whole; here they, torch's
``.metadata`` and rank 1's tensor files are written to
``/dev/full`` instead, so torch and Python raise what they raise on a full file system, inside
the functions the project's fixes wrap.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import builtins
import json
import os
import pathlib
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

FULL = "/dev/full"  #: every write to it fails with ENOSPC

RANK0_STEPS = ["makedirs", "partial-save cleanup", ".metadata", "metadata.json", "rename", "latest",
               "retention"]
RANK1_STEPS = ["rank 1 tensor write"]
#: (case name, the step that fails, async_save, the rank it fails on)
CASES = [(f"{step} {mode}", step, mode == "async", 1 if step in RANK1_STEPS else 0)
         for step in RANK0_STEPS + RANK1_STEPS for mode in ("sync", "async")]


def small_state(step: int) -> dict:
    """What ``full_state`` returns, in small: a tensor sharded over the ranks and common entries."""
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.arange(2048.0) + 2048 * rank + step
    return {"w": ShardedTensor.from_rank_offsets("w", shard, (0, rank, world), replica_id=0),
            "train_state": {"step": step}, "config_yaml": "x: 1\n"}


def _written_to_full_disk(mp, target, name, position: int, matches) -> None:
    """``target.name`` opens :data:`FULL` in place of the file argument at ``position`` when
    ``matches(path, *args)``."""
    real = getattr(target, name)

    def on_full_disk(*args, **kwargs):
        args = list(args)
        if len(args) > position and isinstance(args[position], (str, os.PathLike)) and matches(
                os.fspath(args[position]), *args):
            args[position] = FULL if isinstance(args[position], str) else type(args[position])(FULL)
        return real(*args, **kwargs)

    mp.setattr(target, name, on_full_disk)


def _opened_for_writing(mode_position: int, name: str):
    def matches(path, *args, **kwargs):
        mode = args[mode_position] if len(args) > mode_position else "r"
        return os.path.basename(path) == name and any(c in mode for c in "wax")
    return matches


def _tensor_files_on_full_disk(mp) -> None:
    """This rank's ``.distcp`` files (its part of the tensor write, sync or in the async writer
    process) go to :data:`FULL`: the buckets' file names are set where they are staged."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors

    def preload_onto_full_disk(write_buckets, non_blocking=True):
        return [(FULL, key, data) for _, key, data in preload(write_buckets, non_blocking)]

    mp.setattr(FileSystemWriterAsync, "preload_tensors", staticmethod(preload_onto_full_disk))


def inject(mp, step: str) -> None:
    """Make ``step`` fail in this process (ENOSPC)."""
    from tests.unit.checkpointing.test_save_failures import _fail_on, _steps

    if step == ".metadata":  # torch's FileSystemWriter.finish: Path(".metadata.tmp").open("wb")
        _written_to_full_disk(mp, pathlib.Path, "open", 0, _opened_for_writing(1, ".metadata.tmp"))
    elif step == "metadata.json":  # megatron's save_config: open(path, "w")
        _written_to_full_disk(mp, builtins, "open", 0, _opened_for_writing(1, "metadata.json"))
    elif step == "rank 1 tensor write":
        _tensor_files_on_full_disk(mp)
    else:
        _fail_on(mp, *_steps()[step])


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def run_case(root: str, name: str, step: str, async_save: bool, failing_rank: int, record) -> dict:
    from checkpointing import files, writer as writer_mod
    from checkpointing.files import CheckpointSaveError
    from tests.unit.checkpointing.test_save_failures import save

    rank = dist.get_rank()
    ckpts = os.path.join(root, name.replace(" ", "_").replace(".", ""), "checkpoints")
    save(writer_mod.CheckpointWriter(ckpts, keep_last=1, async_save=False), 2)
    if step == "partial-save cleanup" and rank == 0:
        os.makedirs(os.path.join(ckpts, "iter_0000003.tmp"))  # a save a kill interrupted
    dist.barrier()
    out = {"before": _listing(ckpts)}
    dist.barrier()  # every rank has looked before rank 0 starts the next save
    w = writer_mod.CheckpointWriter(ckpts, keep_last=1, async_save=async_save)
    with pytest.MonkeyPatch.context() as mp:
        if rank == failing_rank:
            inject(mp, step)
        try:
            save(w, 4)
            out["error"] = None
        except CheckpointSaveError as e:
            out["error"] = str(e)
    out["in_flight"] = w.in_flight is not None
    record({"case": name, "failed_save": out["error"]})  # before the next collective
    dist.barrier()  # rank 0 has removed the partial folder
    out["after"] = _listing(ckpts)
    out["latest_after"] = open(os.path.join(ckpts, "latest")).read()
    out["previous_verifies"] = files.verify(os.path.join(ckpts, "iter_0000002"))
    out["final"] = os.path.join(ckpts, "iter_0000004")
    dist.barrier()
    save(w, 6)  # the failure gone: the next save is published
    dist.barrier()
    out["next"] = _listing(ckpts)
    out["latest_next"] = open(os.path.join(ckpts, "latest")).read()
    out["next_verifies"] = files.verify(os.path.join(ckpts, "iter_0000006"))
    return out


def main(rank: int, world: int, port: int, root: str) -> None:
    from checkpointing import writer as writer_mod
    from parallel.config import ParallelConfig
    from parallel.initialize import DistEnv, initialize

    # a rank left waiting in a collective fails after a minute instead of waiting 30 (the test's
    # hard timeout ends a process that waits anyway)
    env = DistEnv(rank, world, rank, "127.0.0.1", port, "single")
    initialize(ParallelConfig(timeout_minutes=1.0), seed=5, env=env)
    writer_mod.full_state = lambda *a, **k: small_state(a[3].step)
    log = open(os.path.join(root, f"rank{rank}.jsonl"), "a")

    def record(obj) -> None:
        log.write(json.dumps(obj) + "\n")
        log.flush()

    for name, step, async_save, failing_rank in CASES:
        record({"case": name, "start": True})
        try:
            record({"case": name, "result": run_case(root, name, step, async_save, failing_rank, record)})
        except BaseException:  # noqa: BLE001 -- reported to the test; the group may be out of step
            record({"case": name, "crash": traceback.format_exc()})
            log.close()
            os._exit(1)
    record({"done": True})
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
