"""What a training run calls: the blended train (and valid) datasets of the active mixture.

``build_datasets(data_cfg, seq_length, seed, run_dir, vocab_size, num_samples, valid_samples)``,
called once on every rank, before the model is built: rank 0 verifies each corpus and preprocesses
whatever is missing, stale or damaged (other ranks wait on the broadcast of its result, and raise
its error if it fails), then every rank builds megatron's ``BlendedMegatronDatasetBuilder`` with
``CorpusDataset`` over the corpora's shard groups (:mod:`data_pipeline.blend`: consecutive shards
read as one dataset; weights = corpus weight x the group's share of the corpus's tokens). Indices
are cached under ``<run_dir>/data_index/<key>/`` (``.complete``, written last, holds the checksum
of every file of it: :func:`data_pipeline.integrity.index_problems`; :func:`plan_index` names the
folder without building, and a training launch finds everything there already:
``python -m data_pipeline.prepare`` or its own rank 0 built it first). Rank 0 checks the folder
before megatron loads it (a stat per file; a file changed since, e.g. a zeroed
``dataset_sample_index.npy``, is re-hashed): a damaged index is removed and rebuilt, with a
warning naming the file and both checksums -- it is derived from the corpora, so rebuilding is
safe, and using it would train on other samples. The result indexes
by global sample number and knows each sample's corpus and category
(:meth:`MixtureDataset.category_counts`); the validation blend is sized so that every category of
the mixture has its share of held-out samples (:meth:`MixtureDataset.stratified`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.config import DataConfig, DataConfigError, active_weights, split_vector

COMPLETE = ".complete"  #: written last into an index folder by the build that finished it: its manifest
log = logging.getLogger(__name__)


class MixtureDataset(torch.utils.data.Dataset):
    """Blended samples (dicts of [seq_length] tensors) + which corpus each came from.
    ``weights``: corpus -> mixture weight (gives each category's share, :attr:`category_shares`)."""

    def __init__(self, dataset, corpus_of_dataset: list[str], categories: dict[str, str],
                 weights: dict[str, float] | None = None):
        self.dataset = dataset
        self.corpus_of_dataset = corpus_of_dataset
        self.categories = sorted(set(categories[c] for c in corpus_of_dataset))
        self._category_of_dataset = np.array([self.categories.index(categories[c]) for c in corpus_of_dataset])
        self._corpora = sorted(set(corpus_of_dataset))
        self._corpus_of_dataset = np.array([self._corpora.index(c) for c in corpus_of_dataset])
        self.category_shares = category_shares(corpus_of_dataset, categories, weights)
        self._stratified: dict = {}

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

    def stratified(self, total: int) -> tuple[list[int], list[int]]:
        """``total`` sample numbers, split as evenly as possible over :attr:`categories` (the
        first ones get the remainder), each category's the first of it in the blend's order that
        have loss tokens (then, if too few, the first without); and the category (index into
        :attr:`categories`) of each. Deterministic: the same set at every evaluation and after a
        resume; computed once per ``total``."""
        cats = self._category_of_dataset[self.dataset_ids(0, len(self))]
        k = len(self.categories)
        if total < k:
            raise DataConfigError(f"{total} validation samples cannot hold one of each of the {k} categories "
                                  f"{self.categories} (trainer.eval_samples / data.valid_samples)")
        if total in self._stratified:
            return self._stratified[total]
        indices, labels = [], []
        for c in range(k):
            want = total // k + (c < total % k)
            found = np.flatnonzero(cats == c)
            if len(found) < want:
                raise DataConfigError(f"the validation blend has {len(found)} samples of category "
                                      f"{self.categories[c]!r}, {want} are needed")
            with_loss, without = [], []  # a sample whose targets are all masked teaches nothing
            for i in found.tolist():
                (with_loss if float(self[i]["loss_mask"].sum()) > 0 else without).append(i)
                if len(with_loss) == want:
                    break
            indices += (with_loss + without)[:want]
            labels += [c] * want
        self._stratified[total] = indices, labels
        return indices, labels


def category_shares(corpora, categories: dict[str, str], weights: dict[str, float] | None) -> dict[str, float]:
    """Each category's share of the mixture's weight (equal shares of the corpora without weights)."""
    corpora = sorted(set(corpora))
    weights = weights or {c: 1.0 for c in corpora}
    total = sum(weights[c] for c in corpora)
    return {k: sum(weights[c] for c in corpora if categories[c] == k) / total
            for k in sorted(set(categories[c] for c in corpora))}


def valid_blend_size(per_category: int, shares: dict[str, float], datasets: dict[str, int]) -> int:
    """Samples a blend must have for each category to get ``per_category`` of them: megatron's
    blending keeps every dataset within about one sample of its weight x position, so a
    category of ``share`` over ``n`` datasets has at least ``share x size - 2 n``."""
    return max(int(np.ceil((per_category + 2 * datasets[c]) / share)) for c, share in shares.items())


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


def build_datasets(cfg: DataConfig, seq_length: int, seed: int, run_dir: str, vocab_size: int,
                   num_samples: int, valid_samples: int | None = None):
    """(train, valid) ``MixtureDataset``s; valid is None when the split has no valid share.
    ``valid_samples`` (default ``data.valid_samples``): held-out samples the caller will take
    with :meth:`MixtureDataset.stratified`."""
    outputs = _prepared(cfg)  # the config was validated before any compute (pretrain.config.validation)
    return build_mixture(cfg, outputs, seq_length, seed, run_dir, vocab_size, num_samples, valid_samples)


@dataclass
class IndexPlan:
    """What :func:`build_mixture` builds, decided before anything is: where its indices live."""

    index_dir: str  #: ``<run_dir>/data_index/<key>``; complete once it holds ``.complete``
    blend: object  #: data_pipeline.blend.Blend
    info: object  #: data_pipeline.gpt_corpus.TokenizerInfo
    valid_n: int | None
    categories: dict
    weights: dict

    @property
    def complete(self) -> bool:
        return index_complete(self.index_dir)


def index_complete(index_dir: str) -> bool:
    """Whether megatron's builder only loads from ``index_dir`` (a finished build's manifest is
    there; its files are not compared: :func:`index_problems`)."""
    return index_problems(index_dir, check=False) == []


def index_problems(index_dir: str, check: bool = True) -> list[str] | None:
    """None: ``index_dir`` is not complete; else what differs from its manifest ([] = intact;
    ``check=False``: only whether the manifest is one this code reads)."""
    from data_pipeline.integrity import index_problems as problems

    return problems(index_dir, COMPLETE, check)


def plan_index(cfg: DataConfig, outputs: dict, seq_length: int, seed: int, run_dir: str, vocab_size: int,
               num_samples: int, valid_samples: int | None = None, tok_path: str | None = None) -> IndexPlan:
    """The blend and index folder :func:`build_mixture` uses, from the file system alone (nothing
    is written); ``tok_path``: the tokenizer file (default: :func:`tokenizer.resolve`, which
    trains the default BPE when missing). Raises the blend's data errors."""
    from data_pipeline import tokenizer
    from data_pipeline.blend import check_splits, plan_blend
    from data_pipeline.fsutil import file_digest, fingerprint
    from data_pipeline.gpt_corpus import TokenizerInfo

    weights = active_weights(cfg)
    tok_path = tok_path or tokenizer.resolve(cfg)
    digest = file_digest(tok_path)
    blend = plan_blend(cfg, outputs, weights, digest)
    check_splits(blend, cfg.split)
    info = TokenizerInfo(tok_path, cfg.tokenizer.eod_token, cfg.tokenizer.pad_token, digest)
    if info.vocab_size > vocab_size:  # the tokenizer file actually prepared, not the config's
        raise DataConfigError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
                              f"({info.vocab_size}, {tok_path})")
    categories = {n: cfg.corpora[n].category for n in weights}
    valid_n = None
    if split_vector(cfg.split)[1] > 0:
        wanted = cfg.valid_samples if valid_samples is None else valid_samples
        shares = category_shares(blend.owners, categories, weights)
        per_category = 4 * -(-wanted // len(shares))  # room to skip samples without loss tokens
        datasets = {k: sum(categories[o] == k for o in blend.owners) for k in shares}
        valid_n = max(wanted, valid_blend_size(per_category, shares, datasets))
    key = fingerprint([blend.paths, blend.weights, blend.layouts, seq_length, seed, num_samples, valid_n,
                       cfg.split, cfg.eod_mask_loss, info.unique_identifiers])
    index_dir = os.path.join(os.path.abspath(run_dir), "data_index", key)
    return IndexPlan(index_dir, blend, info, valid_n, categories, weights)


def build_mixture(cfg: DataConfig, outputs: dict, seq_length: int, seed: int, run_dir: str, vocab_size: int,
                  num_samples: int, valid_samples: int | None = None):
    """:func:`build_datasets` from finished corpus outputs (``preprocess.CorpusOutput`` by name).
    Without a process group (one process building ahead of a run: ``python -m
    data_pipeline.prepare``, a one-node run before its ranks start) the run's index folders are
    built under an inter-process lock (``<run_dir>/.locks/``), so two such builders make each once."""
    from data_pipeline.fsutil import file_lock

    plan = plan_index(cfg, outputs, seq_length, seed, run_dir, vocab_size, num_samples, valid_samples)
    lock = contextlib.nullcontext() if dist.is_initialized() else file_lock(os.path.dirname(plan.index_dir))
    with lock:
        return _build_mixture(cfg, plan, seq_length, seed, num_samples)


def _build_mixture(cfg: DataConfig, plan: IndexPlan, seq_length: int, seed: int, num_samples: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from data_pipeline.gpt_corpus import CorpusDataset, CorpusDatasetConfig

    index_dir, blend, info, valid_n = plan.index_dir, plan.blend, plan.info, plan.valid_n
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    problems = index_problems(index_dir) if rank0 else []  # megatron's builder: rank 0 first, then the others
    if problems:
        log.warning("sample index %s is damaged (%s); removed and rebuilt", index_dir,
                    "; ".join(p.replace(index_dir + os.sep, "") for p in problems))
    built = problems != []  # else megatron's builder only loads
    if rank0 and built:
        shutil.rmtree(index_dir, ignore_errors=True)  # a killed build may have left partial indices
    config = CorpusDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(blend.paths, blend.weights), split=cfg.split,
        path_to_cache=index_dir, tokenizer=info,
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=False, packing=blend.layouts, groups=blend.groups, mid_level_dataset_surplus=0.02,
        num_dataset_builder_threads=cfg.index_threads,
    )
    with _process_group():
        train, valid, _ = BlendedMegatronDatasetBuilder(
            CorpusDataset, [num_samples, valid_n or 0, 0], lambda: True, config).build()
    if rank0 and built:  # megatron builds and saves everything on rank 0 before the other ranks load
        from data_pipeline.fsutil import write_json_atomic
        from data_pipeline.integrity import index_manifest

        os.makedirs(index_dir, exist_ok=True)
        write_json_atomic(os.path.join(index_dir, COMPLETE), index_manifest(index_dir, COMPLETE))
    out = [MixtureDataset(d, blend.owners, plan.categories, plan.weights) if d is not None else None
           for d in (train, valid)]
    for d, n in zip(out, (num_samples, valid_n)):
        if d is not None:
            d.requested = n  #: the size asked of megatron's builder (it builds a few more)
    return tuple(out)


def build_train_dataset(cfg: DataConfig, seq_length: int, seed: int, run_dir: str, vocab_size: int,
                        num_samples: int) -> MixtureDataset:
    return build_datasets(cfg, seq_length, seed, run_dir, vocab_size, num_samples)[0]
