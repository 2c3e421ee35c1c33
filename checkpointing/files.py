"""A checkpoint on disk: ``<dir>/iter_<step:07d>/`` per save and a ``latest`` file naming the
newest. A save goes to ``iter_<step>.tmp``; after every rank finished, rank 0 writes
``manifest.json`` (every file's size) into it, fsyncs the files, renames the folder, fsyncs the
parent and replaces ``latest`` last, so a crash never leaves something that looks complete.
Resume scans the ``iter_*`` folders and takes the newest that verifies against its manifest;
``latest`` is only a hint. Also: ``checkpoint.init_from`` resolution, keep-last retention and the
one-line cause of a failed save (disk full, permissions).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from typing import Optional

import torch.distributed as dist

LATEST = "latest"
STAGE_FINAL = "STAGE_FINAL"  #: marker file in a stage's final checkpoint; retention keeps those
MANIFEST = "manifest.json"

log = logging.getLogger(__name__)


def iter_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"iter_{step:07d}")


def write_manifest(folder: str) -> None:
    """Record every file's size (relative path -> bytes), written last into the folder.
    Sizes, not hashes: truncation and missing files are what a crash or a partial copy leaves,
    and hashing a multi-terabyte checkpoint on every resume would cost minutes."""
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, folder)] = os.path.getsize(full)
    write_atomic(os.path.join(folder, MANIFEST), json.dumps({"files": files}, indent=0, sort_keys=True))


def verify(folder: str) -> Optional[str]:
    """None when ``folder`` holds every file of its manifest at the recorded size, else why not."""
    manifest = os.path.join(folder, MANIFEST)
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"no readable {MANIFEST} ({e.__class__.__name__})"
    if "metadata.json" not in files:
        return f"{MANIFEST} lists no metadata.json"
    for rel, size in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} has {os.path.getsize(path)} bytes, {size} expected"
    return None


def _iter_step(name: str) -> Optional[int]:
    m = re.fullmatch(r"iter_(\d+)", name)
    return int(m.group(1)) if m else None


def _read_hint(ckpt_dir: str) -> tuple[Optional[str], Optional[str]]:
    """The folder name ``latest`` gives, or why it gives none (empty, unreadable, not a name)."""
    pointer = os.path.join(ckpt_dir, LATEST)
    if not os.path.exists(pointer):
        return None, None
    try:
        with open(pointer, "rb") as f:
            text = f.read(256).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{pointer} is unreadable ({e.__class__.__name__})"
    if _iter_step(text) is None:
        return None, f"{pointer} holds {text[:40]!r}, not a checkpoint folder name"
    return text, None


def latest_checkpoint(ckpt_dir: str) -> Optional[str]:
    """The newest complete checkpoint folder, or None when there is none.

    Every ``iter_<step>`` folder is a candidate, newest step first, and the first that verifies
    against its manifest wins: a folder is renamed from ``.tmp`` only once complete, so it counts
    even when a crash came before ``latest`` named it. ``latest`` is a hint: when it is damaged,
    names a missing or incomplete folder, or disagrees with the scan, a warning says so. With
    folders present but none complete, the run refuses to start (it would train from scratch
    over them)."""
    if not os.path.isdir(ckpt_dir):
        return None
    hint, hint_problem = _read_hint(ckpt_dir)
    found = sorted((d for d in os.listdir(ckpt_dir) if _iter_step(d) is not None and
                    os.path.isdir(os.path.join(ckpt_dir, d))), key=_iter_step, reverse=True)
    problems = [hint_problem] if hint_problem else []
    for name in found:
        path = os.path.join(ckpt_dir, name)
        why = verify(path)
        if why is None:
            if hint is not None and hint != name:
                problems.append(f"{LATEST} names {hint}" + ("" if hint in found else ", which is missing"))
            problems += _partial_saves_after(ckpt_dir, _iter_step(name))
            if problems:
                _warn(f"resuming from {path}, the newest complete checkpoint: " + "; ".join(problems))
            return path
        problems.append(f"{name}: {why}")
    if not found:
        if hint is not None:
            raise NoCompleteCheckpoint(f"{os.path.join(ckpt_dir, LATEST)} names {hint}, but {ckpt_dir} holds no "
                                       f"checkpoint folder: restore it, or {START_ELSEWHERE}")
        return None
    raise NoCompleteCheckpoint(f"no complete checkpoint in {ckpt_dir} ({'; '.join(problems)}); refusing to "
                               f"start from scratch over them: move them away, or {START_ELSEWHERE}")


#: how to start a run that does not continue the checkpoints a run dir holds
START_ELSEWHERE = "start the run in another folder (trainer.name=NEW or trainer.run_dir=PATH)"


class NoCompleteCheckpoint(RuntimeError):
    """A run dir's checkpoints that a run could only overwrite (none is complete)."""


