"""``python -m pretrain.train [hydra overrides]``: one training run.

Validates the whole config before any process group exists, starts torch.distributed (torchrun
or Slurm variables; gloo on CPU), builds this rank's GLM-5 chunks, trains with megatron's
schedules, checkpoints, and prints a one-line JSON summary as the last stdout line.
"""

from __future__ import annotations

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
    problems += faults.check(rc.faults, t.steps)
    if rc.logger.wandb.mode not in ("online", "offline", "disabled"):
        problems.append(f"logger.wandb.mode={rc.logger.wandb.mode!r} must be online, offline or disabled")
    if problems:
        raise ConfigError("invalid run config:\n  - " + "\n  - ".join(problems))
    return layout


def _read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    by_step = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            by_step[rec["step"]] = rec  # a resumed run rewrites steps after its checkpoint
    return [by_step[s] for s in sorted(by_step)]


def run(rc: RunConfig, config_yaml: str) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from data_pipeline.build import CategoryTokens, build_train_dataset
    from model_providers.glm5.config import to_transformer_config
    from model_providers.glm5.flops import train_flops_per_token
    from model_providers.glm5.provider import build_model_chunks
    from model_providers.glm5.specs import resolve_backend
    from parallel.initialize import dist_env, initialize
    from pretrain import checkpoint
    from pretrain.loop import configure_model_hooks, train_step
    from pretrain.metrics import MetricsSink
    from pretrain.optim import build_optimizer, build_scheduler

    env = dist_env()
    validate(rc, env.world_size)
    preemption = faults.PreemptionSignal()  # USR1/SIGTERM -> save after the current step, exit
    nonfinite = faults.NonFinitePolicy(rc.faults)
    backend = resolve_backend(rc.model.layer_backend)
    initialize(rc.parallel, rc.trainer.seed, env)
    t = rc.trainer
    run_dir = os.path.abspath(t.run_dir)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if env.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(config_yaml)
    dist.barrier()

    tcfg = to_transformer_config(rc.model, rc.parallel, rc.precision)
    chunks = build_model_chunks(rc.model, tcfg, backend)
    latest = checkpoint.latest_checkpoint(ckpt_dir) if rc.checkpoint.resume else None
    if latest is None and rc.checkpoint.init_from:
        checkpoint.load(rc.checkpoint.init_from, chunks)  # before DDP/optimizer copy the params
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=rc.parallel.distributed_optimizer
    )
    ddp = [
        DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    optimizer = build_optimizer(ddp, rc.optimizer, rc.precision.dtype, rc.parallel.distributed_optimizer)
    scheduler = build_scheduler(optimizer, rc.optimizer, rc.scheduler, t.steps)
    probe = configure_model_hooks(tcfg, ddp, optimizer)

    state = checkpoint.load(latest, chunks, optimizer, scheduler) if latest else checkpoint.TrainState()

    dataset = build_train_dataset(rc.data, t.seq_length, t.seed, run_dir, rc.model.vocab_size,
                                  num_samples=max(1, t.steps) * t.global_batch_size)
    category_tokens = CategoryTokens(dataset, t.seq_length, state.consumed_samples)
    resolved = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=True)
    sink = MetricsSink(rc.logger, run_dir, t.steps, state.step, t.name, resolved,
                       state.wandb_run_id, env.rank)
    state.wandb_run_id = sink.wandb_run_id
    tokens_per_step = t.global_batch_size * t.seq_length
    flops_per_step = train_flops_per_token(rc.model, t.seq_length) * tokens_per_step
    mtp_steps = rc.model.mtp_num_steps
    aux_coeff = rc.model.moe_aux_loss_coeff if rc.model.moe_aux_loss != "none" else 0.0
    moe_layers_applied = rc.model.num_moe_layers + (mtp_steps if rc.model.num_experts else 0)

    def save():
        checkpoint.save(ckpt_dir, chunks, optimizer, scheduler, state, config_yaml,
                        rc.checkpoint.keep_last)

    while state.step < t.steps:
        stats = train_step(ddp, optimizer, scheduler, dataset, state.consumed_samples, t, probe,
                           mtp_steps, poison=nonfinite.poison(state.step + 1))
        state.step += 1
        state.consumed_samples += t.global_batch_size
        mtp = sum(stats.mtp_losses) / len(stats.mtp_losses) if stats.mtp_losses else 0.0
        record = {
            "step": state.step,
            "stage": "pretrain",
            "consumed_tokens": state.consumed_samples * t.seq_length,
            **category_tokens.update(state.consumed_samples),
            "loss": stats.lm_loss + rc.model.mtp_loss_scale * mtp + aux_coeff * stats.moe_aux_loss
            + rc.model.dsa.kl_coeff * sum(stats.indexer_kl),
            "lm_loss": stats.lm_loss,
            "mtp_loss": mtp,
            **{f"mtp_{i + 1}_loss": v for i, v in enumerate(stats.mtp_losses)},
            "moe_aux_loss": aux_coeff * stats.moe_aux_loss,
            "moe_balance_loss": stats.moe_aux_loss / max(1, moe_layers_applied),
            "moe_load_imbalance": stats.moe_load_imbalance,
            **_indexer_kl_metrics(stats.indexer_kl, mtp_steps, rc.model.num_layers),
            "lr": scheduler.get_lr(optimizer.param_groups[0]),
            "grad_norm": stats.grad_norm,
            "skipped": stats.skipped,
            "checkpoint_reloads": nonfinite.reloads,
            "step_time_s": stats.seconds,
            "tokens_per_s": tokens_per_step / stats.seconds,
            "tflops_per_s": flops_per_step / stats.seconds / 1e12 / env.world_size,
        }
        sink.log(record)
        if nonfinite.should_reload(stats.skipped, state.step):
            faults.reload_last_checkpoint(ckpt_dir, chunks, optimizer, scheduler, state.step)
        if rc.checkpoint.save_every and state.step % rc.checkpoint.save_every == 0:
            save()
        if state.step < t.steps and preemption.agreed():
            break
    preempted = state.step < t.steps
    if (rc.checkpoint.save_at_end or preempted) and not _saved(ckpt_dir, state.step):
        save()
    sink.close()
    preemption.restore()

    history = _read_metrics(os.path.join(run_dir, "metrics.jsonl")) if env.rank == 0 else []
    summary = {
        "run_dir": run_dir,
        "steps": state.step,
        "consumed_tokens": state.consumed_samples * t.seq_length,
        "initial_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "stages": [{
            "name": "pretrain",
            "steps": state.step,
            "tokens": state.consumed_samples * t.seq_length,
            "start_loss": history[0]["loss"] if history else None,
            "end_loss": history[-1]["loss"] if history else None,
        }],
        "world_size": env.world_size,
        "preempted": preempted,
    }
    parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _indexer_kl_metrics(per_layer: list, mtp_steps: int, num_layers: int) -> dict:
    """``indexer_kl`` (mean over layer applications) and ``indexer_kl/layer_<i>`` (the shared
    MTP layer's entry is its mean over the MTP depths)."""
    if not per_layer:
        return {}
    values = list(per_layer)
    applications = num_layers + (mtp_steps if len(values) > num_layers else 0)
    out = {"indexer_kl": sum(values) / applications}
    for i, v in enumerate(values):
        name = f"layer_{i}" if i < num_layers else "mtp"
        out[f"indexer_kl/{name}"] = v / mtp_steps if i >= num_layers else v
    return out


def _saved(ckpt_dir: str, step: int) -> bool:
    from pretrain import checkpoint

    latest = checkpoint.latest_checkpoint(ckpt_dir)
    return latest is not None and os.path.basename(latest) == os.path.basename(
        checkpoint.iter_dir(ckpt_dir, step))


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
