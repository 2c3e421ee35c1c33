"""The installed Python standard library's source files: text every machine with this Python
has (PSF license). Shared by the code, prose and agent sample generators."""

from __future__ import annotations

import os
import sysconfig
from functools import lru_cache

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3",
             "ensurepip", "turtledemo", "pydoc_data", "encodings", "config-3.11-x86_64-linux-gnu"}
MAX_FILE_BYTES = 150_000


@lru_cache(maxsize=1)
def stdlib_files() -> tuple:
    """(relative path, absolute path) of the stdlib's .py files, sorted, small enough to use."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and 200 <= os.path.getsize(path) <= MAX_FILE_BYTES:
                out.append((os.path.relpath(path, root), path))
    return tuple(sorted(out))


def read_source(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")
