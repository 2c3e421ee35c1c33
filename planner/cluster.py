"""The cluster a plan is sized for: ``conf/cluster/<name>.yaml`` presets with a strict schema.

A preset names the GPU (usable memory, peak dense TFLOP/s), the links (NVLink inside a node,
the network between nodes, both per GPU and per direction) and how many nodes the job gets;
the step-time model's efficiency and overlap assumptions are fields too, with defaults
documented here, so ``cluster.FIELD=VALUE`` on the planner's command line can change any of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from pretrain.config.errors import ConfigError

CLUSTER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "conf", "cluster")


@dataclass
class ClusterConfig:
    """One cluster. Bandwidths are GB/s (10^9 bytes per second) per GPU and per direction."""

    name: str = ""  #: the preset's file name
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 0.0  #: usable memory per GPU (what the driver reports), GiB
    bf16_tflops: float = 0.0  #: dense (no sparsity) bf16 tensor-core peak per GPU
    fp8_tflops: float = 0.0  #: dense fp8 tensor-core peak per GPU
    tf32_tflops: float = 0.0  #: dense tf32 peak per GPU (fp32 runs' matmuls)
    nvlink_gbps: float = 0.0  #: NVLink bandwidth per GPU per direction inside a node, GB/s
    internode_gbps: float = 0.0  #: network bandwidth per GPU per direction between nodes, GB/s
    #: share of the bf16 (tf32 for fp32 runs) peak the linear layers (dense and grouped GEMMs,
    #: forward and backward) sustain over a step
    matmul_efficiency: float = 0.5
    #: share of the fp8 peak they sustain with ``precision.fp8`` (quantisation and the bf16
    #: parts included: ~1.3x the bf16 throughput)
    fp8_matmul_efficiency: float = 0.32
    #: share of the bf16 peak the attention core (flash / sparse MLA kernels) sustains, fwd + bwd
    attention_efficiency: float = 0.45
    #: share of the bf16 peak the lightning indexer (top-k scoring, KL) sustains
    indexer_efficiency: float = 0.3
    #: share of link bandwidth ring collectives (all-gather, reduce-scatter) reach (NCCL bus bw)
    comm_efficiency: float = 0.75
    #: share of link bandwidth the MoE token all-to-all reaches (many small messages)
    alltoall_efficiency: float = 0.6
    #: shares of each communication hidden behind compute (0: fully exposed). This project's
    #: defaults: TP collectives and the EP all-to-all are issued synchronously by megatron-core's
    #: local/TE layers and dispatcher, the CP all-gather of the kv latent is synchronous, and DDP
    #: is built without overlap_grad_reduce / overlap_param_gather (pretrain/stage.py wrap_ddp)
    tp_overlap: float = 0.0
    ep_overlap: float = 0.0
    cp_overlap: float = 0.0
    dp_overlap: float = 0.0
    pp_overlap: float = 0.0  #: of the pipeline's point-to-point sends

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def problems(self, where: str) -> list[str]:
        p = []
        for f in ("nodes", "gpus_per_node"):
            if getattr(self, f) < 1:
                p.append(f"{where}: cluster.{f}={getattr(self, f)} must be >= 1")
        for f in ("gpu_memory_gib", "bf16_tflops", "fp8_tflops", "tf32_tflops", "nvlink_gbps",
                  "internode_gbps"):
            if not getattr(self, f) > 0:
                p.append(f"{where}: cluster.{f}={getattr(self, f)} must be > 0")
        for f in ("matmul_efficiency", "fp8_matmul_efficiency", "attention_efficiency", "indexer_efficiency",
                  "comm_efficiency", "alltoall_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                p.append(f"{where}: cluster.{f}={getattr(self, f)} must be in (0, 1]")
        for f in ("tp_overlap", "ep_overlap", "cp_overlap", "dp_overlap", "pp_overlap"):
            if not 0 <= getattr(self, f) <= 1:
                p.append(f"{where}: cluster.{f}={getattr(self, f)} must be in [0, 1]")
        return p


def preset_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CLUSTER_DIR) if f.endswith(".yaml"))


def load_cluster(name: str, overrides: dict | None = None) -> ClusterConfig:
    """The preset ``conf/cluster/<name>.yaml`` with ``overrides`` (field -> value, strings from
    the command line are converted to the field's type). Unknown presets, unknown fields and
    bad values raise :class:`ConfigError` naming them."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    names = preset_names()
    path = os.path.join(CLUSTER_DIR, f"{name}.yaml")
    if name not in names:
        raise ConfigError("unknown cluster", [f"cluster={name!r} is not a preset in {CLUSTER_DIR} "
                                              f"(presets: {', '.join(names)})"])
    known = {f.name for f in fields(ClusterConfig)}
    loaded = OmegaConf.load(path)
    overrides = dict(overrides or {})
    for where, keys in ((path, list(loaded.keys())), ("command line", list(overrides))):
        unknown = [f"{where}: cluster.{k} is not a cluster field (fields: {', '.join(sorted(known))})"
                   for k in keys if k not in known]
        if unknown:
            raise ConfigError(f"bad cluster {name!r}", unknown)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ClusterConfig), loaded)
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad cluster {name!r}", [f"{path}: {_first_line(e)}"]) from None
    for key, value in overrides.items():
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}={value}"]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"bad cluster {name!r}", [f"cluster.{key}={value}: {_first_line(e)}"]) from None
    cfg = OmegaConf.to_object(merged)
    cfg.name = cfg.name or name
    problems = cfg.problems(f"cluster {name!r}")
    if problems:
        raise ConfigError(f"bad cluster {name!r}", problems)
    return cfg


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0]
