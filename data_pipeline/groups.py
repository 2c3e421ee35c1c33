"""A corpus's shards read as a few large megatron datasets ("shard groups").

Preprocessing writes one indexed shard per task (1,000 per corpus in ``glm5_corpus``) because
that is how tokenisation parallelises. Blending them one megatron dataset per shard costs
megatron's ``build_blending_indices`` O(samples x datasets): ~6 h for the 18T-token stage over
7,000 shards (``benchmarks/data_scale.py``). A :class:`ShardGroup` presents consecutive shards of
one corpus as one low-level dataset, exactly as if megatron's own ``IndexedDatasetBuilder.add_index``
had merged them into one ``.bin/.idx`` (documents in shard order), without copying a byte: the
samples equal those of megatron's builder over the merged files (``tests/unit/data/test_data_groups.py``).
A group holds at most ``data.max_group_documents`` documents: megatron's document ids are int32.

Shards are opened on first read and kept in one process-wide LRU sized by
:func:`open_file_budget` (a megatron ``IndexedDataset`` holds 3 file descriptors: 8,000 shards
open at once need a ``ulimit -n`` above 24,000, as megatron's per-shard blend does). A rank that
loads cached indices never concatenates the sequence lengths (:attr:`ShardGroup.sequence_lengths`
is built once, on the rank that builds, from the indexes).
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np


def open_file_budget() -> int:
    """Shards this process may keep open: the open-file limit (the soft one raised to the hard
    one) less 1,024 for everything else, 3 descriptors per shard."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return max(64, (min(soft, 1 << 20) - 1024) // 3)


_open: OrderedDict = OrderedDict()  #: prefix -> IndexedDataset, least recently read first
_budget: list = []  #: [open_file_budget()], set at the first open
_lock = threading.Lock()


def open_shard(prefix: str, documents: int):
    """megatron's ``IndexedDataset`` of ``prefix`` from the LRU (opened and checked on a miss)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    with _lock:  # megatron builds datasets in threads (data.index_threads)
        shard = _open.get(prefix)
        if shard is not None:
            _open.move_to_end(prefix)
            return shard
        shard = IndexedDataset(prefix)
        if len(shard) != documents:
            raise ValueError(f"{prefix}.idx holds {len(shard)} documents, its corpus's stats.json says {documents}")
        _open[prefix] = shard
        if not _budget:
            _budget.append(open_file_budget())
        while len(_open) > _budget[0]:  # the least recently read closes (reopening one: ~0.1 ms)
            _open.popitem(last=False)
        return shard


def group_bounds(documents: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive ``[first, stop)`` shard ranges of at most ``limit`` documents each (a shard
    larger than ``limit`` alone); ``limit`` 0: one range per shard."""
    bounds, start, held = [], 0, 0
    for i, n in enumerate(documents):
        if i > start and (limit <= 0 or held + n > limit):
            bounds.append((start, i))
            start, held = i, 0
        held += n
    if len(documents):
        bounds.append((start, len(documents)))
    return bounds


def group_name(prefixes: Sequence[str]) -> str:
    """The path that names a group in megatron's blend and cache keys: ``<folder>/<first>..<last>``
    (a single shard keeps its own prefix)."""
    if len(prefixes) == 1:
        return prefixes[0]
    return os.path.join(os.path.dirname(prefixes[0]),
                        f"{os.path.basename(prefixes[0])}..{os.path.basename(prefixes[-1])}")


class ShardGroup:
    """The documents of ``prefixes`` (megatron indexed datasets, one sequence per document) in
    order, with the part of ``IndexedDataset``'s interface megatron's GPT datasets use."""

    def __init__(self, prefixes: Sequence[str], documents: Sequence[int], suffix: str = ""):
        self.prefixes = [p + suffix for p in prefixes]
        self.path_prefix = group_name(self.prefixes)
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(documents, dtype=np.int64))])
        self._lengths: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, idx: int) -> tuple:
        if not 0 <= idx < len(self):
            raise IndexError(f"document {idx} is outside the {len(self)} documents of {self.path_prefix}")
        s = int(np.searchsorted(self.starts, idx, side="right")) - 1
        return open_shard(self.prefixes[s], int(self.starts[s + 1] - self.starts[s])), idx - int(self.starts[s])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        shard, local = self._locate(int(idx))
        return shard.get(local, offset=offset, length=length)

    def length(self, idx: int) -> int:
        """Tokens of document ``idx`` (without concatenating every length)."""
        shard, local = self._locate(int(idx))
        return int(shard.sequence_lengths[local])

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 [documents]: every shard's lengths, concatenated once (the building rank), read
        through megatron's index reader without keeping the shards open."""
        from megatron.core.datasets.indexed_dataset import _IndexReader

        if self._lengths is None:
            out = np.empty(len(self), dtype=np.int32)
            for s, prefix in enumerate(self.prefixes):
                index = _IndexReader(prefix + ".idx", multimodal=False)
                expected = int(self.starts[s + 1] - self.starts[s])
                if len(index.sequence_lengths) != expected:
                    raise ValueError(f"{prefix}.idx holds {len(index.sequence_lengths)} documents, its "
                                     f"corpus's stats.json says {expected}")
                out[self.starts[s]:self.starts[s + 1]] = index.sequence_lengths
                del index
            self._lengths = out
        return self._lengths
