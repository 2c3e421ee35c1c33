"""A checkpoint's ``.metadata`` never runs code (``checkpointing/safe_metadata.py``): torch's DCP
reader unpickles it through an allowlist, and every path that opens a checkpoint -- resume,
``checkpoint.init_from``, the HF tool's ``export`` and ``loss`` -- refuses a crafted one in one
``error:`` line naming the file and the class, without running it and without writing."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess

import numpy as np
import pytest
import torch

import checkpointing  # noqa: F401 -- installs the restricted reader
from checkpointing import safe_metadata
from checkpointing import state as checkpoint
from tests.support.launch import QUIET, REPO, train_command, train_env


class _Payload:
    """Pickles as a call of ``os.system`` that leaves ``marker`` behind."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _crafted_checkpoint(folder, marker) -> str:
    """A folder that passes every check before the metadata is read (manifest sizes,
    ``metadata.json``) and whose ``.metadata`` would run ``touch marker``."""
    os.makedirs(folder)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(folder, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 64)
    checkpoint.write_manifest(str(folder))
    return str(folder)


def test_dcp_metadata_loads_and_a_payload_is_refused_unrun(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import save as dcp_save

    sd = {"w": torch.randn(4, 3).bfloat16(), "b": torch.arange(5), "extra": {"step": 3}}
    written = dcp_save(sd, checkpoint_id=str(tmp_path / "ok"), no_dist=True)  # the Metadata it pickled
    assert FileSystemReader(str(tmp_path / "ok")).read_metadata().state_dict_metadata == written.state_dict_metadata

    marker = tmp_path / "ran"
    folder = _crafted_checkpoint(tmp_path / "bad", marker)
    with pytest.raises(safe_metadata.UnsafeCheckpointError,
                       match=rf"{folder}/\.metadata names posix\.system, which a checkpoint's metadata never holds"):
        FileSystemReader(folder).read_metadata()
    for module, name in (("builtins", "eval"), ("subprocess", "Popen"), ("torch", "load"), ("torch", "nn")):
        with pytest.raises(safe_metadata.UnsafeCheckpointError, match=rf"{module}\.{name}"):
            safe_metadata._MetadataUnpickler(io.BytesIO(), "x").find_class(module, name)
    assert not marker.exists()


def _one_error_line(proc, folder: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert f"{folder}/.metadata names posix.system" in lines[0] and "Traceback" not in proc.stderr, lines


@pytest.mark.heavy
def test_resume_refuses_a_crafted_metadata_in_one_line(tmp_path):
    """The run: its latest checkpoint's metadata is checked on rank 0 before anything is read
    from it or written to the run dir."""
    marker = tmp_path / "ran"
    run_dir = tmp_path / "run"
    resumed = _crafted_checkpoint(run_dir / "checkpoints" / "iter_0000002", marker)
    (run_dir / "checkpoints" / "latest").write_text("iter_0000002")
    before = sorted(os.listdir(resumed))
    proc = subprocess.run(train_command([*QUIET, f"trainer.run_dir={run_dir}", "trainer.steps=3"]), cwd=REPO,
                          env=train_env(1), capture_output=True, text=True, timeout=300)
    _one_error_line(proc, resumed)
    assert not marker.exists() and sorted(os.listdir(resumed)) == before
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()


def test_init_from_and_the_hf_tool_refuse_a_crafted_metadata(tmp_path):
    """``checkpoint.init_from`` at validation (before the run dir exists), ``hf export`` and
    ``hf loss``: the same refusal, as their one error line."""
    from model_providers.glm5.hf.cli import main as hf_main
    from pretrain.config.errors import ConfigError
    from pretrain.config.schema import compose, to_run_config
    from pretrain.config.validation import plan_run

    marker = tmp_path / "ran"
    crafted = _crafted_checkpoint(tmp_path / "crafted", marker)
    refusal = f"{crafted}/.metadata names posix.system, which a checkpoint's metadata never holds"
    rc = to_run_config(compose([*QUIET, f"trainer.run_dir={tmp_path / 'fresh'}", f"checkpoint.init_from={crafted}"]))
    with pytest.raises(ConfigError) as e:
        plan_run(rc, 1)
    assert e.value.problems == [f"checkpoint.init_from={crafted}: {refusal}: refused without running it "
                                f"(the file was not written by torch's checkpoint writer)"]
    np.save(tmp_path / "ids.npy", np.zeros((1, 8), dtype=np.int64))
    for argv in (["export", crafted, str(tmp_path / "hf")],
                 ["loss", "--checkpoint", crafted, "--tokens", str(tmp_path / "ids.npy")]):
        with pytest.raises(SystemExit) as e:
            hf_main(argv)
        assert str(e.value.code).startswith(f"error: {refusal}"), (argv, e.value.code)
    assert not marker.exists() and not (tmp_path / "hf").exists() and not (tmp_path / "fresh").exists()
