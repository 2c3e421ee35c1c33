"""Shard groups (issue 16): a corpus's shards read as a few megatron datasets give exactly the
samples of megatron's own builder over the same shards merged by megatron's own
``IndexedDatasetBuilder.add_index`` (token ids, in order, train and valid), for megatron's
GPTDataset and for best-fit packed trajectories; a rebuild from the cached indices (a restart,
another rank) gives the same sample at every position without concatenating the shards' lengths."""

from __future__ import annotations

import numpy as np
import torch

from data_pipeline.build import _process_group, build_mixture
from data_pipeline.groups import ShardGroup, group_bounds
from tests.support.data import SHARD_DOCS, data_cfg, write_corpus

def merged(outputs: dict, blend_groups: dict, folder) -> dict:
    """Each multi-shard group merged into one .bin/.idx by megatron's own builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    folder.mkdir()
    out = {}
    for k, (group, (prefixes, _)) in enumerate(sorted(blend_groups.items())):
        target = str(folder / f"merged_{k}")
        builder = IndexedDatasetBuilder(target + ".bin", dtype=np.uint16)
        for p in prefixes:
            builder.add_index(p)
        builder.finalize(target + ".idx")
        out[group] = target
    return out


def reference(cls, train_ds, valid_ds, paths_of: dict, cfg, n_train, n_valid, cache, packing=None):
    """megatron's builder (``cls``) over the merged files, with the run's weights and settings."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    first = train_ds.dataset.datasets[0]
    c = first.config
    paths = [paths_of.get(d.dataset_path, d.dataset_path) for d in train_ds.dataset.datasets]
    kwargs = {} if packing is None else {"packing": {paths_of.get(k, k): v for k, v in packing.items()}}
    config = type(c)(random_seed=c.random_seed, sequence_length=c.sequence_length,
                     blend=(paths, list(train_ds.dataset.weights)), split=cfg.split, path_to_cache=str(cache),
                     tokenizer=c.tokenizer, reset_position_ids=True, reset_attention_mask=True,
                     eod_mask_loss=True, create_attention_mask=False, mid_level_dataset_surplus=0.02, **kwargs)
    with _process_group():
        return BlendedMegatronDatasetBuilder(cls, [n_train, n_valid, 0], lambda: True, config).build()[:2]


def _build(tmp_path, cfg, outputs, run="run", n=400):
    return build_mixture(cfg, outputs, 64, 1234, str(tmp_path / run), 512, num_samples=n, valid_samples=8)


def test_group_bounds():
    assert group_bounds([50, 60, 40], 120) == [(0, 2), (2, 3)]
    assert group_bounds([50, 60, 40], 0) == [(0, 1), (1, 2), (2, 3)]
    assert group_bounds([200, 10, 10], 100) == [(0, 1), (1, 3)]
    assert group_bounds([], 100) == []


def test_grouped_samples_equal_megatron_over_merged_shards(tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDataset

    outputs = {n: write_corpus(tmp_path / "corpora", n, d, seed=i) for i, (n, d) in enumerate(SHARD_DOCS.items())}
    cfg = data_cfg(limit=120)
    train, valid = _build(tmp_path, cfg, outputs)
    datasets = train.dataset.datasets
    assert [type(d.dataset).__name__ for d in datasets] == ["ShardGroup", "IndexedDataset", "ShardGroup"]
    assert [len(d.dataset) for d in datasets] == [110, 40, 120]  # a: 50+60 | 40; b: all four
    paths_of = merged(outputs, train.dataset.datasets[0].config.groups, tmp_path / "merged")
    ref_train, ref_valid = reference(GPTDataset, train, valid, paths_of, cfg, 400, valid.requested, tmp_path / "ref")
    assert len(ref_train) == len(train) >= 400 and len(ref_valid) == len(valid) > 0
    for ours, ref in ((train, ref_train), (valid, ref_valid)):
        for i in range(len(ours)):
            mine, theirs = ours[i], ref[i]
            assert torch.equal(mine["tokens"], theirs["tokens"]) and torch.equal(mine["labels"], theirs["labels"]), i
    # one dataset per shard (megatron's per-shard blend) is another, equally valid, stream
    per_shard, _ = build_mixture(data_cfg(limit=0), outputs, 64, 1234, str(tmp_path / "run0"), 512,
                                 num_samples=400, valid_samples=8)
    assert len(per_shard.dataset.datasets) == 7
    assert sum(torch.equal(per_shard[i]["tokens"], train[i]["tokens"]) for i in range(50)) < 5


def test_grouped_best_fit_equals_packing_the_merged_file_and_resumes_exactly(tmp_path):
    from data_pipeline.gpt_corpus import CorpusDataset

    outputs = {n: write_corpus(tmp_path / "corpora", n, d, seed=i, max_len=150)
               for i, (n, d) in enumerate(SHARD_DOCS.items())}
    cfg = data_cfg(limit=120, packing_b="best_fit")
    train, valid = _build(tmp_path, cfg, outputs)
    b_group = train.dataset.datasets[-1]
    assert b_group.layout == "best_fit" and isinstance(b_group.dataset, ShardGroup)
    paths_of = merged(outputs, b_group.config.groups, tmp_path / "merged")
    ref_train, _ = reference(CorpusDataset, train, valid, paths_of, cfg, 400, valid.requested, tmp_path / "ref",
                             packing=b_group.config.packing)
    keys = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")
    for i in range(len(train)):
        assert all(torch.equal(train[i][k], ref_train[i][k]) for k in keys), i
    # a restart (or another rank) loads the cached indices: same sample at every position, and
    # no concatenated lengths (only the building rank needs them)
    again, _ = _build(tmp_path, cfg, outputs)
    for i in (0, 1, 7, 199, len(train) - 1):
        assert all(torch.equal(train[i][k], again[i][k]) for k in keys), i
    assert [d.dataset._lengths is None for d in again.dataset.datasets if isinstance(d.dataset, ShardGroup)] \
        == [True, True]
    assert np.array_equal(again.dataset_ids(0, len(again)), train.dataset_ids(0, len(train)))


def test_samples_stay_the_same_when_few_shards_may_be_open(tmp_path, monkeypatch):
    from data_pipeline import groups

    outputs = {n: write_corpus(tmp_path / "corpora", n, d, seed=i) for i, (n, d) in enumerate(SHARD_DOCS.items())}
    train, _ = _build(tmp_path, data_cfg(limit=1000), outputs)
    before = [train[i]["tokens"] for i in range(60)]
    monkeypatch.setattr(groups, "_budget", [2])
    groups._open.clear()
    assert all(torch.equal(train[i]["tokens"], t) for i, t in enumerate(before))
    assert len(groups._open) == 2
