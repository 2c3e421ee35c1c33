"""Checkpoints with megatron dist_checkpointing (torch_dist format), written atomically.

Layout: ``<dir>/iter_<step:07d>/`` per save and a ``latest`` file naming the newest complete
one. A save goes to ``iter_<step>.tmp`` and is renamed only after every rank finished, and
``latest`` is replaced last, so a crash never leaves something that looks complete.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from parallel import cpu_emulation

LATEST = "latest"
STAGE_FINAL = "STAGE_FINAL"  #: marker file in a stage's final checkpoint; retention keeps those


def _sharding_metadata() -> dict:
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def _model_key(i: int) -> str:
    return f"model{i}"


def _rng_state() -> dict:
    cuda_state = (
        cpu_emulation.cuda_generator.get_state() if cpu_emulation.is_active()
        else torch.cuda.get_rng_state()
    )
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda_state,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if cpu_emulation.is_active():
        cpu_emulation.cuda_generator.set_state(state["cuda"])
    else:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded() -> ShardedObject:
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)


def sharded_state(model_chunks, optimizer=None, is_loading=False, with_rng=True) -> dict:
    meta = _sharding_metadata()
    sd = {}
    for i, chunk in enumerate(model_chunks):
        sd[_model_key(i)] = chunk.sharded_state_dict(metadata=meta)
    if optimizer is not None:
        model_sd = {}
        for i in range(len(model_chunks)):
            model_sd.update(sd[_model_key(i)])
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta)
    if with_rng:
        sd["rng_state"] = _rng_sharded()
    return sd


@dataclass
class TrainState:
    """The run's position. ``step`` and ``consumed_tokens`` count from the run's start;
    ``stage_step`` and ``consumed_samples`` (the data position) from the current stage's start,
    whose dataset they index. ``category_tokens`` counts consumed tokens per data category over
    the whole run, ``tokens_before_stage`` the part of it from finished stages."""

    step: int = 0
    consumed_samples: int = 0
    wandb_run_id: Optional[str] = None
    stage: str = ""
    stage_step: int = 0
    consumed_tokens: int = 0
    category_tokens: dict = field(default_factory=dict)
    tokens_before_stage: dict = field(default_factory=dict)


def iter_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"iter_{step:07d}")


def latest_checkpoint(ckpt_dir: str) -> Optional[str]:
    """The newest complete checkpoint folder, or None."""
    pointer = os.path.join(ckpt_dir, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(ckpt_dir, name)
    return path if os.path.isdir(path) else None


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def save(ckpt_dir: str, model_chunks, optimizer, scheduler, state: TrainState, config_yaml: str,
         keep_last: int = 0, stage_final: bool = False) -> str:
    """Save everything needed to resume bit-exactly; returns the final folder. A stage's final
    checkpoint is marked and never removed by ``keep_last`` retention."""
    final = iter_dir(ckpt_dir, state.step)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    sd = sharded_state(model_chunks, optimizer)
    sd["scheduler"] = scheduler.state_dict()
    sd["train_state"] = vars(state).copy()
    sd["config_yaml"] = config_yaml
    sd["world_size"] = dist.get_world_size()
    dist_checkpointing.save(sd, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        if stage_final:
            _write_atomic(os.path.join(tmp, STAGE_FINAL), state.stage)
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _write_atomic(os.path.join(ckpt_dir, LATEST), os.path.basename(final))
        _apply_retention(ckpt_dir, keep_last)
    dist.barrier()
    return final


def _apply_retention(ckpt_dir: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints and every stage's final one."""
    if keep_last <= 0:
        return
    done = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("iter_") and not d.endswith(".tmp"))
    for old in done[:-keep_last]:
        if os.path.exists(os.path.join(ckpt_dir, old, STAGE_FINAL)):
            continue
        shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)


def read_train_state(path: str) -> dict:
    """The train state stored in a checkpoint (no process group or model needed)."""
    return dict(dist_checkpointing.load_common_state_dict(path)["train_state"])


def load(path: str, model_chunks, optimizer=None, scheduler=None) -> TrainState:
    """Load weights (and optimizer, scheduler, RNG and position when given an optimizer).
    Weights reshard to this rank's layout; RNG is restored only at the same world size."""
    full = optimizer is not None
    common = dist_checkpointing.load_common_state_dict(path)
    same_world = common.get("world_size") == dist.get_world_size()
    sd = sharded_state(model_chunks, optimizer if full else None, is_loading=True,
                       with_rng=full and same_world)
    loaded = dist_checkpointing.load(sd, path)
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(loaded[_model_key(i)], strict=True)
    if not full:
        return TrainState()
    optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(common["scheduler"])
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    return TrainState(**common["train_state"])

