"""A preprocessed corpus is checked before use, never trusted.

``stats.json`` carries a manifest, written before the folder is renamed complete: every shard
file's size, and a sha256 and mtime of each ``.idx``. :func:`verify` compares the folder with it
and with what megatron's own index reader implies: the ``.bin`` size from the last sequence
pointer and length (every run: a stat and a few bytes of the memory-mapped index) and, when an
``.idx`` changed since the manifest was written (another mtime), its sha256, the document and
token counts of the shard's stats and the loss-mask sidecar's lengths. At GLM-5 scale an index
holds ~20 bytes per document (tens of GB): it is read whole only when it may have changed.
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
            st = os.stat(path)
            files[name] = {"bytes": st.st_size}
            if name.endswith(".idx"):
                files[name].update(sha256=file_digest(path), mtime_ns=st.st_mtime_ns)
    return {"version": MANIFEST_VERSION, "files": files}


def verify(folder: str, deep: bool = False) -> list[str]:
    """Every problem found in a finished corpus folder, each naming its file; [] = intact.
    ``deep``: read every index whole even when unchanged since the manifest (a fresh build)."""
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
        return [p for shard in shards for p in _check_shard(folder, shard, deep or _changed(folder, shard, files))]
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
    if "sha256" in entry and os.stat(path).st_mtime_ns != entry.get("mtime_ns"):
        digest = file_digest(path)
        if digest != entry["sha256"]:
            return [f"{path} has sha256 {digest}, the manifest says {entry['sha256']}"]
    return []


def _changed(folder: str, shard: dict, files: dict) -> bool:
    """Whether an index of ``shard`` may differ from when the manifest was written."""
    return any(os.stat(os.path.join(folder, n)).st_mtime_ns != files[n].get("mtime_ns")
               for n in shard_files(shard) if n.endswith(".idx"))


def _read_index(path: str, deep: bool):
    """(bytes the ``.bin`` must have, tokens, sequences, documents, sequence lengths or None)
    through megatron's own index reader. Sequences are stored back to back, so the last pointer
    and length give the ``.bin`` size and the token count; the lengths are read whole (a copy:
    the reader unmaps them when it goes) only when ``deep``."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    index = _IndexReader(path, multimodal=False)
    n = len(index.sequence_lengths)
    end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size if n else 0
    lengths = np.array(index.sequence_lengths, dtype=np.int64) if deep else None
    return end, end // index.dtype_size, n, index.document_count, lengths


def _check_shard(folder: str, shard: dict, deep: bool) -> list[str]:
    """The shard's files against its stats and each other; ``deep`` also compares the loss-mask
    sidecar's sequence lengths with the tokens' (reading both indexes whole)."""
    problems, lengths_of = [], {}
    for suffix in ("", MASK_SUFFIX) if shard["loss_mask"] else ("",):
        prefix = os.path.join(folder, shard["prefix"] + suffix)
        try:
            end, tokens, sequences, documents, lengths = _read_index(prefix + ".idx", deep)
        except Exception as e:  # noqa: BLE001  (megatron asserts or numpy raises on a bad index)
            problems.append(f"{prefix}.idx cannot be read by megatron ({type(e).__name__}: {e})")
            continue
        size = os.path.getsize(prefix + ".bin")
        if size != end:
            problems.append(f"{prefix}.bin is {size} bytes, its index {prefix}.idx implies {end}")
        if sequences != shard["documents"] or documents != shard["documents"] + 1:
            problems.append(f"{prefix}.idx holds {sequences} sequences in {documents - 1} documents, "
                            f"stats.json says {shard['documents']} documents")
        if tokens != shard["tokens"]:
            problems.append(f"{prefix}.idx holds {tokens} tokens, stats.json says {shard['tokens']}")
        if deep:
            lengths_of[suffix] = lengths
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
