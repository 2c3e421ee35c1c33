"""HF ``import`` / ``export`` never delete or overwrite anything (issue 17, case 4), on a tiny
GLM-5: OUT must be absent or empty and apart from the source, the result appears at OUT only
when complete, user errors (missing ``config.json``, a damaged shard, a wrong path) are named
before the model is built, and the CLI prints them without a traceback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from model_providers.glm5.hf import convert as hf_convert

from model_providers.glm5.hf import mapping as hf_mapping
from model_providers.glm5.hf.convert import export_hf, import_hf
from checkpointing.dist_io import CheckpointFileError
from model_providers.glm5.hf.paths import MARKER, PARTIAL_SUFFIX, HFPathError
from tests.support.launch import REPO
from tests.support import hf as hs
def _snapshot(root) -> dict:
    """Every file (relative path -> bytes) and folder under ``root``."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = None
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = fh.read()
    return out


def _import(src, out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_hf(str(src), str(out), mtp_num_steps=0, **kw)


@pytest.fixture(scope="module")
def tiny(one_rank, tmp_path_factory):
    """(HF model, its 20-shard HF folder, its import) under a module tmp root."""
    root = tmp_path_factory.mktemp("hf_safety")
    model = hs.make_model(index_topk=16)
    hf_dir = hs.save_hf(model, str(root / "hf"))
    _import(hf_dir, root / "ckpt")
    return model, hf_dir, str(root / "ckpt")


@pytest.fixture
def no_model_build(monkeypatch):
    """User errors must come before the (meta) model is built or any tensor is read."""
    def refuse(*a, **k):
        raise AssertionError("the model was built before the error")
    monkeypatch.setattr(hf_convert, "meta_model", refuse)
    monkeypatch.setattr(hf_mapping.HFReader, "get", refuse)


def _imported_weights_equal_hf(ckpt, model) -> None:
    from checkpointing.dist_io import load_common
    from model_providers.glm5.hf.convert import config_from_common
    from model_providers.glm5.hf.evaluate import build_eval_model, load_weights
    from parallel.config import ParallelConfig

    chunks, _ = build_eval_model(config_from_common(load_common(ckpt)), ParallelConfig())
    load_weights(ckpt, chunks)
    vocab = hs.TINY["vocab_size"]
    assert torch.equal(chunks[0].embedding.word_embeddings.weight[:vocab], model.model.embed_tokens.weight)
    assert torch.equal(chunks[0].decoder.layers[2].mlp.experts.local_experts[5].linear_fc2.weight,
                       model.model.layers[2].mlp.experts.down_proj[5])


def test_import_into_a_folder_holding_a_user_file_is_refused(tiny, tmp_path, no_model_build):
    _, hf_dir, _ = tiny
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(HFPathError, match=rf"OUT {out} exists and is not empty \(1 entry: notes\.txt\)"):
        _import(hf_dir, out)
    assert _snapshot(tmp_path) == {"mine/": None, "mine/notes.txt": b"my notes"}


@pytest.mark.parametrize("case", ["same", "out_inside_src", "src_inside_out"])
def test_import_overlapping_the_source_is_refused(tiny, tmp_path, case, no_model_build):
    _, hf_dir, _ = tiny
    src = tmp_path / "parent" / "hf"
    shutil.copytree(hf_dir, src)
    os.symlink(src, tmp_path / "alias")  # real paths are compared, not spellings
    out, message = {"same": (tmp_path / "alias", "is the source"),
                    "out_inside_src": (tmp_path / "alias" / "sub", "is inside the source"),
                    "src_inside_out": (tmp_path / "parent", "the source .* is inside OUT")}[case]
    before = _snapshot(tmp_path)
    with pytest.raises(HFPathError, match=message):
        _import(src, out)
    assert _snapshot(tmp_path) == before


def test_export_into_a_run_folder_is_refused(tiny, tmp_path, no_model_build):
    _, _, ckpt = tiny
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / "iter_0000004")
    (run / "checkpoints" / "latest").write_text("iter_0000004")
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 6.2}\n')
    before = _snapshot(tmp_path)
    with pytest.raises(HFPathError, match=r"OUT .*run exists and is not empty \(2 entries: "
                                          r"checkpoints, metrics\.jsonl\)"):
        export_hf(ckpt, str(run))
    with pytest.raises(HFPathError, match=r"the source .*iter_0000004 is inside OUT .*run"):
        export_hf(str(run / "checkpoints" / "iter_0000004"), str(run))
    with pytest.raises(HFPathError, match=r"run is not a megatron dist checkpoint \(metadata\.json and "
                                          r"\.metadata missing\); .* e\.g\. .*run/checkpoints/iter_0000004"):
        export_hf(str(run), str(tmp_path / "hf"))
    assert _snapshot(tmp_path) == before


