"""Outputs that never look complete before they are: build in a temp folder, rename when done;
an inter-process lock so concurrent runs sharing a cache build each artifact once; content
checksums of written files (:func:`content_digests`: whole files, several at once on a thread
pool) and the stat stamp (:func:`stamp`) that says when one must be computed again."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

ALGORITHM = "sha256"  #: of content checksums: hashlib's fastest here (benchmarks/hashing.py: SHA-NI)
BLOCK = 1 << 22  #: bytes read per hash update


def fingerprint(obj) -> str:
    """Stable 16-hex digest of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def stamp(path: str) -> list[int]:
    """``[bytes, mtime_ns, ctime_ns]``: any write to the file changes it (ctime cannot be set
    back from user space, so neither ``touch -d`` nor a copy with preserved times hides one)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def content_digest(path: str) -> str:
    """The :data:`ALGORITHM` hex digest of the whole file."""
    h = hashlib.new(ALGORITHM)
    with open(path, "rb", buffering=0) as f:
        view = memoryview(bytearray(max(1, min(BLOCK, os.fstat(f.fileno()).st_size))))  # small files: no 4 MiB
        while True:
            n = f.readinto(view)
            if not n:
                return h.hexdigest()
            h.update(view[:n])


def content_digests(paths: list[str]) -> dict[str, tuple[str, list[int] | None]]:
    """``path -> (digest, stamp)`` for each file, hashed on a thread pool (one thread per core;
    hashlib and reads release the GIL). The stamp is the file's, taken before and after hashing,
    or None when the file changed meanwhile (the digest then describes no one state of it)."""
    def one(path):
        before = stamp(path)
        digest = content_digest(path)
        return digest, before if stamp(path) == before else None

    if len(paths) <= 1:
        return {p: one(p) for p in paths}
    with ThreadPoolExecutor(min(len(paths), len(os.sched_getaffinity(0)))) as pool:
        return dict(zip(paths, pool.map(one, paths)))


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
