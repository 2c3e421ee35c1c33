"""Checkpoints with megatron dist_checkpointing (torch_dist format), written atomically.

Layout: ``<dir>/iter_<step:07d>/`` per save and a ``latest`` file naming the newest complete
one. A save goes to ``iter_<step>.tmp``; after every rank finished, rank 0 writes
``manifest.json`` (every file's size) into it, fsyncs the files, renames the folder, fsyncs the
parent and replaces ``latest`` last, so a crash never leaves something that looks complete.
Resuming verifies the folder against its manifest and falls back, with a warning, to the newest
older folder that verifies (a truncated or missing file, a lost manifest, a dangling ``latest``).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import shutil
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async

from model_providers.glm5 import backend_keys
from parallel import cpu_emulation

LATEST = "latest"
STAGE_FINAL = "STAGE_FINAL"  #: marker file in a stage's final checkpoint; retention keeps those
MANIFEST = "manifest.json"

log = logging.getLogger(__name__)


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


def write_manifest(folder: str) -> None:
    """Record every file's size (relative path -> bytes), written last into the folder.
    Sizes, not hashes: truncation and missing files are what a crash or a partial copy leaves,
    and hashing a multi-terabyte checkpoint on every resume would cost minutes."""
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, folder)] = os.path.getsize(full)
    _write_atomic(os.path.join(folder, MANIFEST), json.dumps({"files": files}, indent=0, sort_keys=True))


def verify(folder: str) -> Optional[str]:
    """None when ``folder`` holds every file of its manifest at the recorded size, else why not."""
    manifest = os.path.join(folder, MANIFEST)
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"no readable {MANIFEST} ({e.__class__.__name__})"
    if "metadata.json" not in files:
        return f"{MANIFEST} lists no metadata.json"
    for rel, size in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} has {os.path.getsize(path)} bytes, {size} expected"
    return None


def latest_checkpoint(ckpt_dir: str) -> Optional[str]:
    """The newest complete checkpoint folder, or None: ``latest`` when it verifies, else the
    newest older ``iter_*`` folder that does (with a warning naming what was wrong)."""
    if not os.path.isdir(ckpt_dir):
        return None
    pointer = os.path.join(ckpt_dir, LATEST)
    named = None
    if os.path.exists(pointer):
        with open(pointer) as f:
            named = f.read().strip()
    done = sorted((d for d in os.listdir(ckpt_dir) if d.startswith("iter_") and not d.endswith(".tmp")),
                  reverse=True)
    if named is None and not done:
        return None
    if named is not None:  # `latest` is the commit point: a newer folder was never committed
        done = [d for d in done if d <= named]
        if named not in done:
            done.insert(0, named)
    problems = []
    for name in done:
        path = os.path.join(ckpt_dir, name)
        why = verify(path) if os.path.isdir(path) else "folder is missing"
        if why is None:
            if problems:
                _warn(f"checkpoint fallback to {path}: " + "; ".join(problems))
            return path
        problems.append(f"{name}: {why}")
    raise RuntimeError(f"no complete checkpoint in {ckpt_dir} ({'; '.join(problems)}); refusing to "
                       "start from scratch over them: move them away or set checkpoint.resume=false")


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(message)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(os.path.abspath(path)))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """File contents and directory entries of a tree, so a rename after it publishes data."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def _in_process_write_results() -> None:
    """megatron's torch_dist writer hands its write results back through a queue served by a
    *spawned* multiprocessing Manager: a fresh interpreter per rank that re-imports the training
    entry point at the first save (5-10 s of CPU per rank). That queue only has to cross processes
    for asynchronous saves; ours are synchronous (the write runs in this process, its forked
    writers report through their own queue), so a plain in-process queue carries the results."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


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
    _in_process_write_results()
    dist_checkpointing.save(sd, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        if stage_final:
            _write_atomic(os.path.join(tmp, STAGE_FINAL), state.stage)
        write_manifest(tmp)
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _fsync(ckpt_dir)
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

