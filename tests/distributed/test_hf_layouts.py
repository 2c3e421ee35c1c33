"""An imported HF checkpoint loads at any layout: the ``loss`` CLI at TP2 x PP2 x EP2 (4 gloo
ranks, expert TP 1) gives the next-token loss of the same model on one rank and of transformers;
``pretrain.train checkpoint.init_from=IMPORT`` starts from exactly the imported weights (its
step-0 checkpoint holds the same tensors, bit for bit), and exporting that training checkpoint
gives back the original HF tensors."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.support.launch import REPO, checkpoint_tensors, free_port, run_train, train_env
from tests.support import core_gate, hf as hs
REL_LAYOUT = 1e-5  #: between our layouts (fp32; only reduction order differs)
REL_HF = 1e-4  #: ours vs transformers


def _cli(args: list[str], nproc: int = 1) -> dict:
    module = ["-m", "model_providers.glm5.hf", *args]
    cmd = [sys.executable, *module] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", *module]
    with core_gate.whole_machine() if nproc > 1 else contextlib.nullcontext():
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(nproc), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Import (in this process, on a private 1-rank group), then the 1-rank and transformers
    losses of the same tokens."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from checkpointing.dist_io import load_common
    from model_providers.glm5.hf.convert import config_from_common, ensure_one_rank, import_hf
    from model_providers.glm5.hf.evaluate import (
        build_eval_model, hf_next_token_loss, load_weights, next_token_loss)
    from parallel.config import ParallelConfig

    root = tmp_path_factory.mktemp("hf_layouts")
    model = hs.make_model(index_topk=16)
    mods = hs.mtp_modules(model.config)
    hf_dir = hs.save_hf(model, str(root / "hf"), extra=hs.mtp_tensors(model, mods))
    ckpt = str(root / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = hs.well_separated_tokens(model, batch=4)
        ensure_one_rank()
        try:
            assert import_hf(hf_dir, ckpt, mtp_num_steps=3)["mtp_initialised"] is False
            chunks, _ = build_eval_model(config_from_common(load_common(ckpt)), ParallelConfig())
            load_weights(ckpt, chunks)
            one = next_token_loss(chunks, tokens)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        ref = hf_next_token_loss(hf_dir, tokens)
    np.save(root / "ids.npy", tokens.numpy().astype(np.int64))
    return root, ckpt, str(root / "ids.npy"), one, ref, hf_dir


@pytest.mark.heavy
def test_loss_cli_at_tp2_pp2_ep2_equals_one_rank_and_transformers(imported):
    root, ckpt, ids, (one, n_one), (ref, n_ref), _ = imported
    four = _cli(["loss", "--checkpoint", ckpt, "--tokens", ids, "--tp", "2", "--pp", "2", "--ep", "2",
                 "--etp", "1", "--cpu-emulation", "strict"], nproc=4)
    print(f"\nloss: 1 rank {one:.9f}, TP2xPP2xEP2 {four['loss']:.9f}, transformers {ref:.9f}")
    assert n_one == four["tokens"] == n_ref == 4 * (hs.SEQ - 1)
    assert four["loss"] == pytest.approx(one, rel=REL_LAYOUT)
    assert one == pytest.approx(ref, rel=REL_HF)
    assert 3.0 < one < 20.0


def _model_overrides(ckpt: str) -> list[str]:
    """Hydra overrides describing the imported architecture (the import writes them as YAML)."""
    model = OmegaConf.to_container(OmegaConf.load(os.path.join(ckpt, "glm5_model.yaml")))

    def flat(prefix, node):
        for k, v in node.items():
            if isinstance(v, dict):  # nested groups (dsa, yarn): one override per leaf
                yield from flat(f"{prefix}.{k}", v)
            else:
                yield f"{prefix}.{k}={'null' if v is None else v}"

    return list(flat("model", model))


@pytest.mark.heavy
def test_training_run_starts_from_the_import(imported):
    root, ckpt, *_, hf_dir = imported
    run_dir = root / "train"
    run_train([f"trainer.run_dir={run_dir}", "trainer.steps=0", f"checkpoint.init_from={ckpt}",
               *_model_overrides(ckpt)])
    saved = run_dir / "checkpoints" / "iter_0000000"
    want = checkpoint_tensors(ckpt, root)
    got = checkpoint_tensors(saved, root)
    assert len(want) > 100
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    exported = _cli(["export", str(saved), str(root / "export")])
    src, dst = hs.read_hf_tensors(hf_dir), hs.read_hf_tensors(exported["hf_dir"])
    assert sorted(src) == sorted(dst)
    assert all(torch.equal(src[k], dst[k]) for k in src)