def test_absent_out_is_written_and_loads(tiny, tmp_path):
    model, hf_dir, ckpt = tiny
    out = tmp_path / "new" / "ckpt"  # the parent is created too
    _import(hf_dir, out)
    assert sorted(os.listdir(tmp_path / "new")) == ["ckpt"]  # no staging folder left
    assert MARKER not in os.listdir(out)
    _imported_weights_equal_hf(str(out), model)
    exported = tmp_path / "exported"
    summary = export_hf(str(out), str(exported))
    assert summary["tensors"] == len(hs.read_hf_tensors(hf_dir)) > 100
    src, dst = hs.read_hf_tensors(hf_dir), hs.read_hf_tensors(str(exported))
    assert sorted(src) == sorted(dst) and all(torch.equal(src[k], dst[k]) for k in src)
    assert sorted(os.listdir(exported)) == ["config.json", "model.safetensors"]


def test_empty_out_folders_are_used(tiny, tmp_path):
    model, hf_dir, ckpt = tiny
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "hf").mkdir()
    _import(hf_dir, tmp_path / "ckpt")
    _imported_weights_equal_hf(str(tmp_path / "ckpt"), model)
    export_hf(ckpt, str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]
    assert "model.safetensors" in os.listdir(tmp_path / "hf")


def test_missing_config_json_is_named(tiny, tmp_path, no_model_build):
    _, hf_dir, _ = tiny
    src = tmp_path / "weights_only"
    shutil.copytree(hf_dir, src)
    os.remove(src / "config.json")
    with pytest.raises(HFPathError, match=rf"{src}/config\.json is missing"):
        _import(src, tmp_path / "out")
    with pytest.raises(HFPathError, match=rf"HF model folder {tmp_path}/absent does not exist"):
        _import(tmp_path / "absent", tmp_path / "out")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), config_only)
    with pytest.raises(HFPathError, match=rf"{config_only} has no weights: neither "
                                          rf"{config_only}/model\.safetensors\.index\.json nor"):
        _import(config_only, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


def test_truncated_shard_is_named(tiny, tmp_path, no_model_build):
    _, hf_dir, _ = tiny
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    shard = src / "model-00007-of-00020.safetensors"
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(HFPathError, match=rf"shard {shard} is damaged or unreadable: .*not fully covered"):
        _import(src, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_truncated_checkpoint_file_is_named(tiny, tmp_path, no_model_build):
    """Export reads a dist checkpoint: a file shorter than its DCP metadata says is named, with
    the first tensor it cuts (the import writes one file per layer: __0_3 is layer 2)."""
    _, _, ckpt = tiny
    src = tmp_path / "ckpt"
    shutil.copytree(ckpt, src)
    os.truncate(src / "__0_3.distcp", 1000)
    with pytest.raises(CheckpointFileError, match=rf"checkpoint file {src}/__0_3\.distcp is truncated: 1000 bytes, "
                                          r"\d+ expected \(decoder\.layers\.2\.\S+ is cut\)"):
        export_hf(str(src), str(tmp_path / "hf"))
    os.remove(src / "__0_5.distcp")
    with pytest.raises(CheckpointFileError, match=rf"{src}/__0_3\.distcp is truncated"):
        export_hf(str(src), str(tmp_path / "hf"))
    shutil.copy(os.path.join(ckpt, "__0_3.distcp"), src / "__0_3.distcp")
    with pytest.raises(CheckpointFileError, match=rf"checkpoint file {src}/__0_5\.distcp is missing "
                                          r"\(it holds decoder\.final_layernorm\.weight"):
        export_hf(str(src), str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_shard_lost_while_reading_names_shard_and_tensor(tiny, tmp_path):
    _, hf_dir, _ = tiny
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    reader = hf_mapping.HFReader(str(src))
    name = "model.layers.1.self_attn.indexer.wk.weight"
    os.remove(src / reader.where[name])
    with pytest.raises(HFPathError, match=rf"shard {src}/{reader.where[name]} is missing \(reading {name}\)"):
        reader.get(name)


def test_interrupted_writes_leave_nothing_at_out(tiny, tmp_path, monkeypatch):
    """An error (or Ctrl-C) midway through import / export removes the staging folder; OUT is
    untouched (absent stays absent, an empty folder stays empty)."""
    _, hf_dir, ckpt = tiny
    reads = []
    real_get = hf_mapping.HFReader.get

    def failing_get(self, name):
        reads.append(name)
        if len(reads) == 30:
            raise RuntimeError("disk went away")
        return real_get(self, name)

    monkeypatch.setattr(hf_mapping.HFReader, "get", failing_get)
    with pytest.raises(RuntimeError, match="disk went away"):
        _import(hf_dir, tmp_path / "ckpt")
    flushes = []
    real_flush = hf_mapping.ShardWriter.flush

    def interrupted_flush(self):
        flushes.append(1)
        if len(flushes) == 3:
            raise KeyboardInterrupt
        real_flush(self)

    monkeypatch.setattr(hf_mapping.ShardWriter, "flush", interrupted_flush)
    (tmp_path / "hf").mkdir()
    with pytest.raises(KeyboardInterrupt):
        export_hf(ckpt, str(tmp_path / "hf"), max_shard_bytes=200_000)
    assert len(reads) == 30 and len(flushes) == 3
    assert _snapshot(tmp_path) == {"hf/": None}


KILLED_IMPORT = r"""
import os, signal, sys, warnings
from model_providers.glm5.hf import mapping as hf_mapping
from model_providers.glm5.hf.convert import import_hf

reads, real_get = [], hf_mapping.HFReader.get
def get(self, name):
    reads.append(name)
    if len(reads) == 60:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_get(self, name)
hf_mapping.HFReader.get = get
warnings.simplefilter("ignore")
import_hf(sys.argv[1], sys.argv[2], mtp_num_steps=0)
"""


@pytest.mark.heavy
def test_killed_import_leaves_only_a_partial_folder_that_a_rerun_replaces(tiny, tmp_path):
    """SIGKILL midway: nothing at OUT, the half-written result in ``<OUT>.partial`` (marked);
    a rerun removes that folder and writes OUT. An unmarked ``<OUT>.partial`` (not this tool's)
    is never removed."""
    model, hf_dir, _ = tiny
    out, partial = tmp_path / "ckpt", tmp_path / ("ckpt" + PARTIAL_SUFFIX)
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", KILLED_IMPORT, hf_dir, str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == [partial.name]
    left = os.listdir(partial)
    assert MARKER in left and any(f.endswith(".distcp") for f in left)
    assert "metadata.json" not in left
    _import(hf_dir, out)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _imported_weights_equal_hf(str(out), model)

    other = tmp_path / "other"
    (tmp_path / ("other" + PARTIAL_SUFFIX)).mkdir()
    (tmp_path / ("other" + PARTIAL_SUFFIX) / "mine.txt").write_text("keep")
    with pytest.raises(HFPathError, match=r"other\.partial exists and was not made by this tool"):
        _import(hf_dir, other)
    assert (tmp_path / ("other" + PARTIAL_SUFFIX) / "mine.txt").read_text() == "keep"
    assert not other.exists()


@pytest.mark.heavy
def test_cli_reports_user_errors_without_traceback(tiny, tmp_path):
    _, hf_dir, ckpt = tiny
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    before = _snapshot(hf_dir)
    proc = subprocess.run([sys.executable, "-m", "model_providers.glm5.hf", "import", hf_dir, hf_dir],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: OUT {hf_dir} is the source {hf_dir}: write the result to a new folder"
    assert proc.stdout == ""
    assert _snapshot(hf_dir) == before

    from model_providers.glm5.hf.cli import main

    np.save(tmp_path / "ids.npy", hs.tokens().numpy())
    ids = str(tmp_path / "ids.npy")
    cases = {("--hf", str(tmp_path / "nope"), "--tokens", ids): f"HF model folder {tmp_path}/nope does not exist",
             ("--checkpoint", str(tmp_path / "nope"), "--tokens", ids):
                 f"checkpoint folder {tmp_path}/nope does not exist",
             ("--hf", ckpt, "--tokens", ids): f"{ckpt}/config.json is missing",
             ("--checkpoint", hf_dir, "--tokens", ids): f"{hf_dir} is not a megatron dist checkpoint",
             ("--checkpoint", ckpt, "--tokens", str(tmp_path / "x.npy")):
                 f"--tokens {tmp_path}/x.npy does not exist"}
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as e:
            main(["loss", *argv])
        assert str(e.value.code).startswith(f"error: {message}"), (argv, e.value.code)


def test_loss_refuses_tokens_that_are_not_integer_ids(tmp_path):
    """Before any checkpoint or model: float ids would be truncated to other tokens; an object
    array is refused unread (no pickle)."""
    from model_providers.glm5.hf.cli import main

    np.save(tmp_path / "f.npy", np.full((1, 8), 3.7))
    np.save(tmp_path / "o.npy", np.array([[object()]], dtype=object), allow_pickle=True)
    for name, message in (("f.npy", "holds float64 values: token ids must be an integer array"),
                          ("o.npy", "is not a numpy integer array")):
        with pytest.raises(SystemExit) as e:
            main(["loss", "--checkpoint", str(tmp_path / "none"), "--tokens", str(tmp_path / name)])
        assert str(e.value.code).startswith(f"error: --tokens {tmp_path / name}") and message in str(e.value.code)


def _rewrite_one_tensor(src, change) -> str:
    """Copy of a shard of ``src`` with its first tensor replaced by ``change(tensor)``."""
    from safetensors.torch import load_file, save_file

    shard = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))[3]
    tensors = load_file(os.path.join(src, shard))
    name = sorted(tensors)[0]
    tensors[name] = change(tensors[name])
    save_file(tensors, os.path.join(src, shard), metadata={"format": "pt"})
    return name


def test_a_tensor_of_another_dtype_is_refused_before_the_model(tiny, tmp_path, no_model_build):
    _, hf_dir, _ = tiny
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    name = _rewrite_one_tensor(src, lambda t: t.to(torch.int8))
    with pytest.raises(HFPathError, match=rf"1 tensors in {src} are not stored as a weight dtype "
                                          rf"\(F32, BF16, F16\): {re.escape(name)} \(I8\)"):
        _import(src, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_tensor_of_another_shape_is_refused_before_writing(tiny, tmp_path):
    _, hf_dir, _ = tiny
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    name = _rewrite_one_tensor(src, lambda t: t[..., :-1].contiguous())
    with pytest.raises(HFPathError, match=rf"1 tensors in {src} do not have the shapes config\.json gives: "
                                          rf".* <- .*{re.escape(name)} \(\d+, \d+\).*, expected \(\d+, \d+\)"):
        _import(src, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["hf"]
