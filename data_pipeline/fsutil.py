"""Outputs that never look complete before they are: build in a temp folder, rename when done;
an inter-process lock so concurrent runs sharing a cache build each artifact once."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile


def fingerprint(obj) -> str:
    """Stable 16-hex digest of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


@contextlib.contextmanager
def file_lock(artifact: str):
    """Exclusive inter-process lock for building ``artifact``; blocks until held. The lock file
    lives in a ``.locks/`` folder beside it (never mistaken for output)."""
    path = os.path.join(os.path.dirname(os.path.abspath(artifact)), ".locks", os.path.basename(artifact) + ".lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def building_dir(final: str):
    """Yield a fresh temp folder beside ``final``; on success it is renamed to ``final``, on any
    error it is removed. ``final`` must not exist yet."""
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".partial-", dir=parent)
    try:
        yield tmp
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
