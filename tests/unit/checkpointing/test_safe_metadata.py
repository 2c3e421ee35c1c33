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
import sys

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
    ``metadata.json``, ``common.pt``) and whose ``.metadata`` would run ``touch marker``."""
    os.makedirs(folder)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    torch.save({"iteration": 2}, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 64)
    checkpoint.write_manifest(str(folder))
    return str(folder)


def test_dcp_metadata_loads_and_a_payload_is_refused_unrun(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import save as dcp_save

    sd = {"w": torch.randn(4, 3).bfloat16(), "b": torch.arange(5), "extra": {"step": 3}}
    dcp_save(sd, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    with open(tmp_path / "ok" / ".metadata", "rb") as f:
        plain = pickle.load(f)
    assert FileSystemReader(str(tmp_path / "ok")).read_metadata().state_dict_metadata == plain.state_dict_metadata

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
def test_every_path_that_opens_a_checkpoint_refuses_a_crafted_metadata(tmp_path):
    marker = tmp_path / "ran"
    crafted = _crafted_checkpoint(tmp_path / "crafted", marker)
    run_dir = tmp_path / "run"  # resume: the run dir's latest checkpoint is the crafted one
    resumed = _crafted_checkpoint(run_dir / "checkpoints" / "iter_0000002", marker)
    (run_dir / "checkpoints" / "latest").write_text("iter_0000002")
    before = sorted(os.listdir(resumed))
    np.save(tmp_path / "ids.npy", np.zeros((1, 8), dtype=np.int64))
    env = train_env(1)
    runs = {
        resumed: train_command([*QUIET, f"trainer.run_dir={run_dir}", "trainer.steps=3"]),
        crafted: train_command([*QUIET, f"trainer.run_dir={tmp_path / 'fresh'}", "trainer.steps=3",
                                f"checkpoint.init_from={crafted}"]),
    }
    hf = [sys.executable, "-m", "model_providers.glm5.hf"]
    for folder, argv in [*runs.items(), (crafted, [*hf, "export", crafted, str(tmp_path / "hf")]),
                         (crafted, [*hf, "loss", "--checkpoint", crafted, "--tokens", str(tmp_path / "ids.npy")])]:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        _one_error_line(proc, folder)
    assert not marker.exists()
    assert sorted(os.listdir(resumed)) == before and not (tmp_path / "hf").exists()
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
    assert not (tmp_path / "fresh").exists()
