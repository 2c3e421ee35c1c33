"""The data config fails before anything is built, naming the field and value: mixtures
(unknown corpus, negative / all-zero weights, unknown mixture), corpus fields, missing inputs,
splits, and a tokenizer larger than the model's vocabulary (through the run's ``validate``)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from data_pipeline.config import CorpusConfig, DataConfig, DataConfigError
from data_pipeline.validation import check_data, validate_data
from pretrain.config.schema import register, to_run_config
from pretrain.config.validation import ConfigError
from pretrain.config.validation import plan_run as validate
from tests.support.data import REPO, default_data_cfg

register()


def _rc(*overrides):
    """A one-stage run (curriculum stages would set the data mixture themselves)."""
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base=None):
        return to_run_config(compose("config", overrides=["curriculum=none", *overrides]))


def _problems(cfg: DataConfig, vocab=None) -> str:
    return "\n".join(check_data(cfg, vocab))


def test_default_run_selects_the_sample_mixture():
    rc = _rc()
    assert rc.data.mixture == "default"
    assert {n: c.category for n, c in rc.data.corpora.items()} == {
        "prose": "general", "code": "code", "math": "math", "agent": "agent"}
    assert rc.data.corpora["agent"].packing == "best_fit" and rc.data.corpora["agent"].messages_field == "messages"
    assert rc.data.tokenizer.path is None and rc.data.tokenizer.vocab_size == 512
    assert check_data(rc.data, rc.model.vocab_size) == []
    validate(rc, 1)
    assert not dist.is_initialized()


def test_tokenizer_larger_than_model_vocab_fails_in_validate():
    e = pytest.raises(ConfigError, validate, _rc("model.vocab_size=256"), 1)
    assert "model.vocab_size=256 is smaller than the tokenizer's vocabulary (512" in str(e.value)
    e = pytest.raises(ConfigError, validate, _rc("data.tokenizer.vocab_size=1024"), 1)
    assert "model.vocab_size=512 is smaller than the tokenizer's vocabulary (1024" in str(e.value)
    assert not dist.is_initialized()


def test_unknown_corpus_in_mixture():
    cfg = default_data_cfg(mixtures={"default": {"prose": 1.0, "novels": 0.5}})
    assert "data.mixtures.default: unknown corpus 'novels' (data.corpora has ['agent', 'code', 'math', 'prose'])" \
        in _problems(cfg)
    with pytest.raises(DataConfigError, match="unknown corpus 'novels'"):
        validate_data(cfg)


def test_negative_and_all_zero_weights():
    cfg = default_data_cfg(mixtures={"default": {"prose": 1.0, "code": -0.5}})
    assert "data.mixtures.default.code=-0.5 must be a finite weight >= 0" in _problems(cfg)
    cfg = default_data_cfg(mixtures={"default": {"prose": 0.0, "code": 0}})
    assert "data.mixtures.default: all weights are zero" in _problems(cfg)
    cfg = default_data_cfg(mixtures={"default": {"prose": float("nan")}})
    assert "data.mixtures.default.prose=nan must be a finite weight >= 0" in _problems(cfg)
    assert _problems(default_data_cfg(mixtures={"default": {"prose": 0.0, "code": 2}})) == ""


def test_mixtures_from_the_command_line():
    e = pytest.raises(ConfigError, validate, _rc("data.mixture=long_contxt"), 1)
    assert "data.mixture='long_contxt' is not one of data.mixtures ['code_reasoning', 'default', 'long_context']" in str(e.value)
    validate(_rc("data.mixture=long_context"), 1)
    rc = _rc("+data.mixtures.code_only={code: 1.0}", "data.mixture=code_only")
    assert rc.data.mixtures["code_only"] == {"code": 1.0} and check_data(rc.data) == []
    rc = _rc("data.mixtures.default={prose: 1, code: -2}")
    e = pytest.raises(ConfigError, validate, rc, 1)
    assert "data.mixtures.default.code=-2 must be a finite weight >= 0" in str(e.value)
    assert "data.mixtures.default.math=heavy must be a finite weight >= 0" in _problems(
        _rc("data.mixtures.default.math=heavy").data)


def test_corpus_field_values(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "x"}\n')
    bad = CorpusConfig(category="", paths=[str(f)], packing="first_fit", format="csv", invalid_utf8="ignore",
                       encoding="utf-16", max_invalid_utf8_fraction=1.5)
    cfg = DataConfig(corpora={"a": bad}, mixtures={"default": {"a": 1}})
    msg = _problems(cfg)
    for expected in ("data.corpora.a.category='' must be a non-empty word",
                     "data.corpora.a.packing='first_fit' must be one of ['concat', 'best_fit']",
                     "data.corpora.a.format='csv' must be one of",
                     "data.corpora.a.invalid_utf8='ignore' must be one of ['replace', 'reject']",
                     "data.corpora.a.encoding='utf-16' must be an ASCII-compatible codec",
                     "data.corpora.a.max_invalid_utf8_fraction=1.5 must be in [0, 1]"):
        assert expected in msg, msg
    for encoding in ("no-such-codec", "rot13"):
        bad.encoding = encoding
        assert f"data.corpora.a.encoding={encoding!r} must be" in _problems(cfg)
    bad.encoding, bad.max_invalid_utf8_fraction = "latin-1", 0.0
    assert "data.corpora.a.encoding" not in _problems(cfg) and "max_invalid_utf8" not in _problems(cfg)


def test_missing_input_file_is_a_config_error(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    cfg = DataConfig(corpora={"a": CorpusConfig(paths=[missing])}, mixtures={"default": {"a": 1}})
    assert f"data.corpora.a.paths: no such file or folder '{missing}'" in _problems(cfg)
    cfg.corpora["a"].paths = [str(tmp_path / "*.parquet")]
    assert "no file matches" in _problems(cfg)
    cfg.corpora["a"].paths = ["samples:novels"]
    assert "'samples:novels' is not one of" in _problems(cfg)
    # a zero-weight corpus is not built, so its inputs are not required
    cfg = DataConfig(corpora={"a": CorpusConfig(paths=[missing]), "b": CorpusConfig(paths=["samples:math"])},
                     mixtures={"default": {"a": 0.0, "b": 1.0}})
    assert _problems(cfg) == ""


def test_split_preprocess_and_tokenizer_fields(tmp_path):
    cfg = default_data_cfg(split="98,x")
    assert "data.split='98,x' must be up to 3 comma-separated non-negative numbers" in _problems(cfg)
    assert "gives the train split no documents" in _problems(default_data_cfg(split="0,1"))
    cfg = default_data_cfg()
    cfg.preprocess.executor, cfg.preprocess.workers = "ray", 0
    msg = _problems(cfg)
    assert "data.preprocess.executor='ray' must be one of ['local', 'slurm']" in msg
    assert "data.preprocess.workers=0 must be >= 1" in msg
    cfg = default_data_cfg()
    cfg.tokenizer.path = str(tmp_path)
    assert f"data.tokenizer.path='{tmp_path}': no tokenizer.json at '{tmp_path}'" in _problems(cfg)
