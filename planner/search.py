"""``--search``: the layouts a stage can train with on a cluster, ranked by estimated step time.

Candidates are every combination of tp (within a node), pp, vpp, ep, etp, cp and recompute mode
that the run's own validation accepts at the cluster's world size, each with its pipeline ends
balanced by compute two ways -- megatron's first/last stage layer counts
(:func:`planner.balance.balanced_ends`) and ``parallel.pipeline_layout`` strings that also move the
MTP module and the loss to the ranks that have room (:func:`planner.balance.balanced_layouts`) --
and with the speed features as the run sets them and switched on (:func:`feature_sets`: the flex
dispatcher, the permute / router / cross-entropy / RoPE / SwiGLU / gradient-accumulation fusions, the DP
overlaps, and, where megatron allows it, the EP all-to-all overlap; every candidate passes the
run's own validation, ``parallel.features.check_features`` included). The distributed optimizer and
sequence parallelism (with tp > 1) are always on, the micro-batch size is the stage's. Candidates
are timed first (cheap) and sized in that order until enough fit, so the memory model runs on
few of them.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from parallel.features import rope_fusion_problems
from planner.balance import balanced_ends, balanced_layouts
from planner.stage_plan import GIB, plan_stage
from pretrain.config.validation import check_run

TP = (1, 2, 4, 8)
PP = (1, 2, 4, 8, 16)
VPP = (None, 2, 4)
EP = (1, 2, 4, 8, 16, 32, 64)
CP = (1, 2, 4, 8, 16, 32)
RECOMPUTE = ("none", "selective", "full")
#: fitting layouts shown per stage
TOP = 5


@dataclass(frozen=True)
class Candidate:
    parallel: dict  #: parallel.* fields
    recompute: str

    def apply(self, rc):
        """``rc`` with this layout (shallow copies: the search never mutates them)."""
        return dataclasses.replace(
            rc, parallel=dataclasses.replace(rc.parallel, **self.parallel),
            model=dataclasses.replace(rc.model, recompute=None if self.recompute == "none" else self.recompute))

    def stage_overrides(self) -> dict:
        """The curriculum stage fields that select this layout."""
        return {"parallel": dict(self.parallel), "recompute": self.recompute}


#: the speed-feature fields a layout is tried with (:func:`feature_sets`)
FEATURE_FIELDS = ("moe_token_dispatcher_type", "moe_permute_fusion", "moe_router_fusion",
                  "cross_entropy_loss_fusion", "apply_rope_fusion", "bias_activation_fusion",
                  "gradient_accumulation_fusion", "overlap_grad_reduce", "overlap_param_gather",
                  "overlap_moe_expert_parallel_comm", "delay_wgrad_compute")


def feature_sets(rc, ep: int, etp: int, pp: int, vpp, recompute: str) -> list[dict]:
    """The speed-feature variants a layout is tried with: as the run sets them ({}), all on
    (what applies to this model and precision), and all on with megatron's EP all-to-all overlap
    where its conditions hold (ep > 1, no full recompute, bf16, virtual stages when pp > 1; the
    run's validation refuses what this pipeline cannot run)."""
    m, bf16 = rc.model, rc.precision.dtype == "bf16"
    moe = bool(m.num_experts)
    on = dict(moe_token_dispatcher_type="flex" if moe and ep * etp > 1 else "alltoall",
              moe_permute_fusion=moe, moe_router_fusion=moe, cross_entropy_loss_fusion=bf16,
              apply_rope_fusion=not rope_fusion_problems(m), bias_activation_fusion=True,
              gradient_accumulation_fusion=True,
              overlap_grad_reduce=True, overlap_param_gather=True,
              overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False)
    assert tuple(on) == FEATURE_FIELDS
    out = [{}, on]
    if moe and ep > 1 and bf16 and recompute != "full" and (pp == 1 or (vpp or 1) > 1):
        out.append({**on, "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True})
    # a variant the run already is would be timed twice
    return [out[0]] + [f for f in out[1:] if any(getattr(rc.parallel, k) != v for k, v in f.items())]


def candidates(rc, world_size: int, gpus_per_node: int):
    """Every candidate layout of ``rc`` that validates at ``world_size`` (corpus files aside)."""
    m = rc.model
    experts = m.num_experts or 1
    ends, layouts = {}, {}
    run_features = {k: getattr(rc.parallel, k) for k in FEATURE_FIELDS}
    for tp, pp, vpp, ep, cp in itertools.product(TP, PP, VPP, EP, CP):
        if tp > gpus_per_node or m.num_attention_heads % tp or experts % ep or (vpp and pp == 1):
            continue
        if world_size % (tp * pp * cp) or world_size % (ep * pp):
            continue
        for etp in sorted({1, tp}):
            if world_size % (ep * etp * pp):
                continue
            base = {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp, "cp": cp,
                    "sequence_parallel": tp > 1, "distributed_optimizer": True,
                    "first_stage_layers": None, "last_stage_layers": None, "pipeline_layout": None}
            pipelines = [base]
            if pp > 1:
                if (pp, vpp) not in ends:
                    ends[pp, vpp] = balanced_ends(rc, pp, vpp)
                    layouts[pp, vpp] = balanced_layouts(rc, pp, vpp)
                pipelines = [{**base, "first_stage_layers": ends[pp, vpp][0], "last_stage_layers": ends[pp, vpp][1]}]
                pipelines += [{**base, "pipeline_layout": lay} for lay in layouts[pp, vpp]]
            for recompute, pipeline in itertools.product(RECOMPUTE, pipelines):
                for features in feature_sets(rc, ep, etp, pp, vpp, recompute):
                    # the run's own features spelled out: a preset built from the winners states
                    # each stage's, whatever the first stage's winner turns on
                    cand = Candidate({**pipeline, **(features or run_features)}, recompute)
                    crc = cand.apply(rc)
                    layout, problems = check_run(crc, world_size, check_paths=False)
                    if layout is not None and not problems:
                        yield cand, crc, layout


def state_floor(rc, layout, trainable=()) -> float:
    """A lower bound of the largest rank's static bytes: the mean rank's share of the dense and
    the expert parameters (bf16/fp32 weights; fp32 grads, main params and two optimizer
    tensors for what trains, the latter sharded by the distributed optimizer), nothing padded."""
    from model_providers.glm5.counting.size import model_size

    m, p = rc.model, rc.parallel
    total = model_size(m, p.tp).total
    experts = 3 * m.hidden_size * m.moe_ffn_hidden_size * (m.num_experts or 0) * (
        m.num_moe_layers + (1 if m.mtp_num_steps and m.num_experts else 0))
    dense_rank = (total - experts) / (p.tp * p.pp)
    expert_rank = experts / (p.ep * p.expert_tp * p.pp)
    weight = 2 if rc.precision.dtype == "bf16" else 4
    trains = 0.0 if m.dsa.mode == "warmup" or trainable else 1.0
    main = 4 if weight == 2 else 0
    dense_shard = layout.dp * p.cp if p.distributed_optimizer else 1
    expert_shard = layout.expert_dp if p.distributed_optimizer else 1
    per = lambda shard: weight + trains * (4 + (main + 8) / shard)  # noqa: E731
    return dense_rank * per(dense_shard) + expert_rank * per(expert_shard)


def search_stage(name: str, steps: int, rc, cluster, min_headroom: float, trainable=(), top: int = TOP):
    """``(fitting plans fastest first, candidates timed, candidates sized)``."""
    from planner.step_time import step_time

    timed = [(step_time(crc, layout, cluster).total_s, i, cand, crc, layout)
             for i, (cand, crc, layout) in enumerate(candidates(rc, cluster.world_size, cluster.gpus_per_node))]
    timed.sort(key=lambda t: (t[0], t[1]))
    from planner.activations import activation_bytes

    budget = cluster.gpu_memory_gib * GIB * (1 - min_headroom)
    fitting, sized = [], 0
    for _, _, cand, crc, layout in timed:
        floor = state_floor(crc, layout, trainable)
        if any(floor + activation_bytes(crc, layout, r).peak > budget for r in range(crc.parallel.pp)):
            continue  # cannot fit: no need to build the ranks
        plan = plan_stage(name, steps, crc, cluster.world_size, cluster, min_headroom, trainable)
        sized += 1
        if plan.fits:
            fitting.append((cand, plan))
            if len(fitting) == top:
                break
    return fitting, len(timed), sized


def _value(v, quote: str) -> str:
    """A field's value as YAML / a Hydra override: null, true/false, numbers, strings quoted
    (layout strings hold | and *)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str) and not v.isidentifier():
        return f"{quote}{v}{quote}"
    return str(v)


def overrides_of(cand: Candidate) -> list[str]:
    """Hydra overrides for a one-stage run (curriculum=none or a stage's own fields)."""
    out = []
    for k, v in cand.parallel.items():
        value = _value(v, '"')
        out.append(f"'parallel.{k}={value}'" if '"' in value else f"parallel.{k}={value}")
    out.append(f"model.recompute={'null' if cand.recompute == 'none' else cand.recompute}")
    return out


def _yaml(fields: dict) -> str:
    return ", ".join(f"{k}: {_value(v, chr(34))}" for k, v in fields.items())


def preset_yaml(winners: list, cluster, stage_fields: dict) -> str:
    """A ``conf/parallel/`` preset: the first stage's winner as the base layout, and under
    ``stages:`` each stage's fields that differ from it or that the curriculum stage sets itself
    (``stage_fields``: stage name -> the parallel fields it sets), with its recompute mode."""
    (first_name, base), rest = winners[0], winners[1:]
    lines = [f"# {cluster.name} x {cluster.nodes} nodes ({cluster.world_size} GPUs): layouts from "
             "python -m planner --search"]
    lines += [f"{k}: {_value(v, chr(34))}" for k, v in base.parallel.items()]
    lines.append("stages:")
    for name, cand in winners:
        own = stage_fields.get(name, set())
        fields = {k: v for k, v in cand.parallel.items() if base.parallel.get(k) != v or k in own}
        lines.append(f"  {name}: {{{_yaml({**fields, 'recompute': cand.recompute})}}}")
    return "\n".join(lines)


def search_report(stages, chosen, rc, cluster, min_headroom: float, run_overrides: list[str]) -> tuple[str, bool]:
    """The search's text, and whether every chosen stage fits some layout."""
    from planner.report import layout_name

    lines = [f"layout search on {cluster.name} x {cluster.nodes} nodes ({cluster.world_size} GPUs), "
             f">= {min_headroom:.0%} memory free, fastest first"]
    winners = []
    for st in chosen:
        fitting, timed, sized = search_stage(st.name, st.steps, st.rc, cluster, min_headroom, st.trainable)
        lines.append(f"\n{st.name}: {timed} layouts validate, {sized} sized, {len(fitting)} shown")
        if not fitting:
            lines.append(f"  error: stage {st.name!r} fits no layout on {cluster.world_size} GPUs of "
                         f"{cluster.gpu_memory_gib:g} GiB with {min_headroom:.0%} free")
            continue
        for cand, p in fitting:
            lines.append(f"  {layout_name(p.layout):<64} peak {p.peak / GIB:6.1f} GiB  free "
                         f"{p.headroom:4.0%}  step {p.step.total_s:7.2f} s  {p.step.tokens_per_s_per_gpu:7.0f} "
                         f"tok/s/GPU  MFU {p.step.mfu:5.1%}")
        best = fitting[0][0]
        winners.append((st.name, best))
        lines.append(f"  winner as a preset entry: stages: {{{st.name}: {{{_yaml(best.parallel)}, "
                     f"recompute: {best.recompute}}}}}")
        if len(stages) == 1:
            lines.append("  sbatch --nodes={} slurm/pretrain.sh {} {}".format(
                cluster.nodes, " ".join(run_overrides), " ".join(overrides_of(best))))
    if len(stages) > 1 and len(winners) == len(chosen) == len(stages):
        own = {s.name: set(s.parallel) for s in rc.curriculum.stages}
        lines.append("\nas a conf/parallel/ preset (every stage's winner):\n" + preset_yaml(winners, cluster, own))
    return "\n".join(lines), len(winners) == len(chosen)
