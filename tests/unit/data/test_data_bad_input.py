"""Bad data input is an error before any index or model is built, naming the file (issue 16):
shards of one corpus with different token dtypes or tokenizers, a tokenizer other than the run's,
a weighted corpus that is empty (no documents in its inputs, or no tokens in its stats), an index
whose documents disagree with its corpus's stats."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data_pipeline.build import build_datasets, build_mixture
from data_pipeline.config import DataConfigError
from data_pipeline.fsutil import file_digest
from data_pipeline.preprocess import prepare
from data_pipeline.readers import DataError
from tests.support.data import SHARD_DOCS, corpus_cfg, data_cfg, tokenizer_path, write_corpus, write_jsonl


def _outputs(tmp_path):
    return {n: write_corpus(tmp_path / "corpora", n, d, seed=i) for i, (n, d) in enumerate(SHARD_DOCS.items())}


def _build(tmp_path, outputs, cfg=None):
    return build_mixture(cfg or data_cfg(limit=120), outputs, 64, 1, str(tmp_path / "run"), 512, num_samples=64)


def test_shards_with_another_dtype_or_tokenizer_are_named(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    outputs = _outputs(tmp_path)
    odd = outputs["b"].prefixes[2]
    builder = IndexedDatasetBuilder(odd + ".bin", dtype=np.int32)  # rewritten with a 32-bit vocabulary
    for _ in range(SHARD_DOCS["b"][2]):
        builder.add_document(np.arange(5, dtype=np.int32), [5])
    builder.finalize(odd + ".idx")
    with pytest.raises(DataConfigError) as e:
        _build(tmp_path, outputs)
    assert str(e.value) == (f"corpus 'b': {odd}.idx stores int32 tokens but {outputs['b'].prefixes[0]}.idx stores "
                            "uint16: its shards were not written with one tokenizer")
    assert not os.path.exists(tmp_path / "run")  # nothing built

    outputs = _outputs(tmp_path / "again")
    outputs["a"].stats["shards"][1]["tokenizer"] = "0123456789abcdef"
    with pytest.raises(DataConfigError) as e:
        _build(tmp_path, outputs)
    assert str(e.value).startswith(f"corpus 'a': {outputs['a'].prefixes[1]}.idx was tokenised by a tokenizer with "
                                   f"digest 0123456789abcdef, this run's tokenizer has {file_digest(tokenizer_path())}")


def test_preprocessed_shards_record_their_tokenizer(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"text": f"document {i} " * 4} for i in range(60)])
    out = prepare(corpus_cfg(tmp_path / "cache", [f], tasks=2))["c"]
    assert [s["tokenizer"] for s in out.stats["shards"]] == [file_digest(tokenizer_path())] * 2


def test_a_weighted_empty_corpus_is_named(tmp_path):
    f = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}] * 5)
    with pytest.raises(DataError) as e:
        build_datasets(corpus_cfg(tmp_path / "cache", [f]), 16, 1, str(tmp_path / "run"), 512, num_samples=8)
    assert f"corpus 'c' is empty: no documents with text in 1 input file(s) ['{f}']" in str(e.value)
    outputs = _outputs(tmp_path)
    outputs["b"].shard_tokens = [0] * 4
    with pytest.raises(DataConfigError) as e:
        _build(tmp_path, outputs)
    assert str(e.value) == (f"data.mixtures.default.b=0.4: corpus 'b' is empty ({outputs['b'].path}/stats.json "
                            "lists no tokens); give it weight 0 or fix its inputs")


def test_an_index_that_disagrees_with_its_stats_is_named(tmp_path):
    outputs = _outputs(tmp_path)
    outputs["a"].stats["shards"][1]["documents"] = 61
    with pytest.raises(ValueError, match=f"{outputs['a'].prefixes[1]}.idx holds 60 documents, its corpus's "
                                         "stats.json says 61"):
        _build(tmp_path, outputs)
    with open(outputs["b"].prefixes[3] + ".idx", "r+b") as fh:
        fh.truncate(10)
    outputs = {**_outputs(tmp_path / "again"), "b": outputs["b"]}
    with pytest.raises(DataConfigError, match=f"{outputs['b'].prefixes[3]}.idx is not a megatron index"):
        _build(tmp_path, outputs)
