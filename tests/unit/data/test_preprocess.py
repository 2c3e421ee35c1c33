"""Preprocessing: tokens read back from the indexed shards equal the tokenizer's output per
document (EOD appended, one document per sequence, order kept across shards), stats add up,
reruns skip and changed inputs rebuild, and bad input fails with a clear error and no output."""

from __future__ import annotations

import glob
import gzip
import json
import os

import numpy as np
import pytest

from data_pipeline.chat import render
from data_pipeline.config import DataConfigError
from data_pipeline.preprocess import prepare
from data_pipeline.readers import DataError
from data_pipeline.samples import sample_dir
from data_pipeline.tokenizer import load
from tests.support.data import (corpus_cfg, default_data_cfg, expected_tokens, read_docs, sample_outputs,
                                     tokenizer_path, write_jsonl)

_expected = expected_tokens


def _texts(files, field="text"):
    out = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            out += [json.loads(line)[field] for line in fh]
    return out


@pytest.mark.heavy
def test_sample_corpora_round_trip():
    cfg = default_data_cfg()
    outputs = sample_outputs()
    assert set(outputs) == {"prose", "code", "math", "agent"}
    for name, out in outputs.items():
        # this interpreter's sample corpus (the cache may hold others, keyed by Python version)
        files = glob.glob(os.path.join(sample_dir(name, cfg.cache_dir, cfg.sample_seed), "*.jsonl"))
        if name == "agent":
            texts = [render(m, cfg.chat)[0] for m in _texts(files, "messages")]
        else:
            texts = _texts(files)
        docs = read_docs(out.prefixes)
        assert len(out.prefixes) == 2 and len(docs) == len(texts) == out.stats["documents"]
        assert docs == _expected(texts), name
        assert out.stats["tokens"] == sum(map(len, docs)) == sum(out.shard_tokens)
        assert out.stats["bytes"] == sum(len(t.encode()) for t in texts)
        assert out.loss_mask == (name == "agent")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        for p in out.prefixes:
            idx = IndexedDataset(p)
            assert list(idx.document_indices) == list(range(len(idx) + 1))  # one sequence per document


def test_agent_loss_mask_covers_tool_results_and_role_headers():
    out = sample_outputs()["agent"]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = load(tokenizer_path())
    ids, masks = IndexedDataset(out.prefixes[0]), IndexedDataset(out.prefixes[0] + "-lossmask")
    special = {t: tok.token_to_id(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                                 "<tool_call>", "<tool_response>", "<|endoftext|>")}
    total = kept = 0
    for i in range(20):
        t, m = ids[i], masks[i]
        assert len(t) == len(m) and set(np.unique(m)) <= {0, 1}
        for name in ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<tool_response>"):
            assert not m[t == special[name]].any(), name
        assert m[t == special["<tool_call>"]].all() and m[-1] == 1 and t[-1] == special["<|endoftext|>"]
        dropped = tok.decode(t[m == 0].tolist(), skip_special_tokens=False)
        trained = tok.decode(t[m == 1].tolist(), skip_special_tokens=False)
        assert "You are a careful software agent" in trained  # system text is trained on
        assert "<tool_response>" in dropped and "<tool_response>" not in trained
        total, kept = total + len(m), kept + int(m.sum())
    assert 0.1 < kept / total < 0.9
    assert out.stats["loss_tokens"] < out.stats["tokens"]


