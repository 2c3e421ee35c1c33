"""Run ``pretrain.train`` so that every rank stops itself (SIGSTOP) at a chosen checkpoint.

    python -m tests.support.stop_at_checkpoint --stop-after=iter_0000003 [hydra overrides]
    python -m tests.support.stop_at_checkpoint --hold-write=iter_0000004 [hydra overrides]

A kill test must SIGKILL a run between one checkpoint and the next. Polling ``latest`` from the
test and killing when it names the checkpoint raced the run: on a busy machine the remaining steps
could finish before the poller looked. This launcher wraps the checkpoint writer from outside the
pipeline: ``--stop-after``: once the named checkpoint is published (files, manifest and ``latest``
written, every rank past it), each rank freezes, so the test's SIGKILL always lands between that
checkpoint and the next, whatever the load. ``--hold-write``: each rank's background writer of the
named checkpoint (``checkpoint.async_save=true``, a spawned process) creates ``<its .tmp
folder>/held.<pid>`` and then sleeps instead of writing, so the test can kill the run while that save is in flight.
The training code has no hook for either.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import os
import runpy
import signal
import sys
import time

FLAG = "--stop-after="


def install(wanted: str) -> None:
    from checkpointing.writer import CheckpointWriter

    publish = CheckpointWriter._publish

    def publish_then_stop(self, tmp, final, stage_final):
        publish(self, tmp, final, stage_final)
        if os.path.basename(os.path.normpath(str(final))) == wanted:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test kills the frozen run

    CheckpointWriter._publish = publish_then_stop


HOLD_ENV = "STOP_AT_CHECKPOINT_HOLD"  #: the held save's folder name, for the spawned writer too
_WRITE: list = []  #: megatron's write function, in this process


def _held_write(transform_list, use_msc, rank, write_buckets, results_queue):
    """megatron's write function, sleeping instead of writing the held save. It runs in the
    async writer, a spawned process: it reaches it by name (the writer imports this main module)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    folder = os.path.dirname(str(write_buckets[0][0])) if write_buckets else ""
    if os.path.basename(folder) == os.environ.get(HOLD_ENV, "") + ".tmp":
        open(os.path.join(folder, f"held.{os.getpid()}"), "w").close()
        time.sleep(3600)  # the test kills the run meanwhile
    write = _WRITE[0] if _WRITE else FileSystemWriterAsync.write_preloaded_data_multithread
    return write(transform_list, use_msc, rank, write_buckets, results_queue)


def hold_write(wanted: str) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    os.environ[HOLD_ENV] = wanted
    _WRITE.append(FileSystemWriterAsync.write_preloaded_data_multithread)
    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(_held_write)


HOLD = "--hold-write="


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].startswith((FLAG, HOLD)):
        raise SystemExit(f"usage: python -m {__name__} {FLAG}|{HOLD}iter_<step:07d> [hydra overrides]")
    if sys.argv[1].startswith(FLAG):
        install(sys.argv[1][len(FLAG):])
    else:
        hold_write(sys.argv[1][len(HOLD):])
    del sys.argv[1]  # the rest is Hydra's
    runpy.run_module("pretrain.train", run_name="__main__")


if __name__ == "__main__":
    main()
