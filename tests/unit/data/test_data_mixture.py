"""Runtime mixtures through megatron's BlendedMegatronDatasetBuilder: realised weights, determinism
and cached indices, disjoint train/valid documents, per-category token accounting, batches."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from data_pipeline.batches import micro_batches
from data_pipeline.build import CategoryTokens, build_datasets
from data_pipeline.config import DataConfigError
from data_pipeline.preprocess import prepare
from tests.support.data import corpus_cfg, default_data_cfg, write_jsonl

WEIGHTS = {"prose": 0.4, "code": 0.3, "math": 0.2, "agent": 0.1}


def test_realised_mixture_matches_weights(tmp_path):
    n = 10_000
    train, valid = build_datasets(default_data_cfg(mixtures={"default": WEIGHTS}), 128, 1234,
                                  str(tmp_path), 512, num_samples=n)
    counts = train.corpus_counts(0, n)
    assert sum(counts.values()) == n
    errors = {c: abs(counts[c] / n - w / sum(WEIGHTS.values())) for c, w in WEIGHTS.items()}
    print("mixture realisation error per corpus over 10k samples:", {c: round(e, 5) for c, e in errors.items()})
    assert max(errors.values()) < 0.02
    assert train.category_counts(0, n) == {"agent": counts["agent"], "code": counts["code"],
                                           "general": counts["prose"], "math": counts["math"]}
    # any prefix of the stream is mixed too, not just the whole
    head = train.corpus_counts(0, 1000)
    assert max(abs(head[c] / 1000 - w) for c, w in WEIGHTS.items()) < 0.02
    assert len(valid) >= 64


def test_another_mixture_changes_the_stream(tmp_path):
    cfg = default_data_cfg(mixture="long_context")
    train, _ = build_datasets(cfg, 128, 1234, str(tmp_path), 512, num_samples=2000)
    assert abs(train.corpus_counts(0, 2000)["agent"] / 2000 - 0.6) < 0.02


def test_samples_are_deterministic_and_indices_cached(tmp_path):
    cfg = default_data_cfg()
    a, _ = build_datasets(cfg, 128, 1234, str(tmp_path / "a"), 512, num_samples=256)
    b, _ = build_datasets(cfg, 128, 1234, str(tmp_path / "b"), 512, num_samples=256)
    index_dirs = os.listdir(tmp_path / "a" / "data_index")
    assert len(index_dirs) == 1 and os.path.exists(tmp_path / "a" / "data_index" / index_dirs[0] / ".complete")
    again, _ = build_datasets(cfg, 128, 1234, str(tmp_path / "a"), 512, num_samples=256)
    other_seed, _ = build_datasets(cfg, 128, 99, str(tmp_path / "a"), 512, num_samples=256)
    for i in range(0, 256, 16):
        assert all(torch.equal(a[i][k], b[i][k]) and torch.equal(a[i][k], again[i][k]) for k in a[i])
    assert sum(torch.equal(a[i]["tokens"], other_seed[i]["tokens"]) for i in range(32)) < 4
    assert len(os.listdir(tmp_path / "a" / "data_index")) == 2
    assert len(a) >= 256
    with pytest.raises(IndexError, match=f"sample {len(a) + 10} is outside the {len(a)} samples built for this run"):
        a[len(a) + 10]


def test_train_and_valid_use_disjoint_documents(tmp_path):
    train, valid = build_datasets(default_data_cfg(), 128, 1234, str(tmp_path), 512, num_samples=512)
    for t, v in zip(train.dataset.datasets, valid.dataset.datasets):
        assert t.dataset_path == v.dataset_path
        assert not set(np.asarray(t.indices).tolist()) & set(np.asarray(v.indices).tolist())
        assert len(t.indices) > 10 * len(v.indices) > 0


def test_category_tokens_add_up_and_resume_exactly(tmp_path):
    train, _ = build_datasets(default_data_cfg(), 128, 1234, str(tmp_path), 512, num_samples=16 * 10)
    straight = CategoryTokens(train, 128, 0)
    for step in range(1, 11):
        record = straight.update(16 * step)
        assert sum(record.values()) == 16 * step * 128
        if step == 5:
            resumed = CategoryTokens(train, 128, 16 * 5)
    for step in range(6, 11):
        resumed_record = resumed.update(16 * step)
    assert resumed_record == record and set(record) == {"tokens_agent", "tokens_code", "tokens_general", "tokens_math"}
    assert all(v > 0 for v in record.values())


def test_micro_batches_from_the_mixture(tmp_path):
    train, _ = build_datasets(default_data_cfg(), 128, 1234, str(tmp_path), 512, num_samples=64)
    batches = list(micro_batches(train, 16, 16, 4, dp_rank=1, dp_size=2))
    assert len(batches) == 2
    for b in batches:
        assert set(b) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
        assert all(v.shape == (4, 128) for v in b.values())
        assert b["tokens"].dtype == torch.int64 and b["loss_mask"].dtype == torch.float32
        assert int(b["tokens"].max()) < 512 and torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    assert torch.equal(batches[0]["tokens"][0], train[16 + 4]["tokens"])


def test_too_few_documents_for_the_split(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    cfg = corpus_cfg(tmp_path / "cache", [f], tasks=2)
    prepare(cfg)
    with pytest.raises(DataConfigError) as e:  # the two shards are read as one group
        build_datasets(cfg, 16, 1, str(tmp_path / "run"), 512, num_samples=8)
    assert "corpus 'c': shard_00000..shard_00001 has 10 documents, so data.split='98,2,0' leaves its valid " \
        "split empty" in str(e.value)
    cfg.max_group_documents = 0  # one megatron dataset per shard
    with pytest.raises(DataConfigError, match="corpus 'c': shard_00000 has 5 documents"):
        build_datasets(cfg, 16, 1, str(tmp_path / "run"), 512, num_samples=8)
    cfg.split = "1"
    train, valid = build_datasets(cfg, 16, 1, str(tmp_path / "run"), 512, num_samples=8)
    assert valid is None and len(train) >= 8
