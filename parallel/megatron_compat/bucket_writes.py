"""A checkpoint file write that fails keeps its error (megatron-core 0.19.2).

megatron's torch_dist writer writes each rank's files in buckets
(``FileSystemWriterAsync.write_preloaded_data``, one per thread); a bucket that fails returns
``(index, exception)``. 0.19's ``write_preloaded_data_multithread`` then asserts that every
bucket's outcome is a list (``check_local_output``): the ``AssertionError`` names only the type
(``<class 'OSError'>``), so the rank's result is ``"An error is caught while starting worker 0,
error: <class 'OSError'>"``, and every rank's ``CheckpointException`` loses what failed ("no
space left on device"); with several buckets the assertion escapes a thread's collection and the
other ranks wait in finalize's gather. 0.16 put the exception itself in the results queue.

Here a failed bucket's outcome is a :class:`FailedBucket`: an empty list (it passes the
assertion) that holds the exception; :meth:`retrieve_write_results` hands that exception to
megatron as 0.16's writer did (``"Worker failure: [Errno 28] No space left on device"``). It is
installed in the training process (``fixes.install``, for synchronous saves and the retrieval)
and in the async writer process (``async_writer.writer_main``, which writes the buckets there)."""

from __future__ import annotations

import functools
import queue

from parallel.megatron_compat.version import check_megatron_core

_INSTALLED = False


class FailedBucket(list):
    """The outcome of a bucket whose write raised ``error``: no write results."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error

    def __reduce__(self):
        return FailedBucket, (self.error,)


def _kept(outcome):
    """A bucket's outcome with an exception kept as a :class:`FailedBucket`."""
    return FailedBucket(outcome) if isinstance(outcome, BaseException) else outcome


def _first_failure(outcome):
    """The exception of a failed bucket in a writer's outcome (a dict bucket -> results), or None."""
    if isinstance(outcome, dict):
        return next((r.error for r in outcome.values() if isinstance(r, FailedBucket)), None)
    return None


def install() -> None:
    """Install once, in each process that writes or retrieves buckets (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_megatron_core(__file__)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write_one_bucket = FileSystemWriterAsync.write_preloaded_data  # the staticmethod's function
    retrieve = FileSystemWriterAsync.retrieve_write_results

    @functools.wraps(write_one_bucket)
    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, results_queue, count_queue,
                             use_fsync, **kwargs):  # megatron passes all but the first by name
        relay = _Relay(results_queue) if results_queue is not None else None
        index, outcome = write_one_bucket(transform_list, local_proc_idx=local_proc_idx, write_bucket=write_bucket,
                                          results_queue=relay, count_queue=count_queue, use_fsync=use_fsync,
                                          **kwargs)  # by name, as megatron calls it
        return index, _kept(outcome)

    @functools.wraps(retrieve)
    def retrieve_write_results(self):
        if self.results_queue is not None:
            try:
                outcome = self.results_queue.get_nowait()
            except queue.Empty:
                pass  # megatron reports the empty queue itself
            else:
                error = _first_failure(outcome)
                self.results_queue.put(outcome if error is None else error)
        return retrieve(self)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
    FileSystemWriterAsync.retrieve_write_results = retrieve_write_results
    _INSTALLED = True


class _Relay:
    """A threaded bucket's results queue, seen through: what the bucket puts, a failure as a
    :class:`FailedBucket`."""

    def __init__(self, results_queue):
        self.results_queue = results_queue

    def put(self, item) -> None:
        index, outcome = item
        self.results_queue.put((index, _kept(outcome)))
