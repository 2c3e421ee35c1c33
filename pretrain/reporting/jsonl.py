"""``metrics.jsonl``: one JSON object per line, appended step by step.

A kill in the middle of an append leaves a torn last line; :func:`repair` cuts it off on resume
(with a warning) so the file stays readable, and :func:`read` names the file and line of
anything it cannot parse instead of failing with a bare ``JSONDecodeError``.
"""

from __future__ import annotations

import json
import os
from typing import Optional


class JsonlError(ValueError):
    """A line of a JSON-lines file that is not a JSON object."""


def _parse(raw: bytes, path: str, lineno: int) -> dict:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise JsonlError(f"{path}, line {lineno}: not a JSON record ({e.__class__.__name__}: {e}): "
                         f"{raw[:80]!r}") from None
    if not isinstance(rec, dict):
        raise JsonlError(f"{path}, line {lineno}: a JSON {type(rec).__name__}, not a record: {raw[:80]!r}")
    return rec


def read(path: str) -> list[dict]:
    """Every record of ``path`` in file order ([] when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        return [_parse(raw, path, i) for i, raw in enumerate(f, start=1) if raw.strip()]


def repair(path: str) -> Optional[str]:
    """Cut a torn last line (unparseable) off ``path``, or end a complete last record that lost
    its newline; returns a warning saying what was done, None when the file is whole. Damage before the last line is
    not a torn append: it raises :class:`JsonlError` naming the line."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        lines = f.readlines()
    keep = len(lines)
    while keep and not lines[keep - 1].strip():
        keep -= 1
    if keep == 0:
        return None
    last = lines[keep - 1]
    for i, raw in enumerate(lines[:keep - 1], start=1):
        if raw.strip():
            _parse(raw, path, i)
    try:
        _parse(last, path, keep)
    except JsonlError:
        size = sum(len(raw) for raw in lines[:keep - 1])
        with open(path, "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        return (f"{path}: cut a torn last record (line {keep}, {len(last)} bytes: {last[:60]!r}), "
                f"left by an interrupted write; {keep - 1} complete records kept")
    if not last.endswith(b"\n"):  # complete, only the newline was lost: later appends need it
        with open(path, "ab") as f:
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        return f"{path}: terminated the last record (line {keep}), whose newline an interrupted write lost"
    return None
