"""What a checkpoint holds (megatron dist_checkpointing, torch_dist format) and loading it.

The sharded state dict of model chunks, optimizer (in ``OPTIMIZER_FORMAT``, or the reshardable
one at a stage boundary that needs it), scheduler, RNG and the run's position; loading it back
with megatron's fully parallel load. Writing it atomically (``iter_<step>.tmp``, then manifest,
rename, ``latest``), in the background when asked, is :mod:`checkpointing.writer`; what is on disk
-- the manifest, finding the newest complete checkpoint, naming a failed save's cause -- is
:mod:`checkpointing.files`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from checkpointing import backend_keys
from parallel.megatron_compat import cpu_emulation, model_space_shards

from checkpointing.files import (  # noqa: F401 -- what a checkpoint is on disk, used with it
    START_ELSEWHERE, NoCompleteCheckpoint, apply_retention, holds_checkpoints, latest_checkpoint,
    resolve_init_from, save_failure, verify, write_manifest)


#: how the distributed optimizer's state is stored. ``dp_reshardable`` (megatron's): each rank
#: writes and reads only its own shard of the optimizer's flat buffers, with no gather and no
#: exchange; a checkpoint in it loads at another data-parallel size but only with the same
#: model-parallel layout (:func:`optimizer_layout_problem`). megatron-core 0.19.2's
#: ``fully_sharded_model_space`` would reshard anywhere but is no longer supported there
#: (``ShardedTensor.flattened_range is not supported``).
OPTIMIZER_FORMAT = "dp_reshardable"
#: the format that loads into any layout, each rank saving and loading only its own share, in
#: model space (``parallel.megatron_compat.model_space_shards``). Written only where a layout
#: change needs it: the final checkpoint of a stage whose successor carries the optimizer state
#: into another layout
RESHARDABLE_OPTIMIZER_FORMAT = model_space_shards.FORMAT
#: megatron's format that loads into any layout: every DP rank all-gathers its model shard's whole
#: optimizer state into host memory to save it. Checkpoints of this project before
#: dp_reshardable, and stage ends before model_space_shards, are in it: they still load
GATHERED_OPTIMIZER_FORMAT = "fully_reshardable"
#: common-state keys: a checkpoint's optimizer format (absent: the reshardable one) and the
#: model-parallel layout its optimizer state was written for
FORMAT_KEY = "optimizer_format"
LAYOUT_KEY = "optimizer_layout"


def model_parallel_layout(par) -> dict:
    """What a ``dp_reshardable`` optimizer state depends on: everything of the parallel layout
    but the data-parallel size (``parallel.config.ParallelConfig``)."""
    keys = ("tp", "pp", "vpp", "cp", "ep", "expert_tp", "first_stage_layers", "last_stage_layers",
            "pipeline_layout", "distributed_optimizer")
    return {k: getattr(par, k) for k in keys}


def optimizer_layout_changes(par, next_par) -> bool:
    """A ``dp_reshardable`` optimizer state written in layout ``par`` cannot load in ``next_par``."""
    return model_parallel_layout(par) != model_parallel_layout(next_par)


def optimizer_layout_problem(common: dict, par) -> Optional[str]:
    """Why the optimizer state of a checkpoint (its common state) cannot load into layout ``par``,
    or None: a ``dp_reshardable`` one needs the model-parallel layout it was written with."""
    if checkpoint_format(common) != OPTIMIZER_FORMAT:
        return None
    saved, now = common.get(LAYOUT_KEY, {}), model_parallel_layout(par)
    diff = [f"parallel.{k}={now[k]} (the checkpoint's: {saved.get(k)})" for k in now if saved.get(k) != now[k]]
    if not diff:
        return None
    return (f"{', '.join(diff)}: this checkpoint's optimizer state is sharded for its own model-parallel "
            f"layout (only the data-parallel size may change when resuming inside a stage); resume "
            f"with its layout, or change layouts at a stage boundary")


def _sharding_metadata(optimizer_format: str = OPTIMIZER_FORMAT) -> dict:
    return {
        "distrib_optim_sharding_type": optimizer_format,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def checkpoint_format(common: dict) -> str:
    """The optimizer format a checkpoint was written in, from its common state."""
    return common.get(FORMAT_KEY, GATHERED_OPTIMIZER_FORMAT)


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


def sharded_state(model_chunks, optimizer=None, is_loading=False, with_rng=True,
                  optimizer_format: str = OPTIMIZER_FORMAT) -> dict:
    meta = _sharding_metadata(optimizer_format)
    sd = {}
    for i, chunk in enumerate(model_chunks):
        sd[_model_key(i)] = chunk.sharded_state_dict(metadata=meta)
    if optimizer is not None:  # it finds each param's sharded tensor in every chunk's (nested) dict:
        # merged into one dict, chunks whose local keys coincide would hide each other's params
        if optimizer_format == model_space_shards.FORMAT:
            sd["optimizer"] = model_space_shards.sharded_state_dict(optimizer, dict(sd), is_loading, meta)
        else:
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


def full_state(model_chunks, optimizer, scheduler, state: TrainState, config_yaml: str, par,
               reshardable: bool = False) -> dict:
    """Everything a checkpoint holds to resume bit-exactly, as megatron's sharded state dict;
    ``reshardable``: the optimizer state in the format any layout loads."""
    optimizer_format = RESHARDABLE_OPTIMIZER_FORMAT if reshardable else OPTIMIZER_FORMAT
    sd = sharded_state(model_chunks, optimizer, optimizer_format=optimizer_format)
    sd[FORMAT_KEY] = optimizer_format
    sd[LAYOUT_KEY] = model_parallel_layout(par)
    sd["scheduler"] = scheduler.state_dict()
    sd["train_state"] = vars(state).copy()
    sd["config_yaml"] = config_yaml
    sd["world_size"] = dist.get_world_size()
    sd[backend_keys.COMMON_KEY] = backend_keys.model_backend(model_chunks)  # its tensor names
    return sd


def parallel_load_strategy(path: str):
    """megatron's fully parallel load: the data-parallel ranks split the reads of what they all
    need (replicated weights, a legacy checkpoint's whole optimizer state) and exchange it, so a
    restart reads the checkpoint about once instead of once per data-parallel rank."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(path),
        parallel_state.get_data_parallel_group(with_context_parallel=True))


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
                       with_rng=full and same_world, optimizer_format=checkpoint_format(common))
    restore = backend_keys.adapt_to_checkpoint(sd, backend_keys.model_backend(model_chunks),
                                               backend_keys.checkpoint_backend(path, common))
    loaded = restore(dist_checkpointing.load(sd, path, sharded_strategy=parallel_load_strategy(path)))
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(loaded[_model_key(i)], strict=True)
    if not full:
        return TrainState()
    optimizer.load_state_dict(model_space_shards.joined(loaded["optimizer"]))
    if scheduler is not None:
        scheduler.num_steps = 0  # megatron's load_state_dict *adds* the saved step count
        scheduler.load_state_dict(common["scheduler"])
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    return TrainState(**common["train_state"])

