"""What a training run calls: the blended train (and valid) datasets of the active mixture.

``build_train_dataset(data_cfg, seq_length, seed, run_dir, vocab_size, num_samples)``, called
once on every rank, before the model is built: rank 0 verifies each corpus and preprocesses
whatever is missing, stale or damaged (other ranks wait on the broadcast of its result, and raise
its error if it fails), then every rank builds megatron's
``BlendedMegatronDatasetBuilder`` over the corpora's shards with ``CorpusDataset``; the shard
weights are the corpus weight split by the shard's share of the corpus's tokens. Indices are
cached under ``<run_dir>/data_index/<key>/`` (``.complete`` written last). The result indexes
by global sample number and knows each sample's corpus and category
(:meth:`MixtureDataset.category_counts`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.config import DataConfig, DataConfigError, active_weights, split_vector


class MixtureDataset(torch.utils.data.Dataset):
    """Blended samples (dicts of [seq_length] tensors) + which corpus each came from."""

    def __init__(self, dataset, corpus_of_dataset: list[str], categories: dict[str, str]):
        self.dataset = dataset
        self.corpus_of_dataset = corpus_of_dataset
        self.categories = sorted(set(categories[c] for c in corpus_of_dataset))
        self._category_of_dataset = np.array([self.categories.index(categories[c]) for c in corpus_of_dataset])
        self._corpora = sorted(set(corpus_of_dataset))
        self._corpus_of_dataset = np.array([self._corpora.index(c) for c in corpus_of_dataset])

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} is outside the {len(self)} samples built for this run")
        sample = self.dataset[idx]
        sample.pop("dataset_id", None)
        return sample

    def dataset_ids(self, start: int, stop: int) -> np.ndarray:
        index = getattr(self.dataset, "dataset_index", None)
        if index is None:  # a single shard: megatron returns the shard's dataset itself
            return np.zeros(max(0, min(stop, len(self)) - start), dtype=np.int64)
        return np.asarray(index[start:stop], dtype=np.int64)

    def category_counts(self, start: int, stop: int) -> dict[str, int]:
        """Samples per category among global samples [start, stop)."""
        counts = np.bincount(self._category_of_dataset[self.dataset_ids(start, stop)],
                             minlength=len(self.categories))
        return {c: int(n) for c, n in zip(self.categories, counts)}

    def corpus_counts(self, start: int, stop: int) -> dict[str, int]:
        counts = np.bincount(self._corpus_of_dataset[self.dataset_ids(start, stop)], minlength=len(self._corpora))
        return {c: int(n) for c, n in zip(self._corpora, counts)}


class CategoryTokens:
    """Cumulative consumed tokens per category (``tokens_<category>``) as the run advances; exact
    after a resume because it restarts from the sample position."""

    def __init__(self, dataset: MixtureDataset, seq_length: int, consumed_samples: int, start: int = 0):
        """Counts samples ``start .. consumed_samples - 1`` (``start``: where this run's use of
        the dataset began, e.g. a curriculum stage continuing an earlier stage's data stream)."""
        self.dataset, self.seq_length = dataset, seq_length
        self.position = consumed_samples
        self.samples = dataset.category_counts(start, consumed_samples)

    def update(self, consumed_samples: int) -> dict[str, int]:
        for c, n in self.dataset.category_counts(self.position, consumed_samples).items():
            self.samples[c] += n
        self.position = consumed_samples
        return {f"tokens_{c}": n * self.seq_length for c, n in self.samples.items()}


def _prepared(cfg: DataConfig) -> dict:
    """Rank 0 preprocesses; the others get its outputs (or its error) by broadcast."""
    from data_pipeline.preprocess import prepare

    if not (dist.is_available() and dist.is_initialized()):
        return prepare(cfg)
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [prepare(cfg)]
        except Exception as e:  # every rank must leave the broadcast, then all raise
            try:
                pickle.dumps(e)
                box = [e]
            except Exception:  # noqa: BLE001
                box = [RuntimeError(f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


@contextlib.contextmanager
def _process_group():
    """megatron's ``BlendedDataset`` asks torch.distributed for the rank when it builds cached
    indices; outside a distributed run, a one-process gloo group exists for the duration."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _check_splits(outputs: dict, split: str) -> None:
    """megatron splits each shard's documents by ``split``; an empty share would loop forever."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    vec = split_vector(split)
    matrix = convert_split_vector_to_split_matrix([v / sum(vec) for v in vec])
    for name, out in outputs.items():
        for prefix, shard in zip(out.prefixes, out.stats["shards"]):
            n = shard["documents"]
            for which, bounds in zip(("train", "valid", "test"), matrix):
                if bounds is not None and int(round(bounds[1] * n)) - int(round(bounds[0] * n)) < 1:
                    raise DataConfigError(
                        f"corpus {name!r}: shard {os.path.basename(prefix)} has {n} documents, so "
                        f"data.split={split!r} leaves its {which} split empty; use fewer "
                        f"data.preprocess.tasks or a split without that share")


def build_datasets(cfg: DataConfig, seq_length: int, seed: int, run_dir: str, vocab_size: int,
                   num_samples: int, valid_samples: int | None = None):
    """(train, valid) ``MixtureDataset``s; valid is None when the split has no valid share."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from data_pipeline import tokenizer
    from data_pipeline.fsutil import file_digest, fingerprint
    from data_pipeline.gpt_corpus import CorpusDataset, CorpusDatasetConfig, TokenizerInfo

    outputs = _prepared(cfg)  # the config was validated before any compute (pretrain.validation)
    _check_splits(outputs, cfg.split)
    weights = active_weights(cfg)
    prefixes, shard_weights, owners, layouts = [], [], [], {}
    for name, w in weights.items():
        out = outputs[name]
        total = sum(out.shard_tokens)
        for prefix, tokens in zip(out.prefixes, out.shard_tokens):
            prefixes.append(prefix)
            shard_weights.append(w * tokens / total)
            owners.append(name)
            layouts[prefix] = cfg.corpora[name].packing
    tok_path = tokenizer.resolve(cfg)
    info = TokenizerInfo(tok_path, cfg.tokenizer.eod_token, cfg.tokenizer.pad_token, file_digest(tok_path))
    if info.vocab_size > vocab_size:  # the tokenizer file actually prepared, not the config's
        raise DataConfigError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
                              f"({info.vocab_size}, {tok_path})")
    has_valid = split_vector(cfg.split)[1] > 0
    valid_n = (cfg.valid_samples if valid_samples is None else valid_samples) if has_valid else None
    key = fingerprint([prefixes, shard_weights, layouts, seq_length, seed, num_samples, valid_n, cfg.split,
                       cfg.eod_mask_loss, info.unique_identifiers])
    index_dir = os.path.join(os.path.abspath(run_dir), "data_index", key)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and not os.path.exists(os.path.join(index_dir, ".complete")):
        shutil.rmtree(index_dir, ignore_errors=True)  # a killed build may have left partial indices
    config = CorpusDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, shard_weights), split=cfg.split,
        path_to_cache=index_dir, tokenizer=info,
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=False, packing=layouts, mid_level_dataset_surplus=0.02,
    )
    with _process_group():
        train, valid, _ = BlendedMegatronDatasetBuilder(
            CorpusDataset, [num_samples, valid_n or 0, 0], lambda: True, config).build()
    if rank0:  # megatron builds and saves everything on rank 0 before the other ranks load
        os.makedirs(index_dir, exist_ok=True)
        open(os.path.join(index_dir, ".complete"), "w").close()
    categories = {n: cfg.corpora[n].category for n in weights}
    return (MixtureDataset(train, owners, categories),
            MixtureDataset(valid, owners, categories) if valid is not None else None)


def build_train_dataset(cfg: DataConfig, seq_length: int, seed: int, run_dir: str, vocab_size: int,
                        num_samples: int) -> MixtureDataset:
    return build_datasets(cfg, seq_length, seed, run_dir, vocab_size, num_samples)[0]
