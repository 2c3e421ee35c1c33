"""One live run per run dir.

Two runs on one run dir (a requeued Slurm job whose old incarnation still runs, a user relaunching
by hand) would interleave ``metrics.jsonl`` and overwrite each other's checkpoints. Rank 0 holds
``<run_dir>/run.lock`` (host, pid, Slurm job id, start time) for the run's life and refreshes its
mtime every :data:`HEARTBEAT_S` seconds; the lock is created with ``O_EXCL``, so of two runs only
one gets it. A later run waits up to ``wait_s`` for a live holder, then refuses naming it. A
holder is dead when its process is gone (same host) or its heartbeat is older than
:data:`STALE_AFTER_S` (another host: its pid means nothing here); a dead holder's lock is taken
over with a warning, under an ``flock`` on a guard file so two runs cannot both take it over.
Every wait goes through ``pause`` (a preemption signal ends it: ``pretrain.train`` passes
:meth:`pretrain.reliability.faults.PreemptionSignal.sleep`); the guard is taken without
blocking, between pauses, so nothing waits where a pause cannot end it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0  #: heartbeat age after which a holder on another host is taken as dead

log = logging.getLogger(__name__)


class RunDirLocked(RuntimeError):
    """Another live run holds the run dir."""


def check_run_dir(run_dir: str, on_this_host: bool = True) -> list[str]:
    """Problems with ``trainer.run_dir`` as the folder a run fills (``checkpoints/``, ``logs/``,
    ``metrics.jsonl``, ``config.yaml``, ``run.lock``), found before anything is written: empty,
    or (``on_this_host``: the planner checks elsewhere) the current directory or one above it,
    an existing file, or a path that cannot be created (under a file, not writable)."""
    field = f"trainer.run_dir={run_dir!r}"
    if not run_dir.strip():
        return [f"{field} is empty: a run needs a folder of its own (the default is runs/${{trainer.name}})"]
    if not on_this_host:
        return []
    path, cwd = os.path.realpath(run_dir), os.path.realpath(os.getcwd())
    if path == cwd:
        return [f"{field} is the current directory {cwd}: a run needs a folder of its own "
                f"(e.g. runs/<name>)"]
    if os.path.commonpath([path, cwd]) == path:
        return [f"{field} is {path}, which holds the current directory {cwd}: a run needs a "
                f"folder of its own (e.g. runs/<name>)"]
    if os.path.exists(path) and not os.path.isdir(path):
        return [f"{field}: {path} exists and is not a folder"]
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"{field}: {path} cannot be created, {existing} is a file"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{field}: {existing} is not writable"]
    return []


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "started": time.time()}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: Optional[dict], age_s: Optional[float]) -> str:
    if holder is None:
        return f"an unreadable lock file, last written {age_s or 0:.0f} s ago"
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    beat = f", heartbeat {age_s:.0f} s ago" if age_s is not None else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {started}{beat}"


class RunDirLock:
    def __init__(self, run_dir: str, wait_s: float, poll_s: float = 1.0,
                 pause: Callable[[float], None] = time.sleep):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.wait_s, self.poll_s = wait_s, poll_s
        self.pause = pause  #: every wait: ``pause(seconds)``
        self._me: Optional[dict] = None
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def _read(self) -> tuple[Optional[dict], Optional[float]]:
        """The holder (None: unreadable, e.g. torn by a kill) and its heartbeat age; (None, None)
        when there is no lock."""
        try:
            age = time.time() - os.stat(self.path).st_mtime
            with open(self.path) as f:
                return json.load(f), age
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, age

    def _dead(self, holder: Optional[dict], age: float) -> bool:
        if holder is None:  # a torn lock file: dead once it stopped being refreshed
            return age > STALE_AFTER_S
        if holder.get("host") == socket.gethostname():
            return not _pid_alive(int(holder.get("pid", -1)))
        return age > STALE_AFTER_S

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        me = _me()
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        self._me = me
        return True

    def _take_over(self, holder: Optional[dict]) -> bool:
        """Remove a dead holder's lock and create ours, unless someone else got there first."""
        with open(self.path + ".guard", "a") as guard:
            while True:
                try:
                    fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self.pause(min(self.poll_s, 0.05))  # another run is deciding: briefly
            try:
                again, age = self._read()
                if again != holder or age is None or not self._dead(again, age):
                    return False
                os.unlink(self.path)
                return self._create()
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def acquire(self) -> Optional[str]:
        """Hold the lock (raises :class:`RunDirLocked` after ``wait_s`` of a live holder).
        Returns a warning when a dead holder's lock was taken over."""
        os.makedirs(self.run_dir, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        warned = False
        while True:
            if self._create():
                return self._start()
            holder, age = self._read()
            if age is None:
                continue  # released in between
            if self._dead(holder, age):
                if self._take_over(holder):
                    was = describe(holder, age)
                    return self._start(f"took over the run dir lock {self.path} of a run that is "
                                       f"gone ({was})")
                continue
            if time.monotonic() >= deadline:
                raise RunDirLocked(
                    f"run dir {self.run_dir} is in use by another run ({describe(holder, age)}); "
                    f"waited {self.wait_s:.0f} s (trainer.lock_wait_s). Stop that run, or train in "
                    f"another run dir (trainer.name / trainer.run_dir)")
            if not warned:
                log.warning("run dir %s is in use (%s): waiting up to %.0f s", self.run_dir,
                            describe(holder, age), self.wait_s)
                warned = True
            self.pause(self.poll_s)

    def _start(self, warning: Optional[str] = None) -> Optional[str]:
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
        self._beat.start()
        return warning

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Drop the lock if it is still ours (idempotent)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self._me is not None and self._read()[0] == self._me:
            os.unlink(self.path)
        self._me = None
