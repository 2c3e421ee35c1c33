"""Start torch.distributed and megatron-core's process groups from torchrun or Slurm variables."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from parallel import megatron_compat
from parallel.config import ParallelConfig
from parallel.megatron_compat import cpu_emulation


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  #: "torchrun", "slurm" or "single"

    @classmethod
    def one_process(cls) -> "DistEnv":
        """Rank 0 of 1 on a free local port (one-process tools and tests)."""
        return cls(0, 1, 0, "127.0.0.1", free_port(), "single")


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list (``node[003-010,012],other`` -> ``node003``); uses
    ``scontrol show hostnames`` when available, else parses the common bracket form."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env(environ=None) -> DistEnv:
    """Rank layout of this process: torchrun variables win, then Slurm's, else one process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
            master_port=int(env.get("MASTER_PORT") or 20000 + job_id % 20000),
            launcher="slurm",
        )
    return DistEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT") or free_port()), "single")


def set_seeds(seed: int) -> None:
    """Seed python, numpy and torch identically on every rank (as megatron's own init does)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def spans_nodes(environ=None) -> bool:
    """Whether this launch's ranks are on more than one node, from the launcher's variables (read
    as :func:`dist_env` reads them): torchrun's ``WORLD_SIZE`` against ``LOCAL_WORLD_SIZE`` (its
    ``GROUP_WORLD_SIZE``, the node count, without it); Slurm's step node count
    (``SLURM_STEP_NUM_NODES``, else the job's ``SLURM_JOB_NUM_NODES`` / ``SLURM_NNODES``). Several
    ranks whose launcher says neither count as several nodes (a run that cannot time out on its
    data asks for it prepared); one process never does."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        if env.get("LOCAL_WORLD_SIZE"):
            return world > int(env["LOCAL_WORLD_SIZE"])
        if env.get("GROUP_WORLD_SIZE"):
            return int(env["GROUP_WORLD_SIZE"]) > 1
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        for var in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
            if env.get(var):
                return int(env[var]) > 1
    else:
        return False
    return world > 1


def process_group_timeout(minutes: float) -> timedelta:
    """``init_process_group``'s timeout (and every collective's) from ``parallel.timeout_minutes``."""
    if not minutes > 0:
        raise ValueError(f"parallel.timeout_minutes={minutes} must be > 0")
    return timedelta(minutes=minutes)


def start_process_group(env: DistEnv, timeout_minutes: float = ParallelConfig.timeout_minutes,
                        cpu_emulation_mode: str = "plain") -> str:
    """init_process_group with NCCL when CUDA is present, gloo otherwise (with the CPU emulation,
    ``plain`` or ``strict``), waiting up to ``timeout_minutes`` (``parallel.timeout_minutes``) for
    the other ranks and in every collective. Returns the backend. megatron-core's fixes are
    installed first, on every backend (:mod:`parallel.megatron_compat`)."""
    megatron_compat.install()
    if dist.is_initialized():
        return dist.get_backend()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    else:
        cpu_emulation.install(strict=cpu_emulation_mode == "strict")
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=process_group_timeout(timeout_minutes),
    )
    return backend


def _layout_key(par: ParallelConfig) -> tuple:
    return (par.tp, par.pp, par.vpp if par.vpp and par.vpp > 1 else None, par.cp, par.ep, par.expert_tp)


def _groups_layout() -> tuple | None:
    """The layout megatron's current groups were built for (None: none built)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())


def destroy_model_parallel_groups() -> None:
    """Forget megatron's groups and destroy every process group but the default one.

    megatron's ``destroy_model_parallel`` only drops its references (and destroys its gloo
    data-parallel groups); the groups themselves stay registered with torch.distributed, each
    with its communicator threads (gloo) or device buffers (NCCL), for the life of the process.
    Call on every rank: all of them built the same groups.
    """
    from megatron.core import parallel_state

    default = dist.distributed_c10d._get_default_group()
    groups = [g for g in list(dist.distributed_c10d._world.pg_map) if g is not default]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in groups:
        if group in dist.distributed_c10d._world.pg_map:  # megatron destroys its gloo DP groups
            dist.destroy_process_group(group)


def initialize(par: ParallelConfig, seed: int, env: DistEnv | None = None) -> DistEnv:
    """Process group + megatron model-parallel groups + seeds (incl. the model-parallel RNG
    tracker). Idempotent for the process group; megatron's groups are kept when the layout is
    the one they were built for and destroyed and rebuilt when it changes (curriculum stages)."""
    from megatron.core import parallel_state, tensor_parallel

    env = env or dist_env()
    start_process_group(env, par.timeout_minutes, cpu_emulation_mode=par.cpu_emulation)
    layout = _layout_key(par)
    if parallel_state.model_parallel_is_initialized() and layout != _groups_layout():
        destroy_model_parallel_groups()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=par.tp,
            pipeline_model_parallel_size=par.pp,
            virtual_pipeline_model_parallel_size=layout[2],
            context_parallel_size=par.cp,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=par.etp,
        )
    set_seeds(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return env
