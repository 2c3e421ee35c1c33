"""Long-context packing and per-sample document structure.

Packing: whole documents go into sequences of ``capacity`` tokens by best-fit decreasing (each
document into the open sequence with the least room that still fits it); a document longer than
``capacity`` is cut into full ``capacity`` chunks plus a remainder, and nothing else is ever
split. Each chunk counts as its own document (it cannot attend to the previous chunk).

Document structure of one sample: ``document_ids`` [s] numbers the documents of a sample 0, 1,
... in order (padding gets its own id). Everything the attention needs follows from it:
:func:`position_ids` (restart at 0 per document), :func:`attention_mask` (megatron convention,
True = masked: causal and same-document only), :func:`cu_seqlens` / :func:`packed_seq_params`
(THD varlen attention over the flattened micro-batch).
"""

from __future__ import annotations

import numpy as np
import torch


def split_long(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Items (doc, offset, length) with every length <= capacity; docs keep their order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    chunks = (lengths + capacity - 1) // capacity
    doc = np.repeat(np.arange(len(lengths)), chunks)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    k = np.arange(len(doc)) - first
    offset = k * capacity
    length = np.minimum(lengths[doc] - offset, capacity)
    return doc, offset, length


def best_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Bin id per item (bins numbered as opened), best-fit decreasing, ties by item order.

    Free room is tracked per bin in a segment tree over room sizes 0..capacity, so each item
    costs O(log capacity): the smallest room >= length is found by a tree descent."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"item lengths must be in [1, {capacity}]")
    size = 1 << int(capacity).bit_length()
    tree = [0] * (2 * size)
    rooms: dict[int, list[int]] = {}
    bin_of = np.empty(len(lengths), dtype=np.int64)
    n_bins = 0

    def add(r: int, delta: int) -> None:
        i = r + size
        while i:
            tree[i] += delta
            i >>= 1

    def smallest_at_least(need: int) -> int:
        i = need + size
        if tree[i]:
            return need
        while i > 1:
            if not i & 1 and tree[i + 1]:
                i += 1
                break
            i >>= 1
        else:
            return -1
        while i < size:
            i = 2 * i if tree[2 * i] else 2 * i + 1
        return i - size

    for item in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[item])
        room = smallest_at_least(need)
        if room < 0:
            b, room = n_bins, capacity
            n_bins += 1
        else:
            b = rooms[room].pop()
            add(room, -1)
        bin_of[item] = b
        left = room - need
        if left:
            rooms.setdefault(left, []).append(b)
            add(left, 1)
    return bin_of


def pack(doc_lengths: np.ndarray, capacity: int, seed: int) -> dict:
    """Packed layout of documents ``0..n-1``: items (``doc``, ``offset``, ``length``) listed
    bin by bin, ``bin_offsets`` [n_bins + 1] into them. Items are considered in a seeded order
    so equal lengths do not keep corpus order."""
    doc, offset, length = split_long(doc_lengths, capacity)
    order = np.random.RandomState(seed).permutation(len(doc))
    doc, offset, length = doc[order], offset[order], length[order]
    bins = best_fit(length, capacity)
    by_bin = np.argsort(bins, kind="stable")
    counts = np.bincount(bins, minlength=int(bins.max()) + 1 if len(bins) else 0)
    return {"doc": doc[by_bin], "offset": offset[by_bin], "length": length[by_bin],
            "bin_offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)}


def utilisation(layout: dict, capacity: int) -> float:
    """Non-padding tokens / all tokens of the packed sequences."""
    n_bins = len(layout["bin_offsets"]) - 1
    return float(layout["length"].sum()) / (n_bins * capacity) if n_bins else 0.0


# --- per-sample document structure -------------------------------------------------------------


def document_ids_from_lengths(lengths: list[int], total: int) -> np.ndarray:
    """[total] ids: part i's tokens get i, trailing padding gets len(lengths)."""
    ids = np.full(total, len(lengths), dtype=np.int64)
    ids[: sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
    return ids


def position_ids(document_ids: np.ndarray) -> np.ndarray:
    """Position within the document, per token ([..., s] -> [..., s])."""
    d = np.asarray(document_ids)
    idx = np.broadcast_to(np.arange(d.shape[-1]), d.shape)
    new = np.ones(d.shape, dtype=bool)
    new[..., 1:] = d[..., 1:] != d[..., :-1]
    starts = np.maximum.accumulate(np.where(new, idx, 0), axis=-1)
    return idx - starts


def attention_mask(document_ids_bs: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True = masked: a query sees earlier keys of its own document only."""
    d = document_ids_bs
    s = d.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=d.device).tril()
    same = d[:, :, None] == d[:, None, :]
    return ~(same & causal)[:, None]


def cu_seqlens(document_ids_bs: torch.Tensor) -> torch.Tensor:
    """int32 [n_docs + 1] document boundaries over the flattened [b * s] tokens (a document
    never continues across samples)."""
    d = document_ids_bs
    b, s = d.shape
    new = torch.ones_like(d, dtype=torch.bool)
    new[:, 1:] = d[:, 1:] != d[:, :-1]
    starts = torch.nonzero(new.reshape(-1)).flatten()
    return torch.cat([starts, torch.tensor([b * s], device=d.device)]).to(torch.int32)


def packed_seq_params(document_ids_bs: torch.Tensor):
    """megatron ``PackedSeqParams`` (THD) for the micro-batch's documents."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens(document_ids_bs)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
