"""Checkpoints with megatron dist_checkpointing (torch_dist format), written atomically.

Layout: ``<dir>/iter_<step:07d>/`` per save and a ``latest`` file naming the newest complete
one. A save goes to ``iter_<step>.tmp``; after every rank finished, rank 0 writes
``manifest.json`` (every file's size) into it, fsyncs the files, renames the folder, fsyncs the
parent and replaces ``latest`` last, so a crash never leaves something that looks complete.
What is on disk -- the manifest, finding the newest complete checkpoint, naming a failed save's
cause -- is :mod:`checkpointing.files`; this module is the state a checkpoint holds.
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
from torch.distributed.checkpoint.api import CheckpointException

from checkpointing import backend_keys
from parallel.megatron_compat import cpu_emulation

from checkpointing.files import (  # noqa: F401 -- what a checkpoint is on disk, used with it
    LATEST, MANIFEST, STAGE_FINAL, CheckpointSaveError, apply_retention, fsync, fsync_tree, iter_dir,
    latest_checkpoint, resolve_init_from, save_failure, verify, write_atomic, write_manifest)


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
    if optimizer is not None:  # it finds each param's sharded tensor in every chunk's (nested) dict:
        # merged into one dict, chunks whose local keys coincide would hide each other's params
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=is_loading, metadata=meta)
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
    sd[backend_keys.COMMON_KEY] = backend_keys.model_backend(model_chunks)  # its tensor names
    try:
        dist_checkpointing.save(sd, tmp)
    except (Exception, CheckpointException) as e:  # every rank raises: megatron gathers the write
        # results; torch's CheckpointException is a BaseException
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(save_failure(final, tmp, e)) from e
    dist.barrier()
    if dist.get_rank() == 0:
        if stage_final:
            write_atomic(os.path.join(tmp, STAGE_FINAL), state.stage)
        write_manifest(tmp)
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        fsync(ckpt_dir)
        write_atomic(os.path.join(ckpt_dir, LATEST), os.path.basename(final))
        apply_retention(ckpt_dir, keep_last)
    dist.barrier()
    return final


def read_common(path: str) -> dict:
    """A checkpoint's common state: train state, scheduler, config, world size (no model needed)."""
    return dist_checkpointing.load_common_state_dict(path)


def read_train_state(path: str) -> dict:
    """The train state stored in a checkpoint (no process group or model needed)."""
    return dict(read_common(path)["train_state"])


def load(path: str, model_chunks, optimizer=None, scheduler=None) -> TrainState:
    """Load weights (and optimizer, scheduler, RNG and position when given an optimizer).
    Weights reshard to this rank's layout; RNG is restored only at the same world size. A
    checkpoint written by the other layer backend (local <-> Transformer Engine, e.g. an HF
    import or a CPU run starting a GPU run) loads through ``backend_keys``' name map."""
    full = optimizer is not None
    common = dist_checkpointing.load_common_state_dict(path)
    same_world = common.get("world_size") == dist.get_world_size()
    sd = sharded_state(model_chunks, optimizer if full else None, is_loading=True,
                       with_rng=full and same_world)
    restore = backend_keys.adapt_to_checkpoint(sd, backend_keys.model_backend(model_chunks),
                                               backend_keys.checkpoint_backend(path, common))
    loaded = restore(dist_checkpointing.load(sd, path))
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(loaded[_model_key(i)], strict=True)
    if not full:
        return TrainState()
    optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.num_steps = 0  # megatron's load_state_dict *adds* the saved step count
        scheduler.load_state_dict(common["scheduler"])
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    return TrainState(**common["train_state"])

