"""One curriculum stage on one cluster: memory per rank position, FLOPs, step time, GPU-hours.

Everything here is computed from the stage's resolved run config and its validated layout; no
process group, allocation or data is touched. The pieces come from their own modules (static
state: :mod:`planner.memory`; activations: :mod:`planner.activations`; the optimizer
step's transient buffers: :mod:`planner.optimizer_step`; FLOPs:
:mod:`model_providers.glm5.counting.flops`; time: :mod:`planner.step_time`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GIB = 2 ** 30

#: the share of a GPU's memory a plan keeps free by default: the CUDA context, NCCL's buffers,
#: the caching allocator's fragmentation and anything the model below does not count live there
MIN_HEADROOM = 0.10


@dataclass(frozen=True)
class RankPlan:
    """What one pipeline rank (every TP/CP/EP/DP rank of it is alike) holds at its peak."""

    pp_rank: int
    params: int
    weights: int
    grads: int
    main_params: int
    optimizer: int
    activations: int
    optimizer_step: int  #: transient buffers of the optimizer step (Muon's gathered matrices)
    peak: int

    def headroom(self, capacity: int) -> float:
        return 1.0 - self.peak / capacity


@dataclass
class StagePlan:
    name: str
    steps: int
    tokens: float
    seq_length: int
    layout: dict  #: the parallel fields and recompute mode this plan assumes
    ranks: list  #: RankPlan per pipeline rank
    capacity: int  #: bytes of one GPU
    flops: object  #: model_providers.glm5.counting.flops.FlopsPerToken (exact causal counts)
    megatron_flops_per_token: float
    step: object  #: planner.step_time.StepTime
    min_headroom: float = MIN_HEADROOM
    problems: list = field(default_factory=list)  #: why the stage does not validate (no numbers then)
    checkpoint: object = None  #: planner.checkpoint.CheckpointCost of every save (dp_reshardable)

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def headroom(self) -> float:
        return 1.0 - self.peak / self.capacity

    @property
    def fits(self) -> bool:
        return not self.problems and self.headroom >= self.min_headroom

    @property
    def gpu_hours(self) -> float:
        return self.steps * self.step.total_s * self.world_size / 3600.0

    @property
    def world_size(self) -> int:
        return self.layout["world_size"]


def layout_fields(rc, layout) -> dict:
    """The layout a plan names: parallel sizes, derived dp, uneven ends or the pipeline layout
    string, recompute mode, and the speed features (parallel.features)."""
    from parallel.features import DDP_FIELDS, TRANSFORMER_FIELDS

    p = rc.parallel
    return {
        "world_size": layout.world_size, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "ep": p.ep,
        "etp": p.expert_tp, "cp": p.cp, "dp": layout.dp, "sequence_parallel": p.sequence_parallel,
        "first_stage_layers": p.first_stage_layers, "last_stage_layers": p.last_stage_layers,
        "pipeline_layout": p.pipeline_layout,
        "distributed_optimizer": p.distributed_optimizer,
        "recompute": rc.model.recompute or "none",
        "micro_batch_size": rc.trainer.micro_batch_size,
        **{f: getattr(p, f) for f in TRANSFORMER_FIELDS + DDP_FIELDS},
    }


def rank_signature(rc, layout, pp_rank: int) -> tuple:
    """What decides a pipeline rank's memory: (dense, MoE) layers per chunk, first, last."""
    m, pp = rc.model, rc.parallel.pp
    counts = layout.layers_per_stage
    chunks = range(pp_rank, len(counts), pp)
    dense_layers = m.num_layers - m.num_moe_layers
    sig = []
    for c in chunks:
        start = sum(counts[:c])
        dense = max(0, min(start + counts[c], dense_layers) - start)
        sig.append((dense, counts[c] - dense))
    return tuple(sig), pp_rank == 0, pp_rank == pp - 1


_STATE: dict = {}  #: (state key) -> (StateBytes, optimizer step bytes, ShardBytes); see _rank_state


def _rank_state(rc, layout, pp_rank: int, trainable=()):
    """(StateBytes, optimizer-step bytes, checkpoint ShardBytes) of a pipeline rank, built once per
    process for each distinct input: they do not depend on the sequence, the batch, CP (the distributed optimizer
    shards dense state over DP x CP = world / (TP x PP)) or the recompute mode, so a layout search
    sizes most candidates from this cache."""
    from planner.checkpoint import shard_bytes
    from planner.memory import count_rank
    from planner.meta_build import build_rank
    from planner.optimizer_step import optimizer_step_bytes

    par = dataclasses.replace(rc.parallel, cp=1)
    key = (repr(dataclasses.replace(rc.model, recompute=None)), repr(rc.precision), repr(rc.optimizer),
           repr(par), layout.world_size, layout.expert_dp, pp_rank, tuple(trainable))
    if key not in _STATE:
        built = build_rank(rc, layout, pp_rank, trainable)
        state = count_rank(built, rc)
        p = rc.parallel
        _STATE[key] = (state, optimizer_step_bytes(built, rc, state), shard_bytes(built, p.tp, p.ep, p.expert_tp))
    return _STATE[key]


