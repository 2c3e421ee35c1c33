"""What ``python -m pretrain.train`` stops with, run in this process (the module as ``-m``
runs it, Hydra's entry point included; its ``SystemExit`` is the exit status and line the shell
sees):

- a data error met by the launch (here: ``data.preprocess.executor=slurm`` with a corpus that is
  damaged, or not preprocessed): one ``error:`` line naming the corpus and its folder, status 1,
  no traceback;
- a run dir another live run holds: one ``error:`` line naming the holder, and nothing of the
  run dir written or changed -- rank 0 takes the lock before it builds the data there (no
  ``data_index/``, ``.locks/``, ``logs/``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import runpy
import shutil
import socket
import sys
import time

import pytest

from tests.support.in_process_launch import leftovers_put_back, tree
from tests.support.launch import QUIET


@pytest.fixture
def entry_point(monkeypatch):
    """``launch(overrides)``: ``python -m pretrain.train`` with that command line, returning its
    ``SystemExit`` code; afterwards whatever a refused launch leaves in this process is put back
    (Hydra's global state, its log routing, signal handlers, a process group)."""
    from hydra.core.global_hydra import GlobalHydra

    def launch(overrides):
        monkeypatch.setattr(sys, "argv", ["pretrain/train.py", *QUIET, *overrides])
        with pytest.raises(SystemExit) as e:
            runpy.run_module("pretrain.train", run_name="__main__")  # as python -m runs it
        return e.value.code

    with leftovers_put_back():
        try:
            yield launch
        finally:
            GlobalHydra.instance().clear()


@pytest.fixture(scope="module")
def sample_cache(tmp_path_factory):
    """A data cache of its own holding the default config's sample inputs and tokenizer (copied
    from the shared cache, built there on first use), and ``corpora``: where each corpus's
    prepared folder belongs in it (the folder's name depends on its inputs' paths) and the
    shared cache's prepared folder to copy there."""
    from data_pipeline import tokenizer
    from data_pipeline.preprocess import corpus_files, output_dir
    from tests.support.data import default_data_cfg, sample_outputs

    shared = default_data_cfg()
    prepared = {name: out.path for name, out in sample_outputs().items()}
    cache = tmp_path_factory.mktemp("data") / "cache"
    for sub in ("samples", "tokenizers"):
        shutil.copytree(os.path.join(shared.cache_dir, sub), cache / sub)
    cfg = default_data_cfg(cache_dir=str(cache))
    corpora = {name: (output_dir(name, c, cfg, corpus_files(name, c, cfg), tokenizer.prepared(cfg)), prepared[name])
               for name, c in cfg.corpora.items() if name in prepared}
    return cache, corpora


def test_a_damaged_corpus_is_one_line_naming_it(sample_cache, tmp_path, entry_point):
    cache, corpora = sample_cache
    for final, source in corpora.values():
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(source, final)
    final = corpora["math"][0]
    shard = os.path.join(final, "shard_00000.bin")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:  # zeroed in place at its size: only its checksum tells
        f.write(bytes(size))
    now = hashlib.sha256(bytes(size)).hexdigest()
    with open(os.path.join(final, "stats.json")) as f:
        then = json.load(f)["manifest"]["files"]["shard_00000.bin"]["sha256"]

    code = entry_point([f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=2", f"data.cache_dir={cache}",
                        "data.preprocess.executor=slurm"])
    assert code == (f"error: corpus 'math' is damaged ({shard} has sha256 {now}, the manifest says "
                    f"{then}) and data.preprocess.executor=slurm: run `python -m data_pipeline.preprocess` first "
                    f"(it sets a damaged folder aside and resubmits)")


def test_an_unprepared_corpus_under_slurm_is_one_line_naming_it(sample_cache, tmp_path, entry_point):
    cache, corpora = sample_cache
    final = corpora["prose"][0]
    shutil.rmtree(final, ignore_errors=True)

    code = entry_point([f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=2", f"data.cache_dir={cache}",
                        "data.preprocess.executor=slurm"])
    assert code == (f"error: corpus 'prose' is not preprocessed ({final} missing) and data.preprocess.executor=slurm: "
                    f"run `python -m data_pipeline.preprocess` first (it sets a damaged folder aside and resubmits)")


def test_a_live_runs_lock_refuses_before_anything_is_written(tmp_path, entry_point):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": "4242",
              "started": time.time() - 60}
    (run_dir / "run.lock").write_text(json.dumps(holder))  # this process: a live run on this host
    before = tree(run_dir)

    code = entry_point([f"trainer.run_dir={run_dir}", "trainer.steps=2", "trainer.lock_wait_s=0"])
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    assert re.fullmatch(
        re.escape(f"error: run dir {run_dir} is in use by another run (pid {os.getpid()} on {socket.gethostname()}, "
                  f"Slurm job 4242, started {started}, heartbeat ") + r"\d+" + re.escape(
                      " s ago); waited 0 s (trainer.lock_wait_s). Stop that run, or train in another run dir "
                      "(trainer.name / trainer.run_dir)"), code), code
    after = tree(run_dir)
    assert sorted(set(after) - set(before)) == []  # no data_index/, .locks/, logs/
    assert after == before  # the holder's run.lock as it was


def test_a_listed_data_error_is_one_line():
    """A damaged corpus found after its build lists its files under its first line: one line."""
    from data_pipeline.integrity import CorpusDamaged
    from pretrain.data_prep import error_line

    e = CorpusDamaged("corpus 'c': /cache/indexed/c-1 is damaged:\n  - shard_00000.bin has sha256 00, the manifest "
                      "says 11\n  - shard_00000.idx is 3 bytes, the manifest says 4")
    assert error_line(e) == ("corpus 'c': /cache/indexed/c-1 is damaged: shard_00000.bin has sha256 00, the manifest "
                             "says 11; shard_00000.idx is 3 bytes, the manifest says 4")
