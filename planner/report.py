"""The planner's console table and ``plan.json``."""

from __future__ import annotations

from model_providers.glm5.counting.flops import FlopsPerToken
from planner.stage_plan import GIB, StagePlan


def layout_name(layout: dict) -> str:
    """tp2 pp8 vpp2 ep32 cp1 dp2 sp distopt sel  (the fields a Slurm user sets)."""
    if "tp" not in layout:
        return "-"
    parts = [f"tp{layout['tp']}", f"pp{layout['pp']}"]
    if layout["vpp"]:
        parts.append(f"vpp{layout['vpp']}")
    parts += [f"ep{layout['ep']}"]
    if layout["etp"] != layout["tp"]:
        parts.append(f"etp{layout['etp']}")
    parts += [f"cp{layout['cp']}", f"dp{layout['dp']}"]
    if layout["first_stage_layers"] is not None or layout["last_stage_layers"] is not None:
        parts.append(f"ends{layout['first_stage_layers'] or '-'}/{layout['last_stage_layers'] or '-'}")
    if layout.get("pipeline_layout"):
        parts.append("lay")
    parts.append({"none": "rc-none", "selective": "rc-sel", "full": "rc-full"}[layout["recompute"]])
    return " ".join(parts + feature_tags(layout))


#: short names of the speed features in a layout's name
FEATURE_TAGS = (("moe_token_dispatcher_type", "flex", "flex"), ("overlap_grad_reduce", True, "dpo"),
                ("overlap_moe_expert_parallel_comm", True, "a2ao"), ("tp_comm_overlap", True, "tpo"))
FUSIONS = ("moe_permute_fusion", "moe_router_fusion", "cross_entropy_loss_fusion", "apply_rope_fusion",
           "bias_activation_fusion", "gradient_accumulation_fusion")


def feature_tags(layout: dict) -> list[str]:
    """flex (flex dispatcher), fus<n> (n fusions on), dpo / a2ao / tpo (DP / EP / TP overlap)."""
    tags = [tag for field, on, tag in FEATURE_TAGS if layout.get(field) == on]
    fused = sum(bool(layout.get(f)) for f in FUSIONS)
    return (tags[:1] if tags[:1] == ["flex"] else []) + ([f"fus{fused}"] if fused else []) + \
        [t for t in tags if t != "flex"]


def stage_row(p: StagePlan) -> dict:
    """One stage as plan.json writes it."""
    row = {"name": p.name, "fits": p.fits, "layout": p.layout, "steps": p.steps, "tokens": p.tokens,
           "seq_length": p.seq_length, "problems": p.problems}
    if p.problems:
        return row
    worst = max(p.ranks, key=lambda r: r.peak)
    row.update({
        "peak_gib": worst.peak / GIB, "headroom": p.headroom, "peak_rank": f"pp{worst.pp_rank}",
        "flops_per_token": p.flops.total, "flops": _flops_dict(p.flops),
        "megatron_flops_per_token": p.megatron_flops_per_token,
        "step_s": p.step.total_s, "tokens_per_s_per_gpu": p.step.tokens_per_s_per_gpu,
        "mfu": p.step.mfu, "mfu_exact": p.step.mfu_exact, "gpu_hours": p.gpu_hours,
        "time": {k: getattr(p.step, k) for k in ("compute_s", "elementwise_s", "launch_s", "tp_s", "ep_s",
                                                  "pp_bubble_s", "pp_p2p_s", "cp_s", "dp_s", "optimizer_s",
                                                  "hidden_s")},
        "ranks": [{"pp_rank": r.pp_rank, "params": r.params,
                   **{f"{k}_gib": getattr(r, k) / GIB for k in
                      ("weights", "grads", "main_params", "optimizer", "activations", "optimizer_step", "peak")}}
                  for r in p.ranks],
    })
    if p.checkpoint is not None:
        row["checkpoint"] = p.checkpoint.as_dict()
    return row


def _flops_dict(f: FlopsPerToken) -> dict:
    return {k: getattr(f, k) for k in f.__dataclass_fields__}


def plan_json(plans: list[StagePlan], cluster, overrides: list[str]) -> dict:
    return {"cluster": {k: getattr(cluster, k) for k in cluster.__dataclass_fields__},
            "world_size": cluster.world_size, "overrides": overrides,
            "stages": [stage_row(p) for p in plans],
            "gpu_hours": sum(p.gpu_hours for p in plans if not p.problems)}


def table(plans: list[StagePlan], cluster) -> str:
    head = (f"{'stage':<24} {'layout':<64} {'peak GiB':>8} {'free':>5} {'fits':>4} "
            f"{'GFLOP/tok':>9} {'step s':>7} {'tok/s/GPU':>9} {'MFU':>5} {'GPU-h':>9}")
    lines = [head, "-" * len(head)]
    for p in plans:
        if p.problems:
            lines.append(f"{p.name:<24} does not validate at {cluster.world_size} GPUs:")
            lines += [f"{'':<26}- {why}" for why in p.problems]
            continue
        lines.append(
            f"{p.name:<24} {layout_name(p.layout):<64} {p.peak / GIB:>8.1f} {p.headroom:>5.0%} "
            f"{'yes' if p.fits else 'NO':>4} {p.megatron_flops_per_token / 1e9:>9.1f} "
            f"{p.step.total_s:>7.2f} {p.step.tokens_per_s_per_gpu:>9.0f} {p.step.mfu:>5.1%} "
            f"{p.gpu_hours:>9.3g}")
    total = sum(p.gpu_hours for p in plans if not p.problems)
    lines.append(f"{'whole curriculum':<24} {'':<64} {'':>8} {'':>5} {'':>4} {'':>9} {'':>7} {'':>9} "
                 f"{'':>5} {total:>9.3g}")
    return "\n".join(lines)


