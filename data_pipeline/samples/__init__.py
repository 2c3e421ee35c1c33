"""Sample corpora generated deterministically at first use from what every machine has: the
installed Python's standard library and reference topics (code, prose), generated math problems
with checked solutions, and tool-using agent episodes with real tool outputs. Nothing is
downloaded; the repo ships only these generators.

``materialize(kind, cache_dir, seed)`` writes ``<cache_dir>/samples/<kind>-<fingerprint>/`` once
(built in a temp folder, renamed when complete; concurrent callers wait on a lock)."""

from __future__ import annotations

import os
import sys

from data_pipeline.fsutil import building_dir, file_lock, fingerprint

#: bump a kind's version when its generator changes output
VERSIONS = {"prose": 1, "code": 1, "math": 1, "agent": 1}


def sample_dir(kind: str, cache_dir: str, seed: int) -> str:
    key = fingerprint({"kind": kind, "version": VERSIONS[kind], "seed": seed,
                       "python": sys.version.split()[0]})
    return os.path.join(os.path.abspath(cache_dir), "samples", f"{kind}-{key}")


def materialize(kind: str, cache_dir: str, seed: int) -> list[str]:
    """The sample corpus's files, generating them if missing."""
    final = sample_dir(kind, cache_dir, seed)
    if not os.path.isdir(final):
        with file_lock(final):
            if not os.path.isdir(final):
                with building_dir(final) as tmp:
                    _generator(kind)(os.path.join(tmp, "part-00000.jsonl"), seed)
    return sorted(os.path.join(final, f) for f in os.listdir(final) if f.endswith(".jsonl"))


def _generator(kind: str):
    if kind == "prose":
        from data_pipeline.samples.prose import generate
    elif kind == "code":
        from data_pipeline.samples.code import generate
    elif kind == "math":
        from data_pipeline.samples.math import generate
    elif kind == "agent":
        from data_pipeline.samples.agent import generate
    else:
        raise ValueError(f"unknown sample corpus {kind!r}")
    return generate
