"""A preprocessed corpus is checked before use, never trusted.

``stats.json`` carries a manifest, written before the folder is renamed complete: every shard
file's size and a sha256 of each ``.idx`` (small: 12 bytes per document). :func:`verify` compares
the folder with it and with what megatron's own index reader implies: the ``.bin`` size from the
last sequence pointer and length, and the document and token counts of the shard's stats. It
reads the ``.idx`` files and only stats the ``.bin`` files, so it is cheap enough for every run.
A damaged folder is moved aside by :func:`set_aside` (renamed, never deleted).
"""

from __future__ import annotations

import json
import os

import numpy as np

from data_pipeline.fsutil import file_digest
from data_pipeline.readers import DataError
from data_pipeline.writer import MASK_SUFFIX

MANIFEST_VERSION = 1


class CorpusDamaged(DataError):
    """A preprocessed corpus folder does not match its manifest; names the files and problems."""


def shard_files(shard: dict) -> list[str]:
    """The files of one shard entry of ``stats.json`` (the loss-mask sidecar when it has one)."""
    suffixes = ("", MASK_SUFFIX) if shard["loss_mask"] else ("",)
    return [shard["prefix"] + s + e for s in suffixes for e in (".bin", ".idx")]


def manifest(folder: str, shards: list[dict]) -> dict:
    files = {}
    for shard in shards:
        for name in shard_files(shard):
            path = os.path.join(folder, name)
            files[name] = {"bytes": os.path.getsize(path)}
            if name.endswith(".idx"):
                files[name]["sha256"] = file_digest(path)
    return {"version": MANIFEST_VERSION, "files": files}


def verify(folder: str) -> list[str]:
    """Every problem found in a finished corpus folder, each naming its file; [] = intact."""
    stats_path = os.path.join(folder, "stats.json")
    try:
        with open(stats_path) as f:
            stats = json.load(f)
        shards, found = stats["shards"], stats.get("manifest")
        files = None if found is None else found["files"]
    except FileNotFoundError:
        return [f"{stats_path} is missing"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{stats_path} cannot be read ({type(e).__name__}: {e})"]
    if files is None:
        return [f"{stats_path} has no manifest (written by an older version of data_pipeline)"]
    if found.get("version") != MANIFEST_VERSION:
        return [f"{stats_path} has a manifest of version {found.get('version')}, this code reads {MANIFEST_VERSION}"]
    try:
        problems = [p for shard in shards for name in shard_files(shard)
                    for p in _check_file(folder, name, files.get(name))]
        if problems:  # an index is only parsed once it is known to be whole
            return problems
        return [p for shard in shards for p in _check_shard(folder, shard)]
    except (KeyError, TypeError, AttributeError) as e:
        return [f"{stats_path} is malformed ({type(e).__name__}: {e})"]


def _check_file(folder: str, name: str, entry: dict | None) -> list[str]:
    path = os.path.join(folder, name)
    if entry is None:
        return [f"{path} is not in the manifest of {os.path.join(folder, 'stats.json')}"]
    try:
        size = os.path.getsize(path)
    except OSError:
        return [f"{path} is missing"]
    if size != entry["bytes"]:
        return [f"{path} is {size} bytes, the manifest says {entry['bytes']}"]
    digest = file_digest(path) if "sha256" in entry else None
    if digest != entry.get("sha256"):
        return [f"{path} has sha256 {digest}, the manifest says {entry['sha256']}"]
    return []


def _read_index(path: str):
    """(sequence lengths, bytes the ``.bin`` must have) through megatron's own index reader."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    index = _IndexReader(path, multimodal=False)
    try:
        lengths = np.array(index.sequence_lengths, dtype=np.int64)
        end = int(index.sequence_pointers[-1]) + int(lengths[-1]) * index.dtype_size if len(lengths) else 0
        return lengths, end, index.document_count
    finally:
        del index


def _check_shard(folder: str, shard: dict) -> list[str]:
    problems, lengths_of = [], {}
    for suffix in ("", MASK_SUFFIX) if shard["loss_mask"] else ("",):
        prefix = os.path.join(folder, shard["prefix"] + suffix)
        try:
            lengths, end, documents = _read_index(prefix + ".idx")
        except Exception as e:  # noqa: BLE001  (megatron asserts or numpy raises on a bad index)
            problems.append(f"{prefix}.idx cannot be read by megatron ({type(e).__name__}: {e})")
            continue
        lengths_of[suffix] = lengths
        size = os.path.getsize(prefix + ".bin")
        if size != end:
            problems.append(f"{prefix}.bin is {size} bytes, its index {prefix}.idx implies {end}")
        if len(lengths) != shard["documents"] or documents != shard["documents"] + 1:
            problems.append(f"{prefix}.idx holds {len(lengths)} sequences in {documents - 1} documents, "
                            f"stats.json says {shard['documents']} documents")
        if int(lengths.sum()) != shard["tokens"]:
            problems.append(f"{prefix}.idx holds {int(lengths.sum())} tokens, stats.json says {shard['tokens']}")
    if len(lengths_of) == 2 and not np.array_equal(*lengths_of.values()):
        problems.append(f"{os.path.join(folder, shard['prefix'] + MASK_SUFFIX)}.idx: sequence lengths differ "
                        f"from {shard['prefix']}.idx")
    return problems


def set_aside(folder: str) -> str:
    """Rename a damaged folder to ``<folder>.damaged-<n>`` (first free n); call under its lock."""
    n = 0
    while os.path.exists(f"{folder}.damaged-{n}"):
        n += 1
    os.rename(folder, f"{folder}.damaged-{n}")
    return f"{folder}.damaged-{n}"
