"""The process that writes async checkpoint saves: spawned once per training process, never forked
from it, dying with it.

megatron-core 0.19.2's ``AsyncCallsQueue`` has two callers of its own (``strategies/async_utils.py``):

- ``TemporalAsyncCaller`` (the default, ``persistent=False``) *forks the training process* for
  every save. After CUDA and NCCL are up a fork is undefined behaviour (the child holds copies of
  the CUDA context, NCCL's sockets and threads' locks); the child also inherits every signal
  handler (the preemption handler of ``pretrain.reliability.faults`` makes it ignore SIGTERM)
  and every open file, and nothing ends it when the training process is SIGKILLed: it stayed,
  re-parented to init, holding ``metrics.jsonl``, the rank log and sockets.
- ``PersistentAsyncCaller`` (``persistent=True``) *spawns* one worker, once. But the worker calls
  ``torch.cuda.set_device(rank % torch.cuda.device_count())`` (a ZeroDivisionError on CPU ranks, a
  CUDA context of its own on every GPU rank), receives the live training tensors (CUDA IPC; on
  CPU ranks ``share_memory_`` moves the parameters' storage into shared memory) and stages them
  itself, and ``is_current_async_call_done(blocking=True)`` waits forever for a worker that died.

:class:`SpawnedWriter` is a third ``AsyncCaller`` for megatron's own queue: the training process
stages the tensors as the temporal caller does (``preload_fn``: the device-to-host copy on GPUs, a
copy on CPU ranks, into shared memory reused by every save: ``fixes.StagingBuffers``), hands it to one
spawned writer per training process (shared memory), which runs megatron's write function
(``FileSystemWriterAsync.write_preloaded_data_multithread``: 0.19 writes the files with threads
of the writer, a process that never touched CUDA) and sends the write results back with its completion
(they reach megatron's in-process results queue, so no ``multiprocessing.Manager`` is needed).
The writer sets ``PR_SET_PDEATHSIG`` (SIGKILL when the training process dies, however it dies),
checks that its parent is still alive right after (a parent gone before the call leaves no one
to send the signal), does the same in each per-file writer it forks, and puts SIGTERM, SIGINT and
SIGUSR1 back to their default actions. A writer that died is reported as the save's failure.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import queue
import signal
from multiprocessing.reduction import ForkingPickler
from typing import Optional

from parallel.megatron_compat import bootstrap

bootstrap()  # the writer process imports this module first (writer_main); a no-op in a training process

import torch  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import (  # noqa: E402
    AsyncCaller, AsyncCallsQueue, AsyncRequest)

from parallel.megatron_compat import bucket_writes
from parallel.megatron_compat.version import check_megatron_core

PR_SET_PDEATHSIG = 1  #: linux/prctl.h
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
RESULTS = "<megatron's write results queue>"  #: stands for the in-process results queue in a job
POLL_S = 0.5  #: how often a blocking wait checks that the writer is still alive


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when its parent dies; exits now when the parent died
    before the call (then no signal would ever come)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:
        os._exit(1)


def default_signal_handling() -> None:
    for s in DEFAULT_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, DEFAULT_SIGNALS)


def _picklable(outcome):
    try:
        ForkingPickler.dumps(outcome)
        return outcome
    except Exception as e:  # noqa: BLE001 -- an exception that does not pickle travels as text
        return RuntimeError(f"{outcome!r} (not picklable: {e})")


def writer_main(parent_pid: int, jobs, done) -> None:
    """The writer process: runs each job ``(seq, fn, args, kwargs)`` until ``None`` arrives and
    answers ``(seq, what fn put in its results queue, or the exception it raised)``."""
    die_with_parent(parent_pid)
    default_signal_handling()
    bucket_writes.install()  # the buckets are written here
    me = os.getpid()
    os.register_at_fork(after_in_child=lambda: die_with_parent(me))  # megatron's per-file writers
    while True:
        job = jobs.get()
        if job is None:
            return
        seq, fn, args, kwargs = job
        results: queue.Queue = queue.Queue()
        args = [results if isinstance(a, str) and a == RESULTS else a for a in args]
        try:
            fn(*args, **kwargs)
            outcome = results.get_nowait() if not results.empty() else None
        except Exception as e:  # noqa: BLE001 -- the save's failure, raised on every rank at finalize
            outcome = e
        done.put((seq, _picklable(outcome)))
        del job, fn, args, kwargs, results, outcome
        gc.collect()


class SpawnedWriter(AsyncCaller):
    """megatron's ``AsyncCaller`` contract with one spawned writer process (started at the first
    save, reused by every later one, killed at exit); one save at a time."""

    def __init__(self):
        self.owner = os.getpid()
        self.process = None
        self.jobs = self.done = None
        self.seq = 0
        self.pending: Optional[tuple[int, list]] = None  #: (seq, the results queues to fill)
        atexit.register(self._at_exit)

    def _start(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.jobs, self.done = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=writer_main, args=(os.getpid(), self.jobs, self.done),
                                   name="checkpoint-writer")
        self.process.start()

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        args = list(async_req.async_fn_args)
        if async_req.preload_fn:  # staged here, as megatron's temporal caller does
            args[1] = async_req.preload_fn()
        if self.process is None or not self.process.is_alive():
            self._start()
        self.seq += 1
        queues = [a for a in args if isinstance(a, queue.Queue)]
        args = [RESULTS if isinstance(a, queue.Queue) else a for a in args]
        self.jobs.put((self.seq, async_req.async_fn, args, dict(async_req.async_fn_kwargs)))
        self.pending = (self.seq, queues)

    def _collect(self, blocking: bool) -> bool:
        """Whether the pending save is written on this rank (its results handed over)."""
        seq, queues = self.pending
        while True:
            try:
                got, outcome = self.done.get(timeout=POLL_S) if blocking else self.done.get_nowait()
            except queue.Empty:
                if self.process.is_alive():
                    if blocking:
                        continue
                    return False
                try:  # its last answer may have arrived as it exited
                    got, outcome = self.done.get(timeout=POLL_S)
                except queue.Empty:
                    got, outcome = seq, RuntimeError(
                        f"the checkpoint writer process {self.process.pid} died (exit code "
                        f"{self.process.exitcode}) before finishing the save")
                    self.process = None
            if got == seq:
                break
        for q in queues:
            q.put(outcome if outcome is not None else {})
        self.pending = None
        return True

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        is_alive = int(self.pending is not None and not self._collect(blocking))
        return (not is_alive) if no_dist else bool(self.sync_all_async_calls(is_alive))

    def close(self, abort: bool = False) -> None:
        """Stop the writer (``abort``: kill it, a save in flight is lost)."""
        if self.process is None or os.getpid() != self.owner:
            return
        if self.process.is_alive() and not abort:
            self.jobs.put(None)
            self.process.join()
        else:
            self.process.kill()
            self.process.join()
        self.process = None

    def _at_exit(self) -> None:
        # a save not finalized by now can no longer be published: the writer goes with us (it is
        # not a daemon -- megatron's write function starts processes of its own -- so
        # multiprocessing's exit handler would otherwise wait for it forever)
        self.close(abort=True)

    def __del__(self):
        pass


_WRITER: list = [None]


class _SpawnedWriterQueue(AsyncCallsQueue):
    """megatron's async queue whose every call goes to ``writer``. (0.19 keeps the persistent
    caller in a class attribute that every queue shares and builds its own there: the caller is
    given here instead. Not persistent, so the queue's ``close`` finalizes and leaves the writer,
    which the process keeps for its later queues and stops at exit.)"""

    def __init__(self, writer: SpawnedWriter):
        super().__init__(persistent=False)
        self.writer = writer

    def _get_async_caller(self) -> SpawnedWriter:
        return self.writer


def spawned_writer_queue() -> AsyncCallsQueue:
    """megatron's async queue with this process's one :class:`SpawnedWriter` as its caller."""
    check_megatron_core(__file__)
    if _WRITER[0] is None or _WRITER[0].owner != os.getpid():
        _WRITER[0] = SpawnedWriter()
    return _SpawnedWriterQueue(_WRITER[0])
