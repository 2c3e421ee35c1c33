"""What a checkpoint costs: bytes each rank writes, host RAM while saving, time training stops, time
until the save is on disk, one load, and the save interval (docs/planner.md "Checkpoints").

Two formats are modelled, both megatron-core 0.19.2 dist checkpointing (torch_dist backend) as
``checkpointing/`` writes them (``checkpointing.state``):

- ``dp_reshardable`` (``OPTIMIZER_FORMAT``, every save): saved through
  ``FullyParallelSaveStrategyWrapper`` over the DP x CP group, loaded through
  ``FullyParallelLoadStrategyWrapper``. The weights (every parameter in its dtype, frozen ones
  too) are replicated over data parallelism; the wrapper hands each whole tensor to the least
  loaded rank holding it, so a rank writes ~1/(DP x CP) of its dense weights and ~1/EDP of its
  expert weights (1/(DP x CP) where the expert-DP group is larger: only the group holding the main
  replica writes them). Each rank writes its own distributed-optimizer shard as it lies in the
  DDP buckets (``get_parameter_state_dp_reshardable``: per stepped element the main parameter and
  both moments; padding between parameters too, < 64 elements each). With
  ``checkpoint.async_save`` the step loop stops only to copy this rank's write share to pinned
  host memory (``FileSystemWriterAsync.preload_tensors``); the spawned writer process
  (``parallel.megatron_compat.async_writer``) writes it.
- ``model_space_shards`` (``RESHARDABLE_OPTIMIZER_FORMAT``: a stage's final save where the next
  stage carries the optimizer state into another model-parallel layout;
  ``parallel.megatron_compat.model_space_shards``): each rank writes its own distributed-optimizer
  shard, as in ``dp_reshardable``, cut into boxes of the model parameters' global tensors; the
  same bytes, host memory and time. A load in another layout reads the stored boxes its new
  shard overlaps: torch's reader reads a stored box whole, and a rank's new shard overlaps at
  most a few boxes of each parameter, so the reads are modelled as ``dp_reshardable``'s.
- ``fully_reshardable`` (``GATHERED_OPTIMIZER_FORMAT``: every save before issue 38, then a stage's
  final save into another layout until the per-rank format above): every DP rank all-gathers its
  model shard's whole optimizer state into fp32 host tensors
  (``get_parameter_state_dp_zero(return_on_all_ranks=True)``: param, exp_avg, exp_avg_sq, 12 B per
  element); the main replica (DP x CP rank 0 for dense tensors, expert-DP rank 0 for experts)
  writes the whole shard, synchronously, cloning the slices of the gathered tensors it writes
  (views: ``_clone_or_dequantize_if_needed``) and staging them again
  (``STAGING_COPIES_HOST_TENSORS``); a load reads the whole shard's state on every rank (no fully
  parallel load). Kept to show what the per-rank format saves.

Bytes per stepped element in the checkpoint (``optimizer_bytes_per_element``): the moments are
always fp32 -- bf16 moments (``optimizer.exp_avg_dtype``, megatron's precision-aware optimizer,
Transformer Engine's FusedAdam) are saved through ``FusedAdam.get_unscaled_state``, which upcasts
them -- and the main parameter is fp32, except that the precision-aware optimizer on bf16
parameters keeps it as int16 remainders (``store_param_remainders``, megatron's default with
Transformer Engine >= 2.1: 2 B). Muon keeps its momentum in ``exp_avg`` and a zero ``exp_avg_sq``
(``pretrain.optim.muon_adamw``): both are saved. Without the distributed optimizer megatron saves
the fp32 copy of bf16 parameters and the moments, replicated like the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GB = 1e9
GIB = 2 ** 30
FP32 = 4

#: the main parameter of a bf16 parameter stepped by megatron's precision-aware optimizer is kept
#: (and saved) as int16 remainders: megatron-core 0.19.2's OptimizerConfig.store_param_remainders
#: default, effective with Transformer Engine >= 2.1
STORE_PARAM_REMAINDERS = True
#: the staging of a save copies tensors already in host memory too
#: (parallel.megatron_compat.fixes._checkpoint_staging_into_shared_memory)
STAGING_COPIES_HOST_TENSORS = True
#: the save interval's rules: at most this much work lost to a failure (the interval plus the save
#: still in flight) ...
MAX_LOST_MIN = 30.0
#: ... and at most this share of the wall clock spent blocked in saves
MAX_BLOCKING_SHARE = 0.05

SHARDED, RESHARDABLE, MODEL_SPACE = "dp_reshardable", "fully_reshardable", "model_space_shards"


@dataclass(frozen=True)
class ShardBytes:
    """One pipeline position's model shard as a checkpoint sees it (TP/EP rank 0; every chunk of
    the pipeline rank). ``*_weights``: bytes of the parameters in their dtype; ``*_stepped``:
    elements the optimizer steps (trainable); ``*_half``: of those, bf16/fp16 ones (they have an
    fp32 main copy); ``whole_*``: the same over every TP / EP / ETP rank of this pipeline position
    (the part of the model the pipeline rank's ranks hold together); ``largest_tensor``: bytes of
    the largest weight (the fully parallel wrapper moves whole tensors)."""

    pp_rank: int
    dense_weights: int
    expert_weights: int
    dense_stepped: int
    expert_stepped: int
    dense_half: int
    expert_half: int
    whole_weights: int
    whole_stepped: int
    whole_half: int
    largest_tensor: int
    dp: int  #: ranks sharing the dense tensors: DP x CP
    expert_dp: int  #: ranks sharing the expert tensors


def shard_bytes(rank, tp: int, ep: int, etp: int) -> ShardBytes:
    """:class:`ShardBytes` of a built :class:`~planner.meta_build.MetaRank`."""
    n = dict(dense_weights=0, expert_weights=0, dense_stepped=0, expert_stepped=0, dense_half=0,
             expert_half=0, whole_weights=0, whole_stepped=0, whole_half=0)
    largest = 0
    for chunk in rank.chunks:
        for p in chunk.parameters():
            kind = "dense" if getattr(p, "allreduce", True) else "expert"
            split = getattr(p, "tensor_model_parallel", False)
            copies = (tp if split else 1) if kind == "dense" else ep * (etp if split else 1)
            size = p.numel() * p.element_size()
            half = p.dtype in (torch.float16, torch.bfloat16)
            largest = max(largest, size)
            n[f"{kind}_weights"] += size
            n["whole_weights"] += size * copies
            if p.requires_grad:
                n[f"{kind}_stepped"] += p.numel()
                n["whole_stepped"] += p.numel() * copies
                if half:
                    n[f"{kind}_half"] += p.numel()
                    n["whole_half"] += p.numel() * copies
    return ShardBytes(rank.pp_rank, largest_tensor=largest, dp=rank.dp, expert_dp=rank.expert_dp, **n)


def optimizer_bytes_per_element(rc, half: bool, fmt: str = SHARDED) -> int:
    """Checkpoint bytes of one stepped element's optimizer state (see the module docstring)."""
    from planner.memory import moment_bytes

    moments = 2 * FP32  # saved fp32 whatever their dtype in memory
    if not rc.parallel.distributed_optimizer:
        return moments + (FP32 if half else 0)
    if fmt == RESHARDABLE:
        return 3 * FP32  # fp32 world tensors: param, exp_avg, exp_avg_sq
    precision_aware = moment_bytes(rc.optimizer) != 2 * FP32
    return moments + (2 if half and precision_aware and STORE_PARAM_REMAINDERS else FP32)


def _optimizer(rc, stepped: int, half: int, fmt: str) -> int:
    return (half * optimizer_bytes_per_element(rc, True, fmt)
            + (stepped - half) * optimizer_bytes_per_element(rc, False, fmt))


@dataclass(frozen=True)
class RankWrite:
    """One pipeline position's checkpoint traffic, per rank (the busiest one where ranks differ)."""

    writes: float  #: bytes a rank writes per save
    host: float  #: extra host bytes it holds during a save (GPU run)
    d2h: float  #: bytes it copies from the GPU to host memory per save
    gathered: float  #: bytes it all-gathers over the network per save (fully_reshardable)
    reads: float  #: bytes a rank reads per load
    exchanged: float  #: bytes a rank receives from the others per load (fully parallel load)
    node_writes: float  #: bytes the busiest node writes per save
    total: float  #: bytes of this pipeline position's part of the model in the checkpoint
    host_every_rank: float = 0.0  #: host bytes every rank holds during a save (the gather)


def rank_write(rc, s: ShardBytes, fmt: str = SHARDED, gpus_per_node: int = 8, parallel: bool = True,
               staging_copies_host: bool = STAGING_COPIES_HOST_TENSORS) -> RankWrite:
    """What ranks at pipeline position ``s`` write, stage and read in format ``fmt``; ``parallel``:
    through megatron's fully parallel save and load wrappers (what ``checkpointing/`` does now;
    False: the code before, where the main replica wrote and every rank read what it needed);
    ``staging_copies_host``: the staging copies host tensors too (False: the code before)."""
    par = rc.parallel
    o_dense = _optimizer(rc, s.dense_stepped, s.dense_half, fmt)
    o_expert = _optimizer(rc, s.expert_stepped, s.expert_half, fmt)
    total = s.whole_weights + _optimizer(rc, s.whole_stepped, s.whole_half, fmt)
    weights = s.dense_weights + s.expert_weights
    expert_group = min(s.expert_dp, s.dp)  # the group holding the main replica spreads it
    # with the distributed optimizer, dp_reshardable and model_space_shards state is each rank's
    # own; fully_reshardable state is gathered to every DP rank (host tensors) and replicated like
    # the weights
    own = par.distributed_optimizer and fmt in (SHARDED, MODEL_SPACE)
    gathered = (o_dense + o_expert) if par.distributed_optimizer and fmt == RESHARDABLE else 0.0
    host_copies = 2 if staging_copies_host else 1  # clone of a view, then the staging copy
    if parallel:
        w_share = s.dense_weights / s.dp + s.expert_weights / expert_group
        if own:
            o_share = o_dense / s.dp + o_expert / s.expert_dp
        else:
            o_share = o_dense / s.dp + o_expert / expert_group
        w = w_share + o_share
        exchanged = weights - w_share + (gathered - o_share if gathered else 0.0)
        if gathered:  # the gathered host tensors, the written slices copied again, the weights staged
            return RankWrite(w, gathered + host_copies * o_share + w_share, gathered + w_share, gathered, w,
                             exchanged, gpus_per_node * w, total, host_every_rank=gathered + host_copies * o_share)
        return RankWrite(w, w, w, 0.0, w, exchanged, gpus_per_node * w, total)
    dense, expert = s.dense_weights + o_dense, s.expert_weights + o_expert
    # writers: DP x CP rank 0 (the first TP ranks of a pipeline stage, megatron's tp-cp-ep-dp-pp
    # order) for dense tensors, expert-DP rank 0 (the first EP x ETP ranks) for experts
    node = min(par.tp, gpus_per_node) * dense + min(par.ep * par.expert_tp, gpus_per_node) * expert
    if not gathered:  # everything on the GPU: the writer stages what it writes
        return RankWrite(dense + expert, dense + expert, dense + expert, 0.0, dense + expert, 0.0, node, total)
    return RankWrite(dense + expert, gathered + host_copies * gathered + weights, gathered + weights, gathered,
                     dense + expert, 0.0, node, total, host_every_rank=gathered)


@dataclass
class CheckpointCost:
    """One stage's checkpoint: per save and per load (see the module docstring)."""

    fmt: str
    async_save: bool
    bytes_per_rank: int  #: what the busiest rank writes per save
    total_bytes: int  #: one checkpoint on disk (tensor data; megatron's metadata file aside)
    host_ram_peak_gib: float  #: per rank, extra host RAM during a save (the busiest rank)
    blocking_s: float  #: the step loop stops this long per save
    save_s: float  #: from the save's start until it is complete on disk
    load_s: float  #: one load (restart or stage change)
    interval_min: float  #: the chosen save interval
    notes: list = field(default_factory=list)
    host_ram_every_rank_gib: float = 0.0  #: fully_reshardable: what every DP rank holds
    final_save: dict = None  #: a stage's final save in another format (see planner.stage_plan)
    stage_start_load_s: float = None  #: loading the previous stage's final save into this layout

    def as_dict(self) -> dict:
        out = {"format": self.fmt, "async_save": self.async_save, "bytes_per_rank": self.bytes_per_rank,
               "total_bytes": self.total_bytes, "host_ram_peak_gib": self.host_ram_peak_gib,
               "blocking_s": self.blocking_s, "save_s": self.save_s, "load_s": self.load_s,
               "interval_min": self.interval_min, "notes": list(self.notes)}
        if self.final_save is not None:
            out["final_save"] = dict(self.final_save)
        if self.stage_start_load_s is not None:
            out["stage_start_load_s"] = self.stage_start_load_s
        return out


def choose_interval(blocking_s: float, save_s: float, max_lost_min: float = MAX_LOST_MIN,
                    max_blocking_share: float = MAX_BLOCKING_SHARE) -> tuple[float, list[str]]:
    """(minutes between saves, notes): the largest interval that loses at most ``max_lost_min`` of
    work to a failure (the interval plus the save in flight: a failure just before a save completes
    falls back to the one before), at least ``blocking_s / max_blocking_share`` (saves block at
    most that share of the time) and at least ``save_s`` (a save finishes before the next starts).
    When they conflict the lower bounds win and a note says how much a failure may lose."""
    longest = max_lost_min - save_s / 60.0
    shortest = max(blocking_s / max_blocking_share, save_s) / 60.0
    if shortest <= longest:
        return longest, []
    if blocking_s / max_blocking_share >= save_s:
        why = (f"saves block {blocking_s:.0f} s: <= {max_blocking_share:.0%} of the time needs >= "
               f"{shortest:.1f} min between saves")
    else:
        why = f"a save takes {save_s / 60:.1f} min to reach the disk"
    return shortest, [f"{why}, so a failure may lose up to {shortest + save_s / 60:.1f} min of work "
                      f"(> {max_lost_min:g} min)"]


def checkpoint_cost(rc, shards: list, cluster, fmt: str = SHARDED, async_save=None,
                    parallel: bool = True, staging_copies_host: bool = STAGING_COPIES_HOST_TENSORS) -> CheckpointCost:
    """The checkpoint cost of a stage (``rc``: its run config; ``shards``: :class:`ShardBytes` of
    every pipeline rank) on ``cluster`` in format ``fmt`` (``parallel``, ``staging_copies_host``:
    see :func:`rank_write`; the code before the change: ``fully_reshardable``, both False).
    ``async_save`` None: ``rc.checkpoint.async_save``, null meaning on (a plan is for GPUs)."""
    if async_save is None:
        async_save = rc.checkpoint.async_save is not False
    async_save = bool(async_save) and parallel
    gpn = cluster.gpus_per_node
    per = [rank_write(rc, s, fmt, gpn, parallel, staging_copies_host) for s in shards]
    total = sum(w.total for w in per)
    d2h, net = cluster.d2h_gbps * GB, cluster.internode_gbps * cluster.comm_efficiency * GB
    write_s = max(max(w.node_writes for w in per) / (cluster.client_write_gbps * GB),
                  total / (cluster.fs_write_gbps * GB))
    if parallel:  # the checkpoint is read once; each rank then receives the rest of what it needs
        read_s = max(max(gpn * w.reads for w in per) / (cluster.client_read_gbps * GB),
                     total / (cluster.fs_read_gbps * GB))
        read_s += max(w.exchanged / net for w in per)
    else:  # every rank reads all it needs
        read_s = max(max(gpn * w.reads for w in per) / (cluster.client_read_gbps * GB),
                     cluster.world_size * max(w.reads for w in per) / (cluster.fs_read_gbps * GB))
    stage_s = cluster.ckpt_fixed_s + max(w.gathered / net + w.d2h / d2h for w in per)
    save_s = stage_s + write_s
    blocking_s = stage_s if async_save else save_s
    interval, notes = choose_interval(blocking_s, save_s)
    configured = getattr(rc.checkpoint, "save_every_minutes", 0.0) or 0.0
    if configured > 0 and not notes and not (60 * configured >= max(save_s, blocking_s / MAX_BLOCKING_SHARE)
                                             and configured + save_s / 60 <= MAX_LOST_MIN + 1e-9):
        notes.append(f"checkpoint.save_every_minutes={configured:g} breaks a rule the planned "
                     f"{interval:.1f} min keeps")
    if fmt != RESHARDABLE and rc.parallel.distributed_optimizer and optimizer_bytes_per_element(rc, True) != 3 * FP32:
        own = max(s.dense_stepped / s.dp + s.expert_stepped / s.expert_dp for s in shards)
        notes.append(f"bf16 moments are saved as fp32 (FusedAdam.get_unscaled_state): a save holds "
                     f"{2 * FP32 * own / GIB:.1f} GiB more GPU memory while it builds its state dict")
    return CheckpointCost(fmt, async_save, int(max(w.writes for w in per)), int(total),
                          max(w.host for w in per) / GIB, blocking_s, save_s, read_s, interval, notes,
                          max(w.host_every_rank for w in per) / GIB)


def predict(rc, world_size: int, *, pp_rank: int = 0, trainable=(), device: str = "cpu") -> dict:
    """Predicted checkpoint bytes of one rank of pipeline rank ``pp_rank`` for a run config
    (model, parallel layout, optimizer, precision: ``rc.precision.dtype`` fp32 gives fp32
    weights, the CPU runs' dtype) at ``world_size`` ranks, for a benchmark or test to compare with
    what a save measures: ``{"dp_reshardable": {...}, "model_space_shards": {...},
    "fully_reshardable": {...}, "before": {...}}`` (every save now; a stage's final save into
    another layout, now and before; every save before issue 38: the main replica wrote everything), each ``{"bytes_per_rank", "host_ram_peak_gib",
    "tolerance_bytes"}``. ``bytes_per_rank``: what the rank writes, its even share; megatron's
    fully parallel wrapper assigns whole tensors, so a rank may differ by up to
    ``tolerance_bytes`` (its largest weight). ``host_ram_peak_gib``: extra host RAM during a save.
    ``device="cuda"``: the write share is copied to pinned host memory (plus, fully_reshardable,
    the gathered fp32 state and the writer's copies of it). ``device="cpu"``: tensors already live
    in host memory; the staging copies them all the same (``parallel.megatron_compat.fixes``) and
    megatron's writer has cloned those that are views first (:func:`_cpu_copied`)."""
    from planner.meta_build import build_rank
    from pretrain.config.validation import check_run

    layout, problems = check_run(rc, world_size, check_paths=False)
    if layout is None or problems:
        raise ValueError(f"the run does not validate at {world_size} ranks: {problems}")
    par = rc.parallel
    s = shard_bytes(build_rank(rc, layout, pp_rank, trainable), par.tp, par.ep, par.expert_tp)
    out = {}
    for name, fmt, parallel in ((SHARDED, SHARDED, True), (MODEL_SPACE, MODEL_SPACE, True),
                                (RESHARDABLE, RESHARDABLE, True), ("before", RESHARDABLE, False)):
        w = rank_write(rc, s, fmt, parallel=parallel)
        host = _cpu_copied(rc, s, w, parallel) if device == "cpu" else w.host
        out[name] = {"bytes_per_rank": int(w.writes), "host_ram_peak_gib": host / GIB,
                     "tolerance_bytes": s.largest_tensor if parallel else 0}
    return out


def predict_for_run_config(rc, world_size: int, legacy: bool = False, *, device: str = "cpu", pp_rank: int = 0,
                           trainable=()) -> dict:
    """``{"bytes_per_rank", "host_ram_peak_gib", "tolerance_bytes"}`` of one rank (TP rank 0 of
    pipeline rank ``pp_rank``) for a save of run config ``rc`` at ``world_size`` ranks, as run in
    this code base (:func:`predict`): ``legacy`` False, ``checkpointing.writer`` (dp_reshardable,
    fully parallel); True, ``fully_reshardable`` written by the main replica alone, as before."""
    return predict(rc, world_size, pp_rank=pp_rank, trainable=trainable, device=device)["before" if legacy else SHARDED]


def _cpu_copied(rc, s: ShardBytes, w: RankWrite, parallel: bool = True) -> float:
    """Host bytes a save copies on a CPU run: :attr:`RankWrite.host`, plus the weights megatron's
    writer clones before the staging copies them again (``_clone_if_needed``: views of a larger
    storage): with the distributed optimizer the trainable weights (views of its param buffers)
    and the fp32 main parameters of fp32 weights (views of them) it writes. Not counted: the
    SwiGLU ``linear_fc1`` tensors a run without the distributed optimizer saves as two halves."""
    if not rc.parallel.distributed_optimizer:
        return w.host

    def trained(stepped, half):  # bytes of the trainable weights (bf16 or fp32)
        return 2 * half + FP32 * (stepped - half)

    dense, expert = trained(s.dense_stepped, s.dense_half), trained(s.expert_stepped, s.expert_half)
    if not parallel:
        return w.host + dense + expert
    weights = dense / s.dp + expert / min(s.expert_dp, s.dp)
    if w.gathered:  # the written slices of the gathered tensors are counted in w.host already
        return w.host + weights
    main = FP32 * ((s.dense_stepped - s.dense_half) / s.dp + (s.expert_stepped - s.expert_half) / s.expert_dp)
    return w.host + weights + main
