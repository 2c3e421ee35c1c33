"""A preprocessed corpus, and a run's sample index, are checked before use, never trusted.

Both carry a manifest of content checksums, written last when they are complete: every file's
size, :data:`fsutil.ALGORITHM` digest (sha256) and stamp (size, mtime_ns, ctime_ns). A corpus's
is in ``stats.json`` (written before the folder is renamed complete; the digests are the shard
writers', taken as each shard was finished, or computed here); a sample index's is its
``.complete`` (:func:`index_manifest`, :func:`index_problems`). Before use (:func:`verify`,
:func:`index_problems`) every file is stat-ed and compared with its stamp; only a file whose stamp
changed is read whole again (several at once on a thread pool) and its digest compared: any
write to a file changes its ctime, which user space cannot set back, so an in-place overwrite of
the same size (a zeroed ``.bin`` or sample index) is re-hashed and caught, while an untouched
folder costs one stat per file. A corpus is also compared with what megatron's index reader
implies (a few bytes of each memory-mapped index): the ``.bin`` size from the last sequence
pointer and length, the document and token counts of the shard's stats; and once, when it is
written (``deep``), the loss-mask sidecar's lengths with the tokens' (an index holds ~20 bytes
per document, tens of GB at GLM-5 scale; its digest vouches for it afterwards). A corpus whose
files were re-hashed and found intact (a copied folder: new ctimes) gets the new stamps
recorded (``refresh``), so the next use stats only. A damaged corpus folder is moved aside by
:func:`set_aside` (renamed, never deleted).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from data_pipeline import fsutil
from data_pipeline.readers import DataError

#: 2: every shard file has a digest and a stamp; 1 (before) had a digest of each ``.idx`` only,
#: so a ``.bin`` overwritten in place at its size went unnoticed: such a corpus is re-prepared
MANIFEST_VERSION = 2
MASK_SUFFIX = "-lossmask"  #: a shard's loss-mask sidecar: ``<prefix><MASK_SUFFIX>.bin/.idx``
INDEX_MANIFEST_VERSION = 1  #: of a sample index's ``.complete`` (empty before: rebuilt)
log = logging.getLogger(__name__)


class CorpusDamaged(DataError):
    """A preprocessed corpus folder does not match its manifest; names the files and problems."""


def shard_files(shard: dict) -> list[str]:
    """The files of one shard entry of ``stats.json`` (the loss-mask sidecar when it has one)."""
    suffixes = ("", MASK_SUFFIX) if shard["loss_mask"] else ("",)
    return [shard["prefix"] + s + e for s in suffixes for e in (".bin", ".idx")]


def file_record(path: str) -> dict:
    """A file's manifest entry, digest taken now (the shard writer records it as it finishes a shard)."""
    [(digest, st)] = fsutil.content_digests([path]).values()
    if st is None:
        raise DataError(f"{path} changed while it was being hashed")
    return _entry(digest, st)


def _entry(digest: str, st: list[int]) -> dict:
    return {"bytes": st[0], fsutil.ALGORITHM: digest, "mtime_ns": st[1], "ctime_ns": st[2]}


def _stamp_of(entry: dict) -> list[int]:
    return [entry["bytes"], entry["mtime_ns"], entry["ctime_ns"]]


def records(folder: str, names: list[str], known: dict | None = None) -> dict:
    """``name -> entry`` for files of ``folder``: ``known`` entries whose file is unchanged since
    (same stamp) are kept, the others hashed now on a thread pool."""
    known = known or {}
    todo = [n for n in names if n not in known or _stamp_of(known[n]) != fsutil.stamp(os.path.join(folder, n))]
    hashed = fsutil.content_digests([os.path.join(folder, n) for n in todo])
    out = {}
    for n in names:
        if n not in todo:
            out[n] = known[n]
            continue
        digest, st = hashed[os.path.join(folder, n)]
        if st is None:
            raise DataError(f"{os.path.join(folder, n)} changed while it was being hashed")
        out[n] = _entry(digest, st)
    return out


def check_files(folder: str, files: dict, where: str) -> tuple[list[str], dict]:
    """``(problems, refreshed)`` of the files of a manifest (``name -> entry``; ``where``: the
    manifest's file, for the message). A file that is missing or of another size is a problem;
    one whose stamp changed is re-hashed (all such at once) and a problem if its digest differs,
    else its new entry is in ``refreshed``."""
    problems, changed = [], []
    for name, entry in files.items():
        path = os.path.join(folder, name)
        if entry is None:
            problems.append(f"{path} is not in the manifest of {where}")
            continue
        try:
            now = fsutil.stamp(path)
        except OSError:
            problems.append(f"{path} is missing")
            continue
        if now[0] != entry["bytes"]:
            problems.append(f"{path} is {now[0]} bytes, the manifest says {entry['bytes']}")
        elif now != _stamp_of(entry):
            changed.append(name)
    if problems:
        return problems, {}
    refreshed = {}
    for path, (digest, st) in fsutil.content_digests([os.path.join(folder, n) for n in changed]).items():
        name = os.path.relpath(path, folder)
        expected = files[name][fsutil.ALGORITHM]
        if digest != expected:
            problems.append(f"{path} has {fsutil.ALGORITHM} {digest}, the manifest says {expected}")
        elif st is not None:
            refreshed[name] = _entry(digest, st)
    return problems, refreshed


