"""Where library output goes. megatron-core, datatrove, W&B and Python's ``warnings`` talk a
lot (a DDP bucket's parameter list per stage, dataset index messages per shard, TE/Apex
fallbacks); that goes to ``<run_dir>/logs/rank<N>.log``. The console keeps what this project's
own packages log (rank 0 only), every error from any rank, and nothing else -- unless
``logger.verbose``, which puts the libraries' records back on the console as well.

Records logged before the run dir exists (imports, validation) are held and written to the
file once it does; if the run stops before that, only the console's share was ever shown.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import sys
from typing import Optional

#: loggers under these names are the project's own: never taken off the console
OWN_PACKAGES = ("pretrain", "data_pipeline", "parallel", "model_providers", "checkpointing", "planner", "__main__")
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_active: Optional["LogRouting"] = None


class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


class _Console(logging.Handler):
    """stderr as it is at each record: rich's live progress bar swaps ``sys.stderr`` for a proxy
    that prints above the bar; while :meth:`LogRouting.children_to_file` has fd 2 on the log
    file, the original stderr."""

    def __init__(self, routing: "LogRouting"):
        super().__init__()
        self.routing = routing
        self.setFormatter(_ConsoleFormatter("%(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        r = self.routing
        if record.levelno >= logging.ERROR or (r.verbose and record.levelno >= logging.INFO):
            return True
        return r.rank in (None, 0) and record.name.split(".")[0] in OWN_PACKAGES

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = self.routing.saved_stderr or sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's contract: a broken handler never raises)
            self.handleError(record)


class LogRouting:
    """Owns the root logger's handlers for one run; :meth:`close` puts back what was there."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.rank: Optional[int] = None  #: known once the process group is up
        self.path: Optional[str] = None
        self.saved_stderr = None
        self.console = _Console(self)
        self.pending = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
        self.file: Optional[logging.Handler] = None
        root = logging.getLogger()
        self._before = (list(root.handlers), root.level)
        for h in self._before[0]:  # Hydra's job_logging console (stdout) among them
            root.removeHandler(h)
        root.addHandler(self.console)
        root.addHandler(self.pending)
        root.setLevel(logging.INFO)
        logging.captureWarnings(True)

    def to_file(self, run_dir: str, rank: int) -> str:
        """From now on, records go to ``<run_dir>/logs/rank<rank>.log`` (appended: a resumed
        run continues the file), the held ones first. Returns the path."""
        self.rank = rank
        self.path = os.path.join(run_dir, "logs", f"rank{rank}.log")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.file = logging.FileHandler(self.path, mode="a", encoding="utf-8")
        self.file.setFormatter(logging.Formatter(FILE_FORMAT))
        self.pending.setTarget(self.file)
        self.pending.flush()
        root = logging.getLogger()
        root.removeHandler(self.pending)
        root.addHandler(self.file)
        return self.path

    @contextlib.contextmanager
    def children_to_file(self, path: Optional[str] = None):
        """Point fd 2 at the log file (or ``path``: before the run's log exists) for the block.
        Worker processes started inside it (datatrove's preprocessing pool, which re-imports
        megatron) and loguru's stderr sinks then write there instead of the console; the console
        handler keeps the real stderr, and an exception still propagates to be reported after
        the block."""
        path = path or (self.path if self.file is not None else None)
        if self.verbose or path is None:
            yield
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        sys.stderr.flush()
        saved_fd = os.dup(2)
        log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self.saved_stderr = os.fdopen(os.dup(saved_fd), "w", buffering=1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            self.saved_stderr.close()
            self.saved_stderr = None

    def close(self) -> None:
        global _active
        root = logging.getLogger()
        for h in (self.console, self.pending, self.file):
            if h is not None:
                root.removeHandler(h)
                h.close()
        handlers, level = self._before
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        logging.captureWarnings(False)
        if _active is self:
            _active = None


def route(verbose: bool) -> LogRouting:
    """Take over the root logger for this run (call before megatron is imported: it logs at
    import). Replaces a previous routing of this process."""
    global _active
    if _active is not None:
        _active.close()
    _active = LogRouting(verbose)
    return _active


@contextlib.contextmanager
def children_to_file(path: Optional[str] = None):
    """:meth:`LogRouting.children_to_file` of the active routing (nothing without one)."""
    if _active is None:
        yield
        return
    with _active.children_to_file(path):
        yield