def test_mask_settings_change_the_sidecar(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "python", "arguments": {"code": "print(2+2)"}}]},
            {"role": "tool", "name": "python", "content": "4\n"}, {"role": "assistant", "content": "It is 4."}]
    f = write_jsonl(tmp_path / "t.jsonl", [{"messages": msgs}])
    results = {}
    for masks in [(True, True), (False, True), (True, False), (False, False)]:
        cfg = corpus_cfg(tmp_path / "cache", [f], messages_field="messages",
                         mask_template=masks[0], mask_tool_results=masks[1])
        out = prepare(cfg)["c"]
        tokens, mask = read_docs(out.prefixes)[0], read_docs([out.prefixes[0] + "-lossmask"])[0]
        text, _ = render(msgs, cfg.chat)
        assert tokens == _expected([text])[0]
        results[masks] = mask
    dropped = {k: len(v) - sum(v) for k, v in results.items()}
    assert dropped[(False, False)] == 0
    tok = load(tokenizer_path())
    headers = ["<|system|>\n", "<|user|>\n", "<|assistant|>\n", "<|assistant|>\n"]
    assert dropped[(True, False)] == sum(len(tok.encode(h, add_special_tokens=False).ids) for h in headers) == 8
    assert dropped[(True, True)] == dropped[(True, False)] + dropped[(False, True)]
    cfg.chat.observation = "<|tool|>"
    with pytest.raises(DataConfigError, match=r"the chat markers data.chat.observation='<\|tool\|>' are not tokens of"):
        prepare(cfg)
    tool_part = "<|observation|>\n<tool_response>\n4\n\n</tool_response>"
    assert dropped[(False, True)] == len(tok.encode(tool_part, add_special_tokens=False).ids)


@pytest.mark.heavy
def test_byte_range_shards_partition_one_file(tmp_path):
    texts = [f"document {i}: " + "word " * (i % 37) for i in range(301)]
    f = write_jsonl(tmp_path / "one.jsonl", [{"text": t} for t in texts])
    single = prepare(corpus_cfg(tmp_path / "c1", [f]))["c"]
    three = prepare(corpus_cfg(tmp_path / "c3", [f], workers=2, tasks=3))["c"]
    assert len(single.prefixes) == 1 and len(three.prefixes) == 3
    sizes = [len(read_docs([p])) for p in three.prefixes]
    assert min(sizes) > 50 and sum(sizes) == 301
    assert read_docs(three.prefixes) == read_docs(single.prefixes) == _expected(texts)


def test_formats_text_gzip_parquet_and_saved_dataset(tmp_path):
    texts = ["alpha beta\n", "γάμμα δέλτα", "def f():\n    return 1\n"]
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, t in enumerate(texts):
        (folder / f"{i}.txt").write_text(t, encoding="utf-8")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as g:
        g.writelines(json.dumps({"body": t}) + "\n" for t in texts)
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    cases = [([folder], {}), ([tmp_path / "d.jsonl.gz"], {"text_field": "body"}),
             ([tmp_path / "d.parquet"], {}), ([tmp_path / "saved"], {})]
    for paths, kw in cases:
        out = prepare(corpus_cfg(tmp_path / "cache", paths, **kw))["c"]
        assert read_docs(out.prefixes) == _expected(texts), paths


def test_rerun_skips_and_changed_input_rebuilds(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": f"line {i}"} for i in range(10)])
    cfg = corpus_cfg(tmp_path / "cache", [f])
    first = prepare(cfg)["c"]
    stamp = os.stat(os.path.join(first.path, "stats.json")).st_mtime_ns
    again = prepare(cfg)["c"]
    assert again.path == first.path and os.stat(os.path.join(again.path, "stats.json")).st_mtime_ns == stamp
    with open(f, "a") as fh:
        fh.write(json.dumps({"text": "one more"}) + "\n")
    changed = prepare(cfg)["c"]
    assert changed.path != first.path and changed.stats["documents"] == 11
    cfg.corpora["c"].invalid_utf8 = "reject"  # a setting that changes the output also rebuilds
    assert prepare(cfg)["c"].path != changed.path


def _no_output(cache) -> bool:
    return not glob.glob(os.path.join(str(cache), "indexed", "c-*"))


@pytest.mark.heavy
@pytest.mark.parametrize("workers", [1, 2])
def test_missing_text_field(tmp_path, workers):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}] * 50 + [{"body": "no text here"}] + [{"text": "x"}] * 50)
    with pytest.raises(DataError) as e:
        prepare(corpus_cfg(tmp_path / "cache", [f], workers=workers, tasks=2))
    offset = 50 * len(json.dumps({"text": "ok"}) + "\n")
    assert f"corpus 'c': {f}: line at byte {offset}: no field 'text' (fields: ['body']); " \
        "set data.corpora.c.text_field" in str(e.value)
    assert _no_output(tmp_path / "cache")


