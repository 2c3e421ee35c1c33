"""Content checksums of prepared corpora and sample indices: a file overwritten in place at its
size (a zeroed ``.bin``, a zeroed ``dataset_sample_index.npy`` or packed index) is caught before
use, naming the file and both checksums -- the corpus set aside and rebuilt (an error where it
cannot be rebuilt), the index removed and rebuilt, a launch over several nodes refused -- while an
untouched folder costs a stat per file and no hashing."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from data_pipeline import fsutil
from data_pipeline.build import build_datasets
from data_pipeline.preprocess import prepare
from tests.support.data import corpus_cfg, default_data_cfg, write_jsonl

TEXTS = [f"document {i}: " + "word " * (i % 7) for i in range(60)]


def _zero(path) -> tuple[str, str]:
    """Overwrite ``path``'s data with zeros in place, same size (a ``.npy`` keeps its header: it
    still loads, as the same shape and dtype): (sha256 before, sha256 after)."""
    with open(path, "rb") as f:
        data = f.read()
    start = 0
    if path.endswith(".npy"):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            header(f)
            start = f.tell()
    zeroed = data[:start] + bytes(len(data) - start)
    with open(path, "r+b") as f:
        f.write(zeroed)
    return hashlib.sha256(data).hexdigest(), hashlib.sha256(zeroed).hexdigest()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("data_pipeline")]


@pytest.fixture
def hash_calls(monkeypatch) -> list:
    """Every file the content checksum reads whole, in order."""
    calls, real = [], getattr(fsutil, "content_digest", None)

    def counted(path):
        calls.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(fsutil, "content_digest", counted, raising=False)
    return calls


def _sample_tokens(ds, n=24) -> list:
    return [ds[i]["tokens"] for i in range(n)]


def test_a_zeroed_bin_of_its_size_is_named_with_both_checksums_set_aside_and_rebuilt(tmp_path, caplog):
    from data_pipeline.build import build_datasets as build
    from data_pipeline.integrity import CorpusDamaged, verify

    cfg = corpus_cfg(tmp_path / "cache", [write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])])
    cfg.split = "100,0,0"
    path = prepare(cfg)["c"].path
    bin_ = f"{path}/shard_00000.bin"
    size = os.path.getsize(bin_)
    then, now = _zero(bin_)
    assert os.path.getsize(bin_) == size  # the size, the index and the stats all still agree
    problem = f"{bin_} has sha256 {now}, the manifest says {then}"
    assert verify(path) == [problem]

    cfg.preprocess.executor = "slurm"  # a run that cannot rebuild it: an error naming both checksums
    with pytest.raises(CorpusDamaged) as e:
        build(cfg, 16, 1, str(tmp_path / "run"), 512, 8)
    assert str(e.value).startswith(f"corpus 'c' is damaged ({problem}) and data.preprocess.executor=slurm: ")
    assert "\n" not in str(e.value) and not os.path.exists(path + ".damaged-0")

    cfg.preprocess.executor = "local"
    with caplog.at_level(logging.WARNING):
        out = prepare(cfg)["c"]
    assert _warnings(caplog) == [f"corpus 'c': {path} is damaged (shard_00000.bin has sha256 {now}, the manifest "
                                 f"says {then}); set aside as {os.path.basename(path)}.damaged-0 and rebuilt"]
    with open(f"{out.path}/shard_00000.bin", "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == then
    assert verify(path + ".damaged-0") == [f"{path}.damaged-0/shard_00000.bin has sha256 {now}, the manifest says "
                                           f"{then}"]


def _index_dir(run_dir) -> str:
    [key] = os.listdir(os.path.join(run_dir, "data_index"))
    return os.path.join(run_dir, "data_index", key)


@pytest.mark.parametrize("zeroed", ["dataset_sample_index.npy", "packed1-shuffle.npy"])
def test_a_zeroed_sample_index_file_is_caught_and_rebuilt_before_use(tmp_path, caplog, zeroed):
    """The default mixture: megatron's blend over four corpora (``dataset_sample_index.npy``)
    and the agent corpus best-fit packed (our ``-packed1-*.npy``)."""
    cfg = default_data_cfg()
    run_dir = str(tmp_path / "run")
    first, _ = build_datasets(cfg, 128, 1234, run_dir, 512, num_samples=256)
    expected = _sample_tokens(first)
    index_dir = _index_dir(run_dir)
    [name] = [n for n in os.listdir(index_dir) if n.endswith(zeroed) and "-train-" in n]
    then, now = _zero(os.path.join(index_dir, name))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again, _ = build_datasets(cfg, 128, 1234, run_dir, 512, num_samples=256)
    assert all(torch.equal(a, b) for a, b in zip(_sample_tokens(again), expected))  # the same samples as built
    assert _warnings(caplog) == [f"sample index {index_dir} is damaged ({name} has sha256 {now}, the manifest "
                                 f"says {then}); removed and rebuilt"]
    with open(os.path.join(index_dir, name), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == then


def test_a_damaged_index_or_corpus_stops_a_multi_node_launch_naming_the_file(tmp_path):
    """What a launch over several nodes checks on rank 0 (``readiness.missing(check=True)``) and
    the one ``error:`` line it stops with (``pretrain.data_prep.DataNotPrepared``)."""
    from data_pipeline.readiness import DataRequest, missing
    from pretrain.data_prep import DataNotPrepared

    cfg = corpus_cfg(tmp_path / "cache", [write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])],
                     tasks=2)
    cfg.split = "100,0,0"
    run_dir = str(tmp_path / "run")
    build_datasets(cfg, 16, 1, run_dir, 512, 64)
    req = DataRequest(cfg, 16, 1, 512, 64)
    assert missing(req, run_dir, check=True) == []
    index_dir = _index_dir(run_dir)
    [name] = [n for n in os.listdir(index_dir) if n.endswith("-sample_index.npy")]  # one shard group: no blend
    then, now = _zero(os.path.join(index_dir, name))
    [lack] = missing(req, run_dir, check=True)
    assert (lack.thing, lack.state, lack.path) == (
        "sample index", f"damaged: {name} has sha256 {now}, the manifest says {then}", index_dir)
    assert missing(req, run_dir, check=False) == []  # the other ranks only read the manifest
    line = DataNotPrepared([("pretrain_general", [lack])], ["x=1"]).brief()
    assert line.startswith(f"stage 'pretrain_general' has unprepared data: sample index damaged: {name} has sha256 "
                           f"{now}, the manifest says {then} ({index_dir}): run python -m data_pipeline.prepare x=1")

    path = prepare(cfg)["c"].path
    then, now = _zero(f"{path}/shard_00001.bin")
    [lack] = missing(req, run_dir, check=True)
    assert (lack.thing, lack.state) == ("corpus 'c'", f"damaged: shard_00001.bin has sha256 {now}, the manifest "
                                                      f"says {then}")


def test_an_untouched_folder_is_checked_by_stats_alone(tmp_path, hash_calls):
    """Preparing hashes each file once (the shard writer; the manifest reuses it), building the
    index hashes each of its files once; every later check only stats them. A copied folder (new
    ctimes) is re-hashed once and its new stamps recorded."""
    from data_pipeline.integrity import verify
    from data_pipeline.readiness import DataRequest, missing

    cfg = corpus_cfg(tmp_path / "cache", [write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])],
                     tasks=2)
    cfg.split = "100,0,0"
    path = prepare(cfg)["c"].path
    shard_files = ["shard_00000.bin", "shard_00000.idx", "shard_00001.bin", "shard_00001.idx"]
    assert sorted(hash_calls) == shard_files
    with open(f"{path}/stats.json") as f:
        files = json.load(f)["manifest"]["files"]
    for name in shard_files:
        with open(f"{path}/{name}", "rb") as f:
            assert files[name]["sha256"] == hashlib.sha256(f.read()).hexdigest()  # the .bin too

    run_dir = str(tmp_path / "run")
    hash_calls.clear()
    build_datasets(cfg, 16, 1, run_dir, 512, 64)
    index_dir = _index_dir(run_dir)
    built = sorted(n for n in os.listdir(index_dir) if n != ".complete")
    assert sorted(hash_calls) == built and any(n.endswith("-sample_index.npy") for n in built)

    from data_pipeline.build import index_problems

    hash_calls.clear()
    assert verify(path) == [] and index_problems(index_dir) == []
    assert missing(DataRequest(cfg, 16, 1, 512, 64), run_dir, check=True) == []
    build_datasets(cfg, 16, 1, run_dir, 512, 64)
    assert prepare(cfg)["c"].path == path
    assert hash_calls == []

    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)  # times preserved, ctimes new: each file read once more
    assert verify(copy, refresh=True) == [] and sorted(hash_calls) == shard_files
    hash_calls.clear()
    assert verify(copy) == [] and hash_calls == []
