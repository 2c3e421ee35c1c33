"""What a run prints (rank 0): a start banner, one line per logged step, per stage start,
validation and checkpoint, and a closing summary -- about 50 lines for the default run.
Everything else goes to ``<run_dir>/logs/`` (pretrain.reporting.logs). Lines go through ``print`` so a
live rich progress bar (which proxies stdout on a terminal) keeps them above itself."""

from __future__ import annotations

import dataclasses
from typing import Optional

from model_providers.glm5.counting.size import human, model_size
from parallel import features


def say(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def _model(m, preset: Optional[str]) -> str:
    moe = m.num_moe_layers
    ffn = (f"{m.num_layers - moe} dense + {moe} MoE, {m.num_experts} experts top-{m.moe_topk}"
           f" + {m.num_shared_experts} shared" if moe else "dense")
    mtp = f", MTP x{m.mtp_num_steps}" if m.mtp_num_steps else ""
    name = f"{preset}: " if preset else ""
    return (f"{name}{m.num_layers} layers ({ffn}), hidden {m.hidden_size}, MLA x "
            f"{m.num_attention_heads} heads{' + DSA' if m.dsa.mode != 'none' else ''}{mtp}, vocab {m.vocab_size}")


def _layout(par, dp: int, world_size: int) -> str:
    vpp = f" x vpp {par.vpp}" if par.vpp else ""
    extras = [f"ep {par.ep}", f"etp {par.expert_tp}"]
    if par.sequence_parallel:
        extras.append("sequence parallel")
    if par.distributed_optimizer:
        extras.append("distributed optimizer")
    if par.pipeline_layout:
        extras.append(f"pipeline layout {par.pipeline_layout}")
    return (f"world {world_size} = dp {dp} x tp {par.tp} x pp {par.pp}{vpp} x cp {par.cp}; "
            + ", ".join(extras))


def _parallel_changes(run_par, stage_par) -> str:
    changed = [f"{f.name}={getattr(stage_par, f.name)}" for f in dataclasses.fields(stage_par)
               if getattr(stage_par, f.name) != getattr(run_par, f.name)]
    return f"  [{', '.join(changed)}]" if changed else ""


def _preset(group: str) -> Optional[str]:
    """The Hydra choice of ``group`` (``model=glm5_tiny``), when running under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None


def start_text(how: str, latest: Optional[str], state: Optional[dict], init_from: Optional[str],
               done: bool) -> str:
    """Where the run begins (:class:`pretrain.curriculum.Begin` ``how``)."""
    if done:
        return f"nothing left: {latest} finished the run (a new run needs another trainer.name)"
    if how == "resume":
        return f"resume {latest} (stage {state.get('stage')}, step {state['step']})"
    if how == "carry":
        return f"next stage from {latest} (step {state['step']})"
    return f"weights from {init_from}" if init_from else "fresh"


def banner(rc, stages: list, world_size: int, backend: str, run_dir: str, log_path: str,
           wandb_where: str, start: str) -> list[str]:
    """The run at a glance. ``stages``: the :class:`pretrain.curriculum.Stage` list this run
    executes; ``start``: where it begins (:func:`start_text`)."""
    first = stages[0].rc if stages else rc  # the layout the run starts with; stages note changes
    m, p = first.model, first.parallel
    dp = world_size // (p.tp * p.pp * p.cp)  # plan_run validated it
    preset = _preset("model")
    size = model_size(m, first.parallel.tp)
    tokens = sum(st.steps * st.tokens_per_step for st in stages)
    precision = first.precision.dtype + (f" + fp8 {first.precision.fp8}" if first.precision.fp8 else "")
    lines = [
        f"GLM-5 pretraining: {rc.trainer.name}",
        f"  model    {_model(m, preset)}",
        f"  params   {human(size.total)} ({human(size.total - size.mtp)} + {human(size.mtp)} MTP); "
        f"{human(size.active)} active per token without embeddings",
        f"  layout   {_layout(first.parallel, dp, world_size)}; {precision}, {backend} layers",
        f"  speed    {features.summary(first.parallel)}",
        f"  run dir  {run_dir}",
        f"  logs     {log_path} (megatron & co; logger.verbose=true shows them here)",
        f"  W&B      {wandb_where}",
        f"  start    {start}",
        f"  stages   {len(stages)} ({sum(st.steps for st in stages)} steps, {tokens:,} tokens)",
        f"    {'stage':<24} {'steps':>5} {'tokens':>11} {'seq':>6} {'batch':>5}  {'mixture':<15} "
        f"{'dsa':<7} lr",
    ]
    for st in stages:
        t, r = st.rc.trainer, st.rc
        lines.append(
            f"    {st.name:<24} {st.steps:>5} {st.steps * st.tokens_per_step:>11,} {t.seq_length:>6} "
            f"{t.global_batch_size:>5}  {r.data.mixture:<15} {r.model.dsa.mode:<7} "
            f"{r.optimizer.lr:.1e} -> {r.optimizer.min_lr:.1e}{_parallel_changes(first.parallel, r.parallel)}")
    return lines


def stage_line(stage, count: int, how: str) -> str:
    t = stage.rc.trainer
    came = {"fresh": "fresh", "resume": "resumed", "carry": "from the previous stage's end"}.get(how, how)
    return (f"== stage {stage.index + 1}/{count} {stage.name}: {stage.steps} steps x "
            f"{stage.tokens_per_step:,} tokens, seq {t.seq_length}, mixture {stage.rc.data.mixture}, "
            f"dsa {stage.rc.model.dsa.mode}; {came}")


def step_line(r: dict) -> str:
    parts = [f"step {r['step']:>5}", f"{r['stage']:<23}", f"loss {r['loss']:.4f}", f"lm {r['lm_loss']:.4f}"]
    if "mtp_1_loss" in r:
        parts.append(f"mtp {r['mtp_loss']:.4f}")
    if "indexer_kl" in r:
        parts.append(f"kl {r['indexer_kl']:.4f}")
    parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}", f"{r['tokens_per_s']:,.0f} tok/s"]
    if r.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


def validation_line(r: dict) -> str:
    return f"valid {r['step']:>4} | {r['stage']:<23} | lm {r['valid_lm_loss']:.4f}"


def checkpoint_line(report) -> str:
    """A save (``checkpointing.writer.SaveReport``): when it started in the background, what the
    step loop waited for; once published, the whole time too."""
    end = "stage end, " if report.stage_final else ""
    if report.total_s is None:
        return f"checkpoint {report.path} started ({end}training waited {report.blocking_s:.1f} s; writing in the background)"
    if report.total_s > report.blocking_s + 1e-3:
        return f"checkpoint {report.path} ({end}{report.total_s:.1f} s, training waited {report.blocking_s:.1f} s)"
    return f"checkpoint {report.path} ({end}{report.total_s:.1f} s)"


def summary_lines(summary: dict, seconds: float) -> list[str]:
    """Human-readable summary; the JSON line after it is the machine-readable one."""
    head = (f"done: {summary['steps']} steps, {summary['consumed_tokens']:,} tokens in {seconds:.0f} s"
            + (f", {summary['skipped_steps']} skipped (non-finite)" if summary.get("skipped_steps") else "")
            + (" (preempted: saved, exit for requeue)" if summary.get("preempted") else ""))
    lines = [head]
    for s in summary["stages"]:
        lines.append(f"  {s['name']:<24} {s['steps']:>4} steps {s['tokens']:>11,} tokens  "
                     f"loss {s['start_loss']:.4f} -> {s['end_loss']:.4f}")
    return lines