def test_empty_corpus_and_missing_file(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(DataError, match=r"corpus 'c' is empty: no documents with text in 1 input file"):
        prepare(corpus_cfg(tmp_path / "cache", [f]))
    assert _no_output(tmp_path / "cache")
    missing = tmp_path / "gone.jsonl"
    with pytest.raises(DataError, match=rf"corpus 'c': data.corpora.c.paths: no such file or folder '{missing}'"):
        prepare(corpus_cfg(tmp_path / "cache", [missing]))
    assert _no_output(tmp_path / "cache")


def test_invalid_utf8_replace_counts_reject_names_the_byte(tmp_path):
    good = json.dumps({"text": "fine"}).encode() + b"\n"
    bad = b'{"text": "caf\xe9 au lait"}\n'
    f = tmp_path / "a.jsonl"
    f.write_bytes(good * 3 + bad + good)
    out = prepare(corpus_cfg(tmp_path / "cache", [f], max_invalid_utf8_fraction=0.2))["c"]
    assert out.stats["documents"] == 5 and out.stats["invalid_utf8_documents"] == 1
    assert out.stats["replacement_chars"] == 1
    assert read_docs(out.prefixes)[3] == _expected(["caf\ufffd au lait"])[0]
    with pytest.raises(DataError) as e:
        prepare(corpus_cfg(tmp_path / "cache2", [f], invalid_utf8="reject"))
    assert (f"{f}: line at byte {3 * len(good)}: invalid UTF-8 at byte {bad.index(0xE9)} "
            "(data.corpora.c.invalid_utf8=reject)") in str(e.value)
    assert _no_output(tmp_path / "cache2")


@pytest.mark.heavy
def test_preprocessing_inside_a_busy_process_uses_forkserver_and_same_tokens(tmp_path):
    """A training run triggers preprocessing from a process that already runs threads (gloo,
    W&B): its workers must not be forked from it (a lock held by another thread hangs them)."""
    import threading

    import torch.distributed as dist

    from data_pipeline.preprocess import worker_start_method

    texts = [f"document {i} " * (i + 1) for i in range(12)]
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    if threading.active_count() == 1:  # earlier tests may have left helper threads behind
        assert worker_start_method() == "fork"
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)
    busy.start()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert worker_start_method() == "forkserver"
        cfg = corpus_cfg(tmp_path / "cache", [f])
        cfg.preprocess.workers = 2
        out = prepare(cfg)["c"]
    finally:
        dist.destroy_process_group()
        stop.set()
    assert read_docs(out.prefixes) == _expected(texts)


@pytest.mark.heavy
def test_preprocessing_under_a_sigterm_handler_uses_forkserver(tmp_path):
    """A one-node training run preprocesses on rank 0 before its process group, under its
    preemption handler (SIGTERM noted, not obeyed): forked workers would inherit it and never
    end when the pool terminates them with SIGTERM, so they are not forked."""
    import signal
    import threading

    from data_pipeline.preprocess import worker_start_method

    texts = [f"text {i} " * (i + 2) for i in range(10)]
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    noted = []
    before = signal.signal(signal.SIGTERM, lambda *_: noted.append(1))
    try:
        assert worker_start_method() == "forkserver"
        cfg = corpus_cfg(tmp_path / "cache", [f])
        cfg.preprocess.workers = 2
        out = prepare(cfg)["c"]  # returns: the pool's workers end
    finally:
        signal.signal(signal.SIGTERM, before)
    assert read_docs(out.prefixes) == _expected(texts) and not noted
    if threading.active_count() == 1 and before is signal.SIG_DFL:
        assert worker_start_method() == "fork"
