"""``python -m pretrain.train [hydra overrides]``: one training run (a curriculum of stages).

Validates every stage's config before any process group exists, starts torch.distributed
(torchrun or Slurm variables; gloo on CPU), finds where the run stands from its latest
checkpoint, runs the remaining stages (pretrain.stage) and prints a one-line JSON summary as the
last stdout line.
"""

from __future__ import annotations

import gc
import json
import os

import hydra
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pretrain import faults
from pretrain.config import RunConfig, register, to_run_config

register()


class ConfigError(ValueError):
    """The run config cannot work; raised before any compute."""


def validate(rc: RunConfig, world_size: int):
    """Every check that needs only the config and the world size. Returns the parallel layout."""
    from data_pipeline.config import check_data
    from model_providers.glm5.config import validate_model
    from parallel.config import validate as validate_parallel
    from pretrain.optim import check_schedule

    t = rc.trainer
    validate_model(rc.model, rc.precision, t.seq_length)
    layout = validate_parallel(
        rc.parallel,
        world_size=world_size,
        num_layers=rc.model.num_layers,
        num_attention_heads=rc.model.num_attention_heads,
        num_experts=rc.model.num_experts,
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
    )
    problems = check_schedule(rc.scheduler, rc.optimizer, t.steps)
    if t.steps < 0:
        problems.append(f"trainer.steps={t.steps} must be >= 0")
    problems += check_data(rc.data, rc.model.vocab_size)
    problems += faults.check(rc.faults, None)
    if rc.logger.wandb.mode not in ("online", "offline", "disabled"):
        problems.append(f"logger.wandb.mode={rc.logger.wandb.mode!r} must be online, offline or disabled")
    if problems:
        raise ConfigError("invalid run config:\n  - " + "\n  - ".join(problems))
    return layout


def plan_run(rc: RunConfig, world_size: int):
    """The curriculum's stages, each validated as a whole run config; errors name the stage."""
    from pretrain.curriculum import plan

    stages = plan(rc)
    implicit = not rc.curriculum.stages
    problems = []
    for st in stages:
        prefix = "" if implicit else f"stage {st.name!r}: "
        try:
            layout = validate(st.rc, world_size)
        except ValueError as e:
            lines = [ln.strip()[2:] for ln in str(e).splitlines()[1:] if ln.strip().startswith("- ")]
            problems += [prefix + ln for ln in lines or [str(e)]]
            continue
        t = st.rc.trainer
        if t.eval_every and t.eval_samples % (t.micro_batch_size * layout.dp):
            problems.append(f"{prefix}trainer.eval_samples={t.eval_samples} must be a multiple "
                            f"of micro_batch_size={t.micro_batch_size} x data-parallel size {layout.dp}")
    problems += faults.check(rc.faults, sum(st.steps for st in stages))
    if problems:
        title = "invalid run config" if implicit else "invalid curriculum"
        raise ConfigError(f"{title}:\n  - " + "\n  - ".join(problems))
    return stages


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    by_step = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            by_step[rec["step"]] = rec  # a resumed run rewrites steps after its checkpoint
    return [by_step[s] for s in sorted(by_step)]


def stage_summaries(history: list[dict]) -> list[dict]:
    """Per stage, in run order: steps, tokens, sequence length, first and last loss."""
    out, before = [], 0
    for rec in history:
        if not out or out[-1]["name"] != rec["stage"]:
            if out:
                before = out[-1]["end_tokens"]
            out.append({"name": rec["stage"], "steps": 0, "seq_length": rec.get("seq_length"),
                        "start_loss": rec["loss"], "start_tokens": before})
        cur = out[-1]
        cur["steps"] += 1
        cur["end_loss"] = rec["loss"]
        cur["end_tokens"] = rec["consumed_tokens"]
    for cur in out:
        cur["tokens"] = cur.pop("end_tokens") - cur.pop("start_tokens")
    return out


def run(rc: RunConfig, config_yaml: str) -> dict:
    from megatron.core import parallel_state

    from model_providers.glm5.specs import resolve_backend
    from parallel.initialize import dist_env, start_process_group
    from parallel.megatron_compat import release_cached_modules
    from pretrain import checkpoint
    from pretrain.curriculum import where_to_begin
    from pretrain.metrics import MetricsSink
    from pretrain.plots import plot_curriculum
    from pretrain.stage import RunContext, run_stage

    env = dist_env()
    stages = plan_run(rc, env.world_size)
    preemption = faults.PreemptionSignal()  # USR1/SIGTERM -> save after the current step, exit
    backend = resolve_backend(rc.model.layer_backend)
    start_process_group(env, cpu_emulation_mode=rc.parallel.cpu_emulation)
    run_dir = os.path.abspath(rc.trainer.run_dir)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if env.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(config_yaml)
    dist.barrier()

    latest = checkpoint.latest_checkpoint(ckpt_dir) if rc.checkpoint.resume else None
    latest_state = checkpoint.read_train_state(latest) if latest else None
    begin = where_to_begin(stages, rc.curriculum, latest_state)
    todo = [] if begin.done else stages[begin.stage:begin.last + 1]
    resolved = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=True)
    start_step = latest_state["step"] if latest_state else 0
    total = start_step + sum(st.steps for st in todo) - (
        latest_state.get("stage_step", 0) if latest_state and begin.how == "resume" else 0)
    sink = MetricsSink(rc.logger, run_dir, total, start_step, rc.trainer.name, resolved,
                       latest_state.get("wandb_run_id") if latest_state else None, env.rank)
    ctx = RunContext(env, run_dir, config_yaml, backend, sink, preemption,
                     faults.NonFinitePolicy(rc.faults))
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    how = begin.how
    for i, st in enumerate(todo):
        last = i == len(todo) - 1
        run_stage(st, how, latest, ctx, save_final=rc.checkpoint.save_at_end or not last)
        release_cached_modules()
        gc.collect()  # the finished stage's model, grad buffers and optimizer, before the next
        latest, how = checkpoint.latest_checkpoint(ckpt_dir), "carry"
        if env.rank == 0 and rc.curriculum.plot and rc.curriculum.stages:
            plot_curriculum(read_metrics(metrics_path), os.path.join(run_dir, "curriculum.png"))
        if ctx.preempted or (not last and preemption.agreed()):
            ctx.preempted = True
            break
    sink.close()
    preemption.restore()

    history = read_metrics(metrics_path) if env.rank == 0 else []
    summary = {
        "run_dir": run_dir,
        "steps": history[-1]["step"] if history else 0,
        "consumed_tokens": history[-1]["consumed_tokens"] if history else 0,
        "initial_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "stages": stage_summaries(history),
        "world_size": env.world_size,
        "preempted": ctx.preempted,
    }
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    rc = to_run_config(cfg)
    summary = run(rc, OmegaConf.to_yaml(cfg, resolve=True))
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
        print(json.dumps(summary), flush=True)
    if summary["preempted"]:
        raise SystemExit(faults.PREEMPTED_EXIT)  # slurm/pretrain.sh requeues the job


if __name__ == "__main__":
    main()
