"""The cluster a plan is sized for: ``conf/cluster/<name>.yaml`` presets with a strict schema.

A preset names the GPU (usable memory, peak dense TFLOP/s, HBM bandwidth), the links (NVLink
inside a node, the network between nodes, both per GPU and per direction) and how many nodes the
job gets. The step-time model's factors (efficiencies, overlaps, imbalance, launch gaps) are
fields too, with global defaults here -- the same for every model and every preset, each sourced
in docs/planner.md "Factors" -- so ``cluster.FIELD=VALUE`` on the planner's command line can
change any of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from pretrain.config.cluster import CLUSTER_DIR, preset_names
from pretrain.config.errors import ConfigError
from pretrain.config.numbers import Rule, count, non_negative, positive, table_problems


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
    hbm_gbps: float = 0.0  #: HBM bandwidth per GPU (read + write), GB/s
    fp32_tflops: float = 0.0  #: dense fp32 on the CUDA cores (no tensor cores): Muon's fp32 Newton-Schulz
    # --- the step-time model's factors: global (the same for every model), printed in
    # StepTime.assumptions, each with its public source in docs/planner.md "Factors" ---
    #: share of the bf16 (tf32 for fp32 runs) peak the linear layers (dense and grouped GEMMs,
    #: forward and backward) sustain over a step
    matmul_efficiency: float = 0.6
    #: share of the fp8 peak they sustain with ``precision.fp8`` (per-tensor scaling; blockwise
    #: and MXFP8 scale it by planner.step_time.FP8_RECIPE_RATE); the output heads stay bf16
    fp8_matmul_efficiency: float = 0.32
    #: share of the bf16 peak the attention core (flash / sparse MLA kernels) sustains, fwd + bwd
    attention_efficiency: float = 0.45
    #: share of the bf16 peak the lightning indexer (top-k scoring, KL) sustains
    indexer_efficiency: float = 0.3
    #: share of the HBM bandwidth element-wise kernels (norms, RoPE, SwiGLU, permutes, router,
    #: cross entropy, gradient accumulation, the optimizer step) reach
    hbm_efficiency: float = 0.7
    #: share of link bandwidth ring collectives (all-gather, reduce-scatter) reach (NCCL bus bw)
    comm_efficiency: float = 0.75
    #: share of link bandwidth the MoE token all-to-all reaches (many small messages)
    alltoall_efficiency: float = 0.6
    #: the flex dispatcher (DeepEP / HybridEP): share of the network bandwidth its RDMA part
    #: reaches (a token crosses the network once per destination node) and of NVLink its
    #: forwarding inside a node reaches
    flex_rdma_efficiency: float = 0.85
    flex_nvlink_efficiency: float = 0.75
    #: routed tokens of the busiest expert rank over the mean (1: balanced, as Megatron's published
    #: MoE benchmarks force with moe_router_force_load_balancing); scales the routed experts'
    #: GEMMs, their permutes and the EP all-to-all
    moe_imbalance: float = 1.0
    #: GPU idle per layer per forward (recomputed ones too), microseconds: the host catching up
    #: after the MoE dispatcher's synchronisation and small-kernel launch latency (no CUDA graphs)
    launch_gap_us: float = 100.0
    #: shares of each communication hidden behind compute when its overlap is on (0: fully
    #: exposed): TP with parallel.tp_comm_overlap, EP with overlap_moe_expert_parallel_comm (the
    #: 1F1B all-to-all overlap, with delay_wgrad_compute), DP with overlap_grad_reduce /
    #: overlap_param_gather (at most the compute of the last / first micro-batch and half the
    #: bubble is there to hide behind). CP's kv all-gather and the pipeline's sends are issued
    #: synchronously by this project (cp_overlap, pp_overlap apply always; 0 by default)
    tp_overlap: float = 0.6
    ep_overlap: float = 0.5
    dp_overlap: float = 0.9
    cp_overlap: float = 0.0
    pp_overlap: float = 0.0  #: of the pipeline's point-to-point sends
    # --- checkpoint I/O (planner/checkpoint.py), each sourced in docs/planner.md "Factors" ---
    #: pinned device-to-host copy per GPU with every GPU of the node copying at once, GB/s: what
    #: an async save's blocking part (staging the write share in host memory) runs at
    d2h_gbps: float = 25.0
    #: the shared parallel filesystem's aggregate write / read bandwidth per node of the job, GB/s:
    #: storage is sized with the cluster (per 32-node scalable unit), so the aggregate the job sees
    #: is nodes x these (:attr:`fs_write_gbps`, :attr:`fs_read_gbps`)
    fs_write_gbps_per_node: float = 1.94
    fs_read_gbps_per_node: float = 3.9
    #: what one node's filesystem client reaches (its storage NICs), write / read, GB/s
    client_write_gbps: float = 20.0
    client_read_gbps: float = 40.0
    #: per save, besides the copies: the sharded state dict, the save plan's exchange, the fork
    ckpt_fixed_s: float = 5.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def fs_write_gbps(self) -> float:
        """The filesystem's aggregate write bandwidth for this job, GB/s."""
        return self.nodes * self.fs_write_gbps_per_node

    @property
    def fs_read_gbps(self) -> float:
        return self.nodes * self.fs_read_gbps_per_node

    def problems(self, where: str) -> list[str]:
        return [f"{where}: {p}" for p in table_problems(self, CLUSTER_RULES, "cluster")]


def _cluster_rules() -> dict:
    """Every numeric field of :class:`ClusterConfig` -> its :class:`~pretrain.config.numbers.Rule`
    (finite: an infinite bandwidth or peak would plan a step of no time)."""
    share, fraction = Rule(lo=0, hi=1, lo_open=True), Rule(lo=0, hi=1)
    rules = {"nodes": count(1), "gpus_per_node": count(1),
             "moe_imbalance": Rule(lo=1, note="busiest rank / mean"),
             "launch_gap_us": non_negative(), "ckpt_fixed_s": non_negative()}
    for f in ("gpu_memory_gib", "bf16_tflops", "fp8_tflops", "tf32_tflops", "nvlink_gbps",
              "internode_gbps", "hbm_gbps", "fp32_tflops", "d2h_gbps", "fs_write_gbps_per_node",
              "fs_read_gbps_per_node", "client_write_gbps", "client_read_gbps"):
        rules[f] = positive()
    for f in ("matmul_efficiency", "fp8_matmul_efficiency", "attention_efficiency", "indexer_efficiency",
              "hbm_efficiency", "comm_efficiency", "alltoall_efficiency", "flex_rdma_efficiency",
              "flex_nvlink_efficiency"):
        rules[f] = share
    for f in ("tp_overlap", "ep_overlap", "cp_overlap", "dp_overlap", "pp_overlap"):
        rules[f] = fraction
    return {f"cluster.{k}": v for k, v in rules.items()}


CLUSTER_RULES = _cluster_rules()


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
