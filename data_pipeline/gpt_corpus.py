"""megatron's ``GPTDataset`` over one indexed shard, in either of two layouts:

- ``concat``: megatron's own windows across the shuffled document stream (its cached document /
  sample / shuffle indices, unchanged);
- ``best_fit``: whole documents packed into sequences (:mod:`data_pipeline.packing`), the layout
  cached beside megatron's indices and reshuffled per epoch.

Both return the same sample dict: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
``document_ids`` (each [seq_length]). Positions restart per document; ``loss_mask`` is 0 on
padding, on targets in the next document (``eod_mask_loss``) and where the shard's loss-mask
sidecar says so (tool results / template tokens of trajectories).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from data_pipeline import packing
from data_pipeline.groups import ShardGroup
from data_pipeline.tokenizer import load
from data_pipeline.integrity import MASK_SUFFIX

PACKING_VERSION = 1


class TokenizerInfo(MegatronTokenizerBase):
    """What megatron's datasets need from a tokenizer (vocab size, eod, pad) over a
    ``tokenizers.Tokenizer``; its ``unique_identifiers`` key the cached dataset indices."""

    def __init__(self, path: str, eod_token: str, pad_token: str, digest: str):
        tok = load(path)
        eod = tok.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"data.tokenizer.eod_token={eod_token!r} is not a token of {path}")
        pad = tok.token_to_id(pad_token)
        super().__init__(path, {})
        self.tok = tok
        self._eod = eod
        self.fill = eod if pad is None else pad  #: id written at padding positions (loss masked)
        self.unique_identifiers = {"tokenizer": path, "digest": digest, "eod": eod, "fill": self.fill}

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self):
        return self.tok.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("trajectories are rendered by data_pipeline.chat")


@dataclass
class CorpusDatasetConfig(GPTDatasetConfig):
    packing: Dict[str, str] = field(default_factory=dict)  #: dataset path -> concat | best_fit
    #: group name (:func:`data_pipeline.groups.group_name`) -> (shard prefixes, documents per shard);
    #: the name encodes the shards, so it is no part of the cache key
    groups: Dict[str, Tuple[List[str], List[int]]] = field(default_factory=dict)


class CorpusDataset(GPTDataset):
    def __init__(self, indexed_dataset, dataset_path: Optional[str],
                 indexed_indices: numpy.ndarray, num_samples: Optional[int], index_split, config):
        self.layout = config.packing.get(dataset_path, "concat")
        self.packed = None
        self.loss_masks = self._loss_masks(dataset_path, config)
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)

    @staticmethod
    def _loss_masks(dataset_path: Optional[str], config):
        """The loss-mask sidecar over the same documents, or None."""
        if dataset_path in config.groups:
            prefixes, documents = config.groups[dataset_path]
            has = os.path.exists(prefixes[0] + MASK_SUFFIX + ".idx")
            return ShardGroup(prefixes, documents, suffix=MASK_SUFFIX) if has else None
        mask_prefix = (dataset_path or "") + MASK_SUFFIX
        return IndexedDataset(mask_prefix) if os.path.exists(mask_prefix + ".idx") else None

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config):
        if dataset_path in config.groups:
            return ShardGroup(*config.groups[dataset_path])
        return GPTDataset.build_low_level_dataset(dataset_path, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return GPTDataset._key_config_attributes() + ["packing", "eod_mask_loss", "add_extra_token_to_sequence"]

    def _length(self, doc: int) -> int:
        if isinstance(self.dataset, ShardGroup):
            return self.dataset.length(doc)
        return int(self.dataset.sequence_lengths[doc])

    # --- indices -----------------------------------------------------------------------------

    def _build_document_sample_shuffle_indices(self):
        if self.layout == "concat":
            return super()._build_document_sample_shuffle_indices()
        capacity = self.config.sequence_length + self.config.add_extra_token_to_sequence
        base = os.path.join(self.config.path_to_cache,
                            f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}")
        names = ("doc", "offset", "length", "bin_offsets", "shuffle")
        paths = {k: f"{base}-packed{PACKING_VERSION}-{k}.npy" for k in names}
        if all(os.path.isfile(p) for p in paths.values()):
            arrays = {k: numpy.load(p, mmap_mode="r") for k, p in paths.items()}
        else:
            docs = numpy.asarray(self.indices)
            layout = packing.pack(self.dataset.sequence_lengths[docs], capacity, self.config.random_seed)
            layout["doc"] = docs[layout["doc"]]
            n_bins = len(layout["bin_offsets"]) - 1
            if n_bins == 0:
                raise ValueError(f"{self.dataset_path}: the {self.index_split.name} split has no documents")
            epochs = 1 if self.num_samples is None else max(1, -(-self.num_samples // n_bins))
            rng = numpy.random.RandomState(self.config.random_seed)
            layout["shuffle"] = numpy.concatenate([rng.permutation(n_bins) for _ in range(epochs)])
            os.makedirs(self.config.path_to_cache, exist_ok=True)
            for k, p in paths.items():
                tmp = f"{p}.tmp-{os.getpid()}.npy"
                numpy.save(tmp, layout[k])
                os.replace(tmp, p)
            arrays = layout
        self.packed = arrays
        return None, None, arrays["shuffle"]

    def __len__(self) -> int:
        if self.layout == "concat":
            return super().__len__()
        return len(self.shuffle_index)

    # --- samples -----------------------------------------------------------------------------

    def _parts(self, idx: int) -> list[tuple[int, int, int]]:
        """(document, offset, length) pieces of sample ``idx``; each piece is one document."""
        if self.layout != "concat":
            b = int(self.shuffle_index[idx])
            p, lo, hi = self.packed, int(self.packed["bin_offsets"][b]), int(self.packed["bin_offsets"][b + 1])
            return [(int(p["doc"][i]), int(p["offset"][i]), int(p["length"][i])) for i in range(lo, hi)]
        i = self.shuffle_index[idx]
        beg, beg_off = self.sample_index[i]
        end, end_off = self.sample_index[i + 1]
        extra = self.config.add_extra_token_to_sequence
        parts = []
        for j in range(int(beg), int(end) + 1):
            doc = int(self.document_index[j])
            off = int(beg_off) if j == beg else 0
            stop = int(end_off) + extra if j == end else self._length(doc)
            if stop > off:
                parts.append((doc, off, stop - off))
        return parts

    def __getitem__(self, idx) -> dict:
        total = self.config.sequence_length + self.config.add_extra_token_to_sequence
        parts = self._parts(0 if idx is None else int(idx))
        lengths = [n for _, _, n in parts]
        used = sum(lengths)
        text = numpy.full(total, self.config.tokenizer.fill, dtype=numpy.int64)
        keep = numpy.zeros(total, dtype=numpy.float32)
        pos = 0
        for doc, off, n in parts:
            text[pos : pos + n] = self.dataset.get(doc, offset=off, length=n)
            keep[pos : pos + n] = 1.0 if self.loss_masks is None else self.loss_masks.get(doc, offset=off, length=n)
            pos += n
        doc_ids = packing.document_ids_from_lengths(lengths, total)
        loss_mask = keep[1:].copy()
        if self.config.eod_mask_loss:
            loss_mask[doc_ids[1:] != doc_ids[:-1]] = 0.0
        if idx is None:
            loss_mask[:] = 0.0
        assert used <= total
        return {
            "tokens": torch.from_numpy(text[:-1]),
            "labels": torch.from_numpy(text[1:]),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(packing.position_ids(doc_ids[:-1])),
            "document_ids": torch.from_numpy(doc_ids[:-1].copy()),
        }
