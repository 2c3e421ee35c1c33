"""Shared setup for the data-pipeline tests: the default data config (the run's own samples,
tokenizer and indexed outputs, built once per machine in the shared data cache) and small
synthetic corpora in temp folders tokenised with that tokenizer."""

from __future__ import annotations

import json
import os
from functools import lru_cache

import numpy as np

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data_pipeline.config import CorpusConfig, DataConfig, PreprocessConfig, TokenizerConfig
from data_pipeline.preprocess import CorpusOutput

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def default_data_cfg(**overrides) -> DataConfig:
    """conf/data/samples.yaml as the run composes it (cache dir made absolute)."""
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf", "data"), version_base=None):
        node = compose("samples")
    cfg: DataConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), node))
    cfg.cache_dir = os.path.join(REPO, cfg.cache_dir) if not os.path.isabs(cfg.cache_dir) else cfg.cache_dir
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@lru_cache(maxsize=1)
def sample_outputs() -> dict:
    """The default mixture's preprocessed corpora (built on first use)."""
    from data_pipeline.preprocess import prepare

    return prepare(default_data_cfg())


@lru_cache(maxsize=1)
def tokenizer_path() -> str:
    from data_pipeline import tokenizer

    return tokenizer.resolve(default_data_cfg())


def corpus_cfg(cache_dir: str, paths: list, workers: int = 1, tasks: int = 0, **corpus) -> DataConfig:
    """One corpus ``c`` over ``paths``, the sample tokenizer, its own cache."""
    return DataConfig(
        cache_dir=str(cache_dir),
        corpora={"c": CorpusConfig(paths=[str(p) for p in paths], **corpus)},
        mixtures={"default": {"c": 1.0}},
        tokenizer=TokenizerConfig(path=tokenizer_path()),
        preprocess=PreprocessConfig(workers=workers, tasks=tasks),
    )


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def read_docs(prefixes: list) -> list:
    """Every document of the shards, in order, as token lists."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = []
    for p in prefixes:
        ds = IndexedDataset(p)
        docs.extend(ds[i].tolist() for i in range(len(ds)))
    return docs


def expected_tokens(texts: list) -> list:
    """What preprocessing must store per document: the sample tokenizer's ids, EOD appended."""
    from data_pipeline.tokenizer import load

    tok = load(tokenizer_path())
    eod = tok.token_to_id("<|endoftext|>")
    return [tok.encode(t, add_special_tokens=False).ids + [eod] for t in texts]


# --- shard groups: corpora written shard by shard with megatron's builder ----------------------

SHARD_DOCS = {"a": [50, 60, 40], "b": [30, 35, 25, 30]}


def write_corpus(folder, name: str, docs_per_shard: list, seed: int, max_len: int = 90) -> CorpusOutput:
    """Shards of random documents (token ids < 500, eod-free) written by megatron's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.RandomState(seed)
    path = folder / name
    path.mkdir(parents=True)
    prefixes, tokens, shards = [], [], []
    for k, n in enumerate(docs_per_shard):
        prefix = str(path / f"shard_{k:05d}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        lengths = rng.randint(3, max_len, size=n)
        for length in lengths:
            builder.add_document(rng.randint(0, 500, size=length).astype(np.uint16), [int(length)])
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
        tokens.append(int(lengths.sum()))
        shards.append({"prefix": f"shard_{k:05d}", "documents": n, "tokens": tokens[-1], "loss_mask": False})
    return CorpusOutput(name, str(path), prefixes, tokens, False, {"shards": shards})


def data_cfg(limit: int, packing_b: str = "concat") -> DataConfig:
    return DataConfig(
        corpora={"a": CorpusConfig(category="general", paths=["unused"]),
                 "b": CorpusConfig(category="code", paths=["unused"], packing=packing_b)},
        mixtures={"default": {"a": 0.6, "b": 0.4}}, split="90,10,0", max_group_documents=limit,
        tokenizer=TokenizerConfig(path=tokenizer_path()))