def rank_plan(rc, layout, pp_rank: int, trainable=()) -> RankPlan:
    from planner.activations import activation_bytes

    s, opt_step, _ = _rank_state(rc, layout, pp_rank, trainable)
    act = activation_bytes(rc, layout, pp_rank).peak
    # activations are gone by the optimizer step: the peak is the larger of the two moments
    peak = s.total + max(act, opt_step)
    return RankPlan(pp_rank, s.params, s.weights, s.grads, s.main_params, s.optimizer, act,
                    opt_step, peak)


def rank_plans(rc, layout, trainable=()) -> list:
    """A RankPlan per pipeline rank; ranks with equal signatures are sized once."""
    done, out = {}, []
    for r in range(rc.parallel.pp):
        sig = rank_signature(rc, layout, r)
        if sig not in done:
            done[sig] = rank_plan(rc, layout, r, trainable)
        out.append(dataclasses.replace(done[sig], pp_rank=r))
    return out


def stage_checkpoint(rc, layout, cluster, trainable=(), fmt: str = "dp_reshardable", **kw):
    """The stage's checkpoint cost (:func:`planner.checkpoint.checkpoint_cost`) in format ``fmt``
    (``dp_reshardable``: every save ``checkpointing/`` writes; ``model_space_shards``: a stage's
    final save into another layout; ``fully_reshardable``: that save before, and with
    ``parallel=False, staging_copies_host=False`` every save before issue 38); ``kw``: more of
    checkpoint_cost's arguments."""
    from planner.checkpoint import checkpoint_cost

    done, shards = {}, []
    for r in range(rc.parallel.pp):
        sig = rank_signature(rc, layout, r)
        if sig not in done:
            done[sig] = _rank_state(rc, layout, r, trainable)[2]
        shards.append(dataclasses.replace(done[sig], pp_rank=r))
    return checkpoint_cost(rc, shards, cluster, fmt, **kw)


def mark_stage_changes(stages, plans, cluster) -> None:
    """For each planned stage whose successor carries the optimizer state into another
    model-parallel layout: its final save's cost in the per-rank model-space format
    (``CheckpointCost.final_save``) and, on the successor's plan when it is planned too, the load
    of it (``stage_start_load_s``). ``stages``: the whole curriculum; ``plans``: those planned."""
    from checkpointing.state import RESHARDABLE_OPTIMIZER_FORMAT, optimizer_layout_changes
    from pretrain.config.validation import check_run

    by_name = {p.name: p for p in plans}
    for st, nxt in zip(stages, stages[1:]):
        p = by_name.get(st.name)
        if p is None or p.problems or nxt.optimizer_state != "carry":
            continue
        # a stage carrying the optimizer state into another model-parallel layout needs this
        # stage's final save in the per-rank model-space format (as the run decides it)
        if not optimizer_layout_changes(st.rc.parallel, nxt.rc.parallel):
            continue
        layout_next, problems = check_run(nxt.rc, cluster.world_size, check_paths=False)
        if layout_next is None or problems:
            continue
        layout, _ = check_run(st.rc, cluster.world_size, check_paths=False)
        final = stage_checkpoint(st.rc, layout, cluster, st.trainable, RESHARDABLE_OPTIMIZER_FORMAT)
        p.checkpoint.final_save = {
            "format": final.fmt, "next_stage": nxt.name, "bytes_per_rank": final.bytes_per_rank,
            "host_ram_peak_gib": final.host_ram_peak_gib, "host_ram_every_rank_gib": final.host_ram_every_rank_gib,
            "blocking_s": final.blocking_s, "save_s": final.save_s}
        q = by_name.get(nxt.name)
        if q is not None and not q.problems:
            q.checkpoint.stage_start_load_s = stage_checkpoint(
                nxt.rc, layout_next, cluster, nxt.trainable, RESHARDABLE_OPTIMIZER_FORMAT).load_s


def plan_stage(name: str, steps: int, rc, world_size: int, cluster,
               min_headroom: float = MIN_HEADROOM, trainable=()) -> StagePlan:
    """The plan of one stage (``rc``: its resolved run config; ``trainable``: its trainable
    patterns) at ``world_size``; a stage that does not validate there gets its problems and no
    numbers."""
    from model_providers.glm5.counting.flops import flops_per_token, megatron_flops_per_token
    from planner.step_time import step_time
    from pretrain.config.validation import check_run

    t = rc.trainer
    layout, problems = check_run(rc, world_size, check_paths=False)
    capacity = int(cluster.gpu_memory_gib * GIB)
    if layout is None or problems:
        return StagePlan(name, steps, float(steps) * t.global_batch_size * t.seq_length, t.seq_length,
                         {"world_size": world_size}, [], capacity, None, 0.0, None, min_headroom,
                         list(problems))
    return StagePlan(
        name, steps, float(steps) * t.global_batch_size * t.seq_length, t.seq_length,
        layout_fields(rc, layout), rank_plans(rc, layout, trainable), capacity,
        flops_per_token(rc.model, t.seq_length, tp=rc.parallel.tp, cp=rc.parallel.cp),
        megatron_flops_per_token(rc.model, t.seq_length),
        step_time(rc, layout, cluster), min_headroom,
        checkpoint=stage_checkpoint(rc, layout, cluster, trainable))
