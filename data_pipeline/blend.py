"""The megatron blend of a mixture: which datasets, with which weights, after checking the shards.

Each corpus of the active mixture contributes its shard groups (:mod:`data_pipeline.groups`);
a group's weight is the corpus weight split by the group's share of the corpus's tokens. Before
anything is built, the shards are checked against each other and the run: one token dtype (read
from each ``.idx`` header) and one tokenizer (recorded by the writer) per corpus, the run's
tokenizer, tokens in every weighted corpus, documents in every split.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from data_pipeline.config import DataConfig, DataConfigError, split_vector
from data_pipeline.groups import group_bounds, group_name

_INDEX_HEADER = b"MMIDIDX\x00\x00"


@dataclass
class Blend:
    """megatron's ``blend`` plus what the run needs to know about each dataset."""

    paths: list = field(default_factory=list)  #: dataset paths (a shard prefix or a group name)
    weights: list = field(default_factory=list)
    owners: list = field(default_factory=list)  #: corpus of each dataset
    documents: list = field(default_factory=list)  #: documents of each dataset
    layouts: dict = field(default_factory=dict)  #: path -> concat | best_fit
    groups: dict = field(default_factory=dict)  #: group name -> (shard prefixes, documents per shard)


def index_dtype(idx_path: str) -> str:
    """The token dtype an ``.idx`` declares (its header: 9-byte magic, version, dtype code)."""
    from megatron.core.datasets.indexed_dataset import DType

    with open(idx_path, "rb") as f:
        head = f.read(18)
    if len(head) < 18 or head[:9] != _INDEX_HEADER:
        raise DataConfigError(f"{idx_path} is not a megatron index (no MMIDIDX header)")
    return DType.dtype_from_code(struct.unpack("<B", head[17:18])[0]).__name__


def check_shards(name: str, out, weight: float, mixture: str, tokenizer_digest: str) -> None:
    """A weighted corpus must hold tokens, and its shards one dtype and the run's tokenizer."""
    where = f"data.mixtures.{mixture}.{name}={weight}"
    if not out.prefixes or sum(out.shard_tokens) == 0:
        raise DataConfigError(f"{where}: corpus {name!r} is empty ({os.path.join(out.path, 'stats.json')} "
                              "lists no tokens); give it weight 0 or fix its inputs")
    first_dtype = None
    for prefix, shard in zip(out.prefixes, out.stats["shards"]):
        dtype = index_dtype(prefix + ".idx")
        if first_dtype is None:
            first_dtype = (prefix, dtype)
        elif dtype != first_dtype[1]:
            raise DataConfigError(f"corpus {name!r}: {prefix}.idx stores {dtype} tokens but {first_dtype[0]}.idx "
                                  f"stores {first_dtype[1]}: its shards were not written with one tokenizer")
        recorded = shard.get("tokenizer")
        if recorded is not None and recorded != tokenizer_digest:
            raise DataConfigError(f"corpus {name!r}: {prefix}.idx was tokenised by a tokenizer with digest "
                                  f"{recorded}, this run's tokenizer has {tokenizer_digest} "
                                  "(data.tokenizer.path changed: preprocess the corpus again)")


def plan_blend(cfg: DataConfig, outputs: dict, weights: dict, tokenizer_digest: str) -> Blend:
    """The mixture's datasets: each corpus's shards in groups of at most
    ``data.max_group_documents`` documents, weighted by tokens."""
    blend = Blend()
    for name, w in weights.items():
        out = outputs[name]
        check_shards(name, out, w, cfg.mixture, tokenizer_digest)
        docs = [int(s["documents"]) for s in out.stats["shards"]]
        total = sum(out.shard_tokens)
        for a, b in group_bounds(docs, cfg.max_group_documents):
            prefixes = out.prefixes[a:b]
            path = group_name(prefixes)
            if b - a > 1:
                blend.groups[path] = (list(prefixes), docs[a:b])
            blend.paths.append(path)
            blend.weights.append(w * sum(out.shard_tokens[a:b]) / total)
            blend.owners.append(name)
            blend.documents.append(sum(docs[a:b]))
            blend.layouts[path] = cfg.corpora[name].packing
    return blend


def check_splits(blend: Blend, split: str) -> None:
    """megatron splits each dataset's documents by ``split``; an empty share would loop forever."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    vec = split_vector(split)
    matrix = convert_split_vector_to_split_matrix([v / sum(vec) for v in vec])
    for owner, path, n in zip(blend.owners, blend.paths, blend.documents):
        for which, bounds in zip(("train", "valid", "test"), matrix):
            if bounds is not None and int(round(bounds[1] * n)) - int(round(bounds[0] * n)) < 1:
                raise DataConfigError(
                    f"corpus {owner!r}: {os.path.basename(path)} has {n} documents, so "
                    f"data.split={split!r} leaves its {which} split empty; use fewer "
                    f"data.preprocess.tasks or a split without that share")