# --- corpora -----------------------------------------------------------------------------------


def manifest(folder: str, shards: list[dict]) -> dict:
    """The manifest of a corpus's shard files: the digests the shard writers recorded
    (``shard["files"]``) for files unchanged since, the others hashed here."""
    known = {n: e for shard in shards for n, e in (shard.get("files") or {}).items()}
    names = [n for shard in shards for n in shard_files(shard)]
    return {"version": MANIFEST_VERSION, "files": records(folder, names, known)}


def verify(folder: str, deep: bool = False, refresh: bool = False) -> list[str]:
    """Every problem found in a finished corpus folder, each naming its file; [] = intact.
    ``deep``: read every index whole even when unchanged since the manifest (a fresh build).
    ``refresh``: when intact, record the new stamps of files that were re-hashed (``stats.json``
    rewritten atomically; a read-only folder keeps re-hashing them, with a warning)."""
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
        older = " (no checksums of the .bin files)" if found.get("version") == 1 else ""
        return [f"{stats_path} has a manifest of version {found.get('version')}{older}, this code reads "
                f"{MANIFEST_VERSION}"]
    try:
        listed = {name: files.get(name) for shard in shards for name in shard_files(shard)}
        problems, refreshed = check_files(folder, listed, stats_path)
        if problems:  # an index is only parsed once it is known to be whole
            return problems
        # an index re-hashed and intact is the one checked whole when the manifest was written
        problems = [p for shard in shards for p in _check_shard(folder, shard, deep)]
    except (KeyError, TypeError, AttributeError) as e:
        return [f"{stats_path} is malformed ({type(e).__name__}: {e})"]
    if refresh and refreshed and not problems:
        files.update(refreshed)
        try:
            fsutil.write_json_atomic(stats_path, stats)
        except OSError as e:
            log.warning("%s: %d files re-hashed and intact, but their new stamps cannot be recorded (%s); "
                        "they are re-hashed at every use", folder, len(refreshed), e)
    return problems


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


# --- sample indices ----------------------------------------------------------------------------


def index_files(index_dir: str, complete: str) -> list[str]:
    """Every file under ``index_dir`` (relative paths) but its ``complete`` marker."""
    out = []
    for d, _, names in os.walk(index_dir):
        out += [os.path.relpath(os.path.join(d, n), index_dir) for n in names]
    return sorted(n for n in out if n != complete and not n.startswith(complete + ".tmp-"))


def index_manifest(index_dir: str, complete: str) -> dict:
    """The content of ``complete`` for a finished index folder: every file's entry, hashed now
    (megatron has just written them: they are mostly in the page cache)."""
    return {"version": INDEX_MANIFEST_VERSION, "files": records(index_dir, index_files(index_dir, complete))}


def index_problems(index_dir: str, complete: str, check: bool = True) -> list[str] | None:
    """None when ``index_dir`` is not complete (no ``complete`` marker), else every problem found,
    each naming its file ([] = intact). ``check``: compare the files with the manifest (a stat
    each; a re-hash of those whose stamp changed); else only read the manifest. Nothing is
    written: a copied index folder (new ctimes) is re-hashed at every check."""
    where = os.path.join(index_dir, complete)
    try:
        with open(where) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        return [f"{where} cannot be read ({type(e).__name__}: {e})"]
    if not text:
        return [f"{where} is empty (written by an older version of data_pipeline, before sample indices "
                "had checksums)"]
    try:
        found = json.loads(text)
    except ValueError as e:
        return [f"{where} cannot be read ({type(e).__name__}: {e})"]
    if not isinstance(found, dict) or found.get("version") != INDEX_MANIFEST_VERSION \
            or not isinstance(found.get("files"), dict):
        version = found.get("version") if isinstance(found, dict) else None
        return [f"{where} has a manifest of version {version}, this code reads {INDEX_MANIFEST_VERSION}"]
    if not check:
        return []
    try:
        return check_files(index_dir, found["files"], where)[0]
    except (KeyError, TypeError) as e:
        return [f"{where} is malformed ({type(e).__name__}: {e})"]