def checkpoint_table(plans: list[StagePlan], cluster) -> str:
    """Per stage: what one save and one load cost (planner/checkpoint.py) and the save interval."""
    from planner.checkpoint import GB, MAX_BLOCKING_SHARE, MAX_LOST_MIN

    rows = [p for p in plans if not p.problems and p.checkpoint is not None]
    if not rows:
        return ""
    c = rows[0].checkpoint
    head = (f"{'stage':<24} {'GB/rank':>8} {'total TB':>8} {'host GiB':>8} {'block s':>7} {'save s':>7} "
            f"{'load s':>7} {'every min':>9}")
    lines = [f"checkpoints ({'async' if c.async_save else 'synchronous'} saves, megatron's fully parallel "
             f"torch_dist, optimizer state {c.fmt}; filesystem "
             f"{cluster.fs_write_gbps:.0f} GB/s write, {cluster.fs_read_gbps:.0f} GB/s read over "
             f"{cluster.nodes} nodes; {cluster.client_write_gbps:g} / {cluster.client_read_gbps:g} GB/s per node, "
             f"{cluster.d2h_gbps:g} GB/s per GPU to host memory, {cluster.ckpt_fixed_s:g} s a save besides):",
             head, "-" * len(head)]
    notes = []
    for p in rows:
        k = p.checkpoint
        lines.append(f"{p.name:<24} {k.bytes_per_rank / GB:>8.1f} {k.total_bytes / 1e12:>8.2f} "
                     f"{k.host_ram_peak_gib:>8.1f} {k.blocking_s:>7.1f} {k.save_s:>7.1f} {k.load_s:>7.1f} "
                     f"{k.interval_min:>9.1f}")
        notes += [f"{p.name}: {n}" for n in k.notes]
        f = k.final_save
        if f is not None:
            by = {q.name: q for q in rows}.get(f["next_stage"])
            load = (f"; {f['next_stage']} loads it in {by.checkpoint.stage_start_load_s:.0f} s"
                    if by is not None and by.checkpoint.stage_start_load_s is not None else "")
            notes.append(f"{p.name}: its final save is {f['format']} ({f['next_stage']} carries the optimizer "
                         f"state into another model-parallel layout): {f['bytes_per_rank'] / GB:.1f} GB/rank, "
                         f"host {f['host_ram_peak_gib']:.1f} GiB per rank, blocking {f['blocking_s']:.0f} s, "
                         f"on disk after {f['save_s']:.0f} s{load}")
    lines.append(f"every min: the longest interval losing <= {MAX_LOST_MIN:g} min of work to a failure (interval "
                 f"+ the save in flight), with <= {MAX_BLOCKING_SHARE:.0%} of the time blocked in saves and each "
                 f"save done before the next")
    if notes:
        lines += ["  - " + n for n in notes]
    return "\n".join(lines)


def rank_table(p: StagePlan) -> str:
    """Memory per pipeline rank of one stage, GiB."""
    cols = ("weights", "grads", "main_params", "optimizer", "activations", "optimizer_step", "peak")
    head = f"  {'rank':<5} {'params':>8} " + " ".join(f"{c.replace('_', ' '):>10}" for c in cols)
    lines = [f"{p.name}: memory per pipeline rank (GiB; the peak adds the larger of activations "
             f"and the optimizer step to the state)", head]
    for r in p.ranks:
        lines.append(f"  pp{r.pp_rank:<3} {r.params / 1e9:>7.2f}B " +
                     " ".join(f"{getattr(r, c) / GIB:>10.2f}" for c in cols))
    return "\n".join(lines)


def time_lines(p: StagePlan) -> str:
    s = p.step
    f = p.flops
    layout = p.layout.get("pipeline_layout")
    return (f"{p.name}: " + (f"pipeline layout {layout}; " if layout else "") + f"per token {f.total / 1e9:.1f} GFLOP exact (attention {f.attention / 1e9:.1f}, "
            f"indexer {f.indexer / 1e9:.1f}, MTP {f.mtp / 1e9:.1f}, output heads "
            f"{f.output_heads / 1e9:.1f}), {p.megatron_flops_per_token / 1e9:.1f} Megatron's accounting; "
            f"step {s.total_s:.2f} s = compute {s.compute_s:.2f} + element-wise {s.elementwise_s:.2f} + launch gaps "
            f"{s.launch_s:.2f} + TP {s.tp_s:.2f} + EP {s.ep_s:.2f} + PP bubble {s.pp_bubble_s:.2f} + PP sends "
            f"{s.pp_p2p_s:.2f} + CP {s.cp_s:.2f} + DP {s.dp_s:.2f} + optimizer {s.optimizer_s:.2f} (exposed; "
            f"{s.hidden_s:.2f} s of communication hidden by overlap); MFU {s.mfu:.1%} by Megatron's accounting, "
            f"{s.mfu_exact:.1%} by the exact count")
