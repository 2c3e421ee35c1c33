"""Preprocessed corpora are verified before use, never trusted (issue 17, cases 5 and 9).

Each kind of damage is named by file (truncated ``.idx``/``.bin``, a deleted file, an altered
index, a missing ``stats.json``, a folder without a manifest); a damaged folder is set aside and
rebuilt by a local run, or reported by file where it cannot be rebuilt, at the data-builder level
(before any model exists); a fresh build is verified before it is published; the CLI reports only
verified corpora; two processes preparing one corpus both end with the same intact folder; altered
(invalid UTF-8) documents warn with their count and fail above the threshold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest

from data_pipeline import preprocess
from data_pipeline.integrity import CorpusDamaged, file_record, verify
from data_pipeline.preprocess import prepare
from data_pipeline.readers import DataError
from tests.support.data import REPO, corpus_cfg, expected_tokens, read_docs, tokenizer_path, write_jsonl

TEXTS = [f"document {i}: " + "word " * (i % 7) for i in range(60)]


def _corpus(tmp_path, cache="cache", **kw):
    f = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    return corpus_cfg(tmp_path / cache, [f], **kw)


def _truncate(path, n):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - n)
    return size


def _edit_stats(folder, change):
    path = os.path.join(folder, "stats.json")
    with open(path) as f:
        stats = json.load(f)
    change(stats)
    with open(path, "w") as f:
        json.dump(stats, f)


def _warnings(caplog) -> list[str]:
    """This package's warnings (megatron's own are not the subject)."""
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("data_pipeline")]


def test_verify_names_each_kind_of_damage(tmp_path):
    out = prepare(_corpus(tmp_path, tasks=2))["c"]
    assert verify(out.path) == []

    def damaged(how):
        d = str(tmp_path / f"copy-{how.__name__}")
        shutil.copytree(out.path, d)
        return d, how(d)

    def idx_truncated(d):
        return _truncate(f"{d}/shard_00001.idx", 8)

    def bin_truncated(d):
        return _truncate(f"{d}/shard_00000.bin", 2)

    def bin_deleted(d):
        os.remove(f"{d}/shard_00000.bin")

    def idx_altered(d):
        with open(f"{d}/shard_00000.idx", "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 1]))

    def stats_deleted(d):
        os.remove(f"{d}/stats.json")

    def no_manifest(d):
        _edit_stats(d, lambda s: s.pop("manifest"))

    def stats_garbled(d):
        with open(f"{d}/stats.json", "w") as f:
            f.write('{"shards": [')

    def manifest_from_the_future(d):
        _edit_stats(d, lambda s: s["manifest"].update(version=99))

    def bin_short_of_its_index(d):  # a writer that lost the tail, recorded as is
        size = _truncate(f"{d}/shard_00000.bin", 2)
        _edit_stats(d, lambda s: s["manifest"]["files"].update(
            {"shard_00000.bin": file_record(f"{d}/shard_00000.bin")}))
        return size

    def stats_disagree(d):
        _edit_stats(d, lambda s: s["shards"][1].update(documents=s["shards"][1]["documents"] + 1, tokens=7))

    d, size = damaged(idx_truncated)
    assert verify(d) == [f"{d}/shard_00001.idx is {size - 8} bytes, the manifest says {size}"]
    d, size = damaged(bin_truncated)
    assert verify(d) == [f"{d}/shard_00000.bin is {size - 2} bytes, the manifest says {size}"]
    d, _ = damaged(bin_deleted)
    assert verify(d) == [f"{d}/shard_00000.bin is missing"]
    d, _ = damaged(idx_altered)
    [problem] = verify(d)
    assert problem.startswith(f"{d}/shard_00000.idx has sha256 ") and "the manifest says" in problem
    d, _ = damaged(stats_deleted)
    assert verify(d) == [f"{d}/stats.json is missing"]
    d, _ = damaged(no_manifest)
    assert verify(d) == [f"{d}/stats.json has no manifest (written by an older version of data_pipeline)"]
    d, _ = damaged(stats_garbled)
    [problem] = verify(d)
    assert problem.startswith(f"{d}/stats.json cannot be read (JSONDecodeError: ")
    d, _ = damaged(manifest_from_the_future)
    assert verify(d) == [f"{d}/stats.json has a manifest of version 99, this code reads 2"]
    d, size = damaged(bin_short_of_its_index)
    assert verify(d) == [f"{d}/shard_00000.bin is {size - 2} bytes, its index {d}/shard_00000.idx implies {size}"]
    d, _ = damaged(stats_disagree)
    n = out.stats["shards"][1]["documents"]
    assert verify(d) == [f"{d}/shard_00001.idx holds {n} sequences in {n} documents, stats.json says {n + 1} documents",
                         f"{d}/shard_00001.idx holds {out.shard_tokens[1]} tokens, stats.json says 7"]


@pytest.mark.parametrize("damage", ["idx_truncated", "stats_deleted"])
def test_damaged_corpus_is_set_aside_and_rebuilt(tmp_path, caplog, damage):
    cfg = _corpus(tmp_path)
    first = prepare(cfg)["c"]
    if damage == "idx_truncated":
        size = _truncate(f"{first.path}/shard_00000.idx", 5)
        problem = f"shard_00000.idx is {size - 5} bytes, the manifest says {size}"
    else:
        os.remove(f"{first.path}/stats.json")
        problem = "stats.json is missing"
    with caplog.at_level(logging.WARNING):
        again = prepare(cfg)["c"]
    aside = first.path + ".damaged-0"
    assert _warnings(caplog) == [f"corpus 'c': {first.path} is damaged ({problem}); set aside as "
                                 f"{os.path.basename(aside)} and rebuilt"]
    assert again.path == first.path and verify(again.path) == []
    assert read_docs(again.prefixes) == expected_tokens(TEXTS)
    assert verify(aside) == [f"{aside}/{problem}"]  # the damaged folder is kept, not deleted
    caplog.clear()
    stamp = os.stat(f"{again.path}/stats.json").st_mtime_ns
    with caplog.at_level(logging.WARNING):
        assert prepare(cfg)["c"].path == again.path
    assert _warnings(caplog) == [] and os.stat(f"{again.path}/stats.json").st_mtime_ns == stamp


def test_data_builder_reports_or_rebuilds_a_truncated_bin_before_any_model(tmp_path, caplog):
    """The run builds its datasets before its model (pretrain.stage): this is where a damaged
    corpus stops it, naming the file, instead of crashing inside the first train step."""
    from data_pipeline.build import build_datasets

    cfg = _corpus(tmp_path)
    cfg.split = "100,0,0"
    path = prepare(cfg)["c"].path
    size = _truncate(f"{path}/shard_00000.bin", 64)
    cfg.preprocess.executor = "slurm"  # cannot rebuild inside a run
    with pytest.raises(CorpusDamaged) as e:
        build_datasets(cfg, 16, 1, str(tmp_path / "run"), 512, 8)
    assert (f"corpus 'c' is damaged ({path}/shard_00000.bin is {size - 64} bytes, the manifest says {size}) "
            "and data.preprocess.executor=slurm: run `python -m data_pipeline.preprocess` first") in str(e.value)
    assert not os.path.exists(path + ".damaged-0")
    cfg.preprocess.executor = "local"
    with caplog.at_level(logging.WARNING):
        train, valid = build_datasets(cfg, 16, 1, str(tmp_path / "run"), 512, 8)
    assert _warnings(caplog) == [f"corpus 'c': {path} is damaged (shard_00000.bin is {size - 64} bytes, the manifest "
                                 f"says {size}); set aside as {os.path.basename(path)}.damaged-0 and rebuilt"]
    assert valid is None and len(train) >= 8 and train[7]["tokens"].shape == (16,)
    assert verify(path) == [] and os.path.getsize(f"{path}/shard_00000.bin") == size


def _cli(tmp_path, *extra, code=None) -> subprocess.Popen:
    """``python -m data_pipeline.preprocess`` (or ``code`` running it) on corpus ``c`` = in.jsonl."""
    conf = tmp_path / "conf" / "data"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "tiny.yaml").write_text(
        f"cache_dir: {tmp_path / 'cache'}\ntokenizer: {{path: {tokenizer_path()}}}\n"
        f"corpora:\n  c: {{paths: [{tmp_path / 'in.jsonl'}]}}\nmixtures:\n  default: {{c: 1.0}}\n")
    args = ["data=tiny", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data.preprocess.workers=1", *extra]
    cmd = ([sys.executable, "-m", "data_pipeline.preprocess", *args] if code is None else
           [sys.executable, "-c", code, *args])
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.heavy
def test_two_cli_runs_repair_a_deleted_bin_once_and_report_the_same_verified_corpus(tmp_path):
    """The CLI used to report a corpus with a deleted ``.bin`` ready. Two runs at once (as a test
    suite or two jobs sharing a cache would): one sets it aside and rebuilds, the other waits on
    the lock, verifies the result and uses it."""
    path = prepare(_corpus(tmp_path))["c"].path
    os.remove(f"{path}/shard_00000.bin")
    procs = [_cli(tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    summaries = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert summaries[0] == summaries[1]
    assert summaries[0]["c"]["path"] == path and summaries[0]["c"]["documents"] == len(TEXTS)
    repaired = (f"{path} is damaged (shard_00000.bin is missing); set aside as {os.path.basename(path)}.damaged-0 "
                "and rebuilt")
    assert sum(o.count(repaired) for o in outs) == 1
    assert verify(path) == [] and read_docs([f"{path}/shard_00000"]) == expected_tokens(TEXTS)
    names = sorted(os.listdir(os.path.dirname(path)))
    assert names == sorted([".locks", os.path.basename(path), os.path.basename(path) + ".damaged-0"])


@pytest.mark.heavy
def test_cli_exits_nonzero_naming_the_file_when_a_fresh_build_fails_verification(tmp_path):
    """A build whose ``.bin`` lost its tail before the manifest was written (a writer or
    filesystem fault) is never published nor reported ready."""
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    broken = ("import os, runpy\nfrom data_pipeline import integrity\nreal = integrity.manifest\n"
              "def manifest(folder, shards):\n    os.truncate(os.path.join(folder, 'shard_00000.bin'), 10)\n"
              "    return real(folder, shards)\nintegrity.manifest = manifest\n"
              "runpy.run_module('data_pipeline.preprocess', run_name='__main__', alter_sys=True)\n")
    proc = _cli(tmp_path, code=broken)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0
    assert re.search(r"corpus 'c': the shards just written are inconsistent:\n  - \S+\.partial-\w+/shard_00000\.bin "
                     r"is 10 bytes, its index \S+/shard_00000\.idx implies \d+", out), out[-3000:]
    assert not any(line.startswith("{") for line in out.splitlines())  # nothing reported ready
    assert glob.glob(str(tmp_path / "cache" / "indexed" / "c-*")) == []


def test_a_folder_published_by_a_process_the_lock_missed_is_used(tmp_path, monkeypatch, caplog):
    """A lock that does not reach another node: its folder appears while this build runs; the
    rename fails and the other's folder, verified, is used."""
    cfg = _corpus(tmp_path)
    winner = prepare(dataclasses.replace(cfg, cache_dir=str(tmp_path / "other")))["c"].path
    final = os.path.join(cfg.cache_dir, "indexed", os.path.basename(winner))
    real = preprocess.run_local

    def overtaken(steps, c, logging_dir):
        real(steps, c, logging_dir)
        shutil.copytree(winner, final)

    monkeypatch.setattr(preprocess, "run_local", overtaken)
    monkeypatch.setattr(preprocess, "file_lock", lambda _: contextlib.nullcontext())
    with caplog.at_level(logging.WARNING):
        out = prepare(cfg)["c"]
    assert out.path == final and verify(final) == [] and read_docs(out.prefixes) == expected_tokens(TEXTS)
    assert _warnings(caplog) == [f"corpus 'c': {final} was published by another process during this build; using it"]
    assert sorted(os.listdir(os.path.dirname(final))) == [os.path.basename(final)]  # no partial left