def holds_checkpoints(ckpt_dir: str) -> list[str]:
    """The iteration folders (complete or not, ``.tmp`` saves too) and ``latest`` in ``ckpt_dir``:
    what a run that does not continue them would train over."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(d for d in os.listdir(ckpt_dir)
                  if d == LATEST or _iter_step(d) is not None or _iter_step(d.removesuffix(".tmp")) is not None)


def partial_saves(ckpt_dir: str) -> list[str]:
    """``iter_<n>.tmp`` folders: saves not (yet) published -- in flight, or interrupted by a crash
    or kill (an async save's files were still being written)."""
    return sorted(d for d in os.listdir(ckpt_dir) if d.endswith(".tmp") and _iter_step(d[:-4]) is not None)


def _partial_saves_after(ckpt_dir: str, step: int) -> list[str]:
    """Warnings for the partial saves newer than ``step`` (resume never uses them; the next
    save removes them)."""
    return [f"{d} is an incomplete save (interrupted while being written), not used"
            for d in partial_saves(ckpt_dir) if _iter_step(d[:-4]) > step]


def resolve_init_from(path: str) -> tuple[Optional[str], Optional[str]]:
    """``checkpoint.init_from`` as a checkpoint folder: ``(folder, None)``, or ``(None, why not)``.

    A run dir or its ``checkpoints/`` folder stands for its newest complete checkpoint (found as
    resume finds it). A checkpoint folder is verified against its manifest when it has one (a
    run's), else its data files against the checkpoint's own metadata (an HF import), so a
    truncated or missing file is named here rather than failing inside the load. A folder that
    disappears while it is checked (the retention of the run that wrote it) is named as such."""
    field = f"checkpoint.init_from={path}"
    if not os.path.isdir(path):
        return None, f"{field}: {'no such folder' if not os.path.exists(path) else 'not a folder'}"
    try:
        folder, why = _resolve_init_from(path, field)
    except FileNotFoundError as e:  # a file went between listing and reading it
        folder, why = None, f"{field}: {e.filename} disappeared while this run checked it"
    if why is not None and not os.path.isdir(path):
        why = (f"{field}: {path} disappeared while this run checked it (deleted meanwhile, e.g. by "
               f"the checkpoint retention of the run that wrote it)")
    return folder, why


def _resolve_init_from(path: str, field: str) -> tuple[Optional[str], Optional[str]]:
    from checkpointing.dist_io import CheckpointFileError, check_files

    for ckpt_dir in (path, os.path.join(path, "checkpoints")):
        if os.path.isdir(ckpt_dir) and any(_iter_step(d) is not None for d in os.listdir(ckpt_dir)):
            try:
                newest = latest_checkpoint(ckpt_dir)
            except RuntimeError as e:
                return None, f"{field}: {e}"
            return newest, None
    if os.path.exists(os.path.join(path, MANIFEST)):
        why = verify(path)
        return (path, None) if why is None else (None, f"{field}: damaged checkpoint ({why})")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        return None, (f"{field} is not a checkpoint folder (no metadata.json); give an iter_* folder, "
                      f"a run's checkpoints/ folder or an HF import")
    try:
        check_files(path)
    except CheckpointFileError as e:
        return None, f"{field}: {e}"
    return path, None


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(message)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(os.path.dirname(os.path.abspath(path)))


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """File contents and directory entries of a tree, so a rename after it publishes data."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fsync(os.path.join(dirpath, name))
        fsync(dirpath)


class CheckpointSaveError(RuntimeError):
    """A save that could not complete; its partial folder is gone, earlier checkpoints intact."""


def _causes(e: BaseException):
    """``e`` and what it wraps: chained exceptions and torch's per-rank checkpoint failures."""
    seen, todo = set(), [e]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        todo += [cur.__cause__, cur.__context__]
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f
                     and isinstance(f[0], BaseException)]


def save_failure(final: str, tmp: str, e: BaseException) -> str:
    """One line naming the checkpoint, the cause (disk full, permission, ...) and the space left."""
    errno_cause = next((c for c in _causes(e) if isinstance(c, OSError) and c.errno), None)
    text = " ".join(str(c) for c in _causes(e))
    try:
        usage = shutil.disk_usage(os.path.dirname(final))
        space = f"; {usage.free / 2**30:.2f} GiB free of {usage.total / 2**30:.2f} GiB there"
    except OSError:
        usage, space = None, ""
    # torch's zip writer reports a short write as "unexpected pos"; a worker's ENOSPC may arrive
    # as text only; and a file system with less room than the last checkpoint took is full
    full = (errno_cause is not None and errno_cause.errno == errno.ENOSPC) or any(
        m in text for m in ("No space left on device", "file write failed", "unexpected pos")) or (
        usage is not None and usage.free < _last_checkpoint_bytes(os.path.dirname(final)))
    if full:
        cause = "no space left on device"
    elif errno_cause is not None:
        cause = f"{errno_cause.strerror or errno_cause}" + (f" ({errno_cause.filename})" if errno_cause.filename else "")
    else:
        cause = f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return (f"saving checkpoint {final} failed: {cause}{space}. The partial {os.path.basename(tmp)} "
            f"was removed; the previous checkpoints and {LATEST} are intact. Free space (or point "
            f"trainer.run_dir elsewhere) and rerun: the run resumes from its newest checkpoint")


def _last_checkpoint_bytes(ckpt_dir: str) -> int:
    """The size of the newest verified checkpoint (0 when there is none)."""
    try:
        path = latest_checkpoint(ckpt_dir)
        with open(os.path.join(path, MANIFEST)) as f:
            return sum(json.load(f)["files"].values())
    except Exception:  # noqa: BLE001 -- only a hint for the error message
        return 0


def apply_retention(ckpt_dir: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints and every stage's final one."""
    if keep_last <= 0:
        return
    done = sorted((d for d in os.listdir(ckpt_dir) if _iter_step(d) is not None), key=_iter_step)
    for old in done[:-keep_last]:
        if os.path.exists(os.path.join(ckpt_dir, old, STAGE_FINAL)):
            continue
        shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