def test_altered_documents_warn_with_their_count_and_fail_above_the_threshold(tmp_path, caplog):
    latin = [f"caf\xe9 num\xe9ro {i}" for i in range(4)]
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b"".join(b'{"text": "' + t.encode("latin-1") + b'"}\n' for t in latin))
    cfg = corpus_cfg(tmp_path / "cache", [f])
    with pytest.raises(DataError) as e:
        prepare(cfg)
    assert str(e.value) == (
        "corpus 'c': 4 of 4 documents (100.00%) had bytes that are not valid utf-8, replaced by U+FFFD "
        "(data.corpora.c.invalid_utf8=replace), more than data.corpora.c.max_invalid_utf8_fraction=0.01. "
        "If the input is in another encoding (e.g. Latin-1), set data.corpora.c.encoding; "
        "data.corpora.c.invalid_utf8=reject names the first bad byte; raising "
        "data.corpora.c.max_invalid_utf8_fraction trains on the altered text")
    built = glob.glob(str(tmp_path / "cache" / "indexed" / "c-*"))
    cfg.corpora["c"].max_invalid_utf8_fraction = 1.0  # accepted as is: the same output, not rebuilt
    with caplog.at_level(logging.WARNING):
        out = prepare(cfg)["c"]
    assert [out.path] == built
    assert _warnings(caplog) == ["corpus 'c': 4 of 4 documents (100.00%) had bytes that are not valid utf-8, "
                                 "replaced by U+FFFD (data.corpora.c.invalid_utf8=replace)"]
    assert read_docs(out.prefixes) == expected_tokens([t.replace("\xe9", "\ufffd") for t in latin])

    caplog.clear()
    cfg.corpora["c"].encoding = "latin-1"
    with caplog.at_level(logging.WARNING):
        out = prepare(cfg)["c"]
    assert out.path not in built and out.stats["invalid_utf8_documents"] == 0 and _warnings(caplog) == []
    assert read_docs(out.prefixes) == expected_tokens(latin)

    mostly_fine = tmp_path / "mixed.jsonl"
    mostly_fine.write_bytes(f.read_bytes()[: f.read_bytes().index(b"\n") + 1]
                            + b"".join(b'{"text": "line %d"}\n' % i for i in range(199)))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        prepare(corpus_cfg(tmp_path / "cache", [mostly_fine]))
    assert _warnings(caplog) == ["corpus 'c': 1 of 200 documents (0.50%) had bytes that are not valid utf-8, "
                                 "replaced by U+FFFD (data.corpora.c.invalid_utf8=replace)"]
