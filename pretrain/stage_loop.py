"""The step loop of one curriculum stage (:class:`StageLoop`): each step through
:func:`pretrain.step.train_step`, its metrics record, evaluation every ``trainer.eval_every``,
checkpoint saves (interval, preemption, stage end), reloads after non-finite steps."""

from __future__ import annotations

import time

from checkpointing import state as checkpoint
from checkpointing.state import TrainState
from pretrain.curriculum import Stage
from pretrain.reporting import memory_report
from pretrain.reporting.console import checkpoint_line
from pretrain.run_context import RunContext


def current_params(ddp_chunks) -> None:
    """With ``overlap_param_gather`` the distributed optimizer's step leaves each rank's model
    params current only in its own shard: the next forward's pre-hooks gather the rest, bucket by
    bucket. Whatever reads the params outside a training forward (a checkpoint save, evaluation)
    first gathers them all, as megatron's own training loop does (``force_param_sync``)."""
    for c in ddp_chunks:
        if c.ddp_config.overlap_param_gather:
            c.start_param_sync(force_sync=True)


def async_saves(ckpt_cfg) -> bool:
    """``checkpoint.async_save``; null means on for CUDA runs (where a save's files are written
    from a host copy while the GPUs train on) and off for CPU runs."""
    import torch

    return torch.cuda.is_available() if ckpt_cfg.async_save is None else ckpt_cfg.async_save


class StageLoop:
    """The step loop of one stage and its metrics records: built by
    :func:`pretrain.stage.run_stage`, run by :meth:`train`."""

    def __init__(self, stage: Stage, ddp: list, optimizer, scheduler, probe, dataset, valid, categories,
                 ctx: RunContext, save_final: bool, reshardable_final: bool = False):
        from model_providers.glm5.counting.flops import train_flops_per_token

        self.save_final, self.reshardable_final = save_final, reshardable_final
        self.memory_written = False
        self.stage, self.ddp, self.optimizer, self.scheduler = stage, ddp, optimizer, scheduler
        self.probe, self.dataset, self.valid, self.categories, self.ctx = probe, dataset, valid, categories, ctx
        rc, t = stage.rc, stage.rc.trainer
        m = rc.model
        self.flops_per_step = train_flops_per_token(m, t.seq_length) * stage.tokens_per_step
        self.aux_coeff = m.moe_aux_loss_coeff if m.moe_aux_loss != "none" else 0.0
        self.moe_layers_applied = m.num_moe_layers + (m.mtp_num_steps if m.num_experts else 0)
        self.writer = None  #: checkpointing.writer.CheckpointWriter, made at the first save
        self.last_save = time.monotonic()  #: rank 0's clock decides save_every_minutes

    def _save_due_by_clock(self) -> bool:
        """Rank 0's vote for an interval save after the coming step (``checkpoint.save_every_minutes``);
        the step's all-reduce hands it to every rank (``StepStats.save_due``)."""
        minutes = self.stage.rc.checkpoint.save_every_minutes
        return bool(minutes) and time.monotonic() - self.last_save >= 60 * minutes

    def train(self, state: TrainState, chunks) -> None:
        """The stage's steps; a save still being written when they end is finished first."""
        try:
            self._train(state, chunks)
        finally:
            self._settle_saves(wait=True)

    def _train(self, state: TrainState, chunks) -> None:
        from pretrain.step import evaluate, train_step

        stage, rc = self.stage, self.stage.rc
        t = rc.trainer
        if stage.steps == 0 and self.save_final:  # trainer.steps=0: write the initial weights
            self._save(state, chunks, stage_final=True)
        while state.stage_step < stage.steps:
            lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses
            position = stage.data_offset + state.consumed_samples
            stats = train_step(self.ddp, self.optimizer, self.scheduler, self.dataset, position, t,
                               self.probe, rc.model.mtp_num_steps, save_vote=self._save_due_by_clock())
            self._settle_saves()
            state.step += 1
            state.stage_step += 1
            state.consumed_samples += t.global_batch_size
            state.consumed_tokens += stage.tokens_per_step
            stage_counts = self.categories.update(stage.data_offset + state.consumed_samples)
            state.category_tokens = {k: state.tokens_before_stage.get(k, 0) + stage_counts.get(k, 0)
                                     for k in {**state.tokens_before_stage, **stage_counts}}
            record = self._record(state, stats, lr)
            if not self.memory_written and not stats.skipped:  # once a stage: what this rank holds
                self.memory_written = memory_report.write(self.ctx.run_dir, self.ctx.env.rank, stage.name,
                                                          state.step, self.ddp, self.optimizer)
            last = state.stage_step == stage.steps
            if self.valid is not None and (state.stage_step % t.eval_every == 0 or last):
                current_params(self.ddp)
                record.update(evaluate(self.ddp, self.valid, t, t.eval_samples))
            self.ctx.sink.log(record)
            if self.ctx.nonfinite.should_reload(stats.skipped, state.step):
                self._reload_after_bad_steps(state, chunks)
            if last:
                if self.save_final:
                    self._save(state, chunks, stage_final=True)
                continue  # a signal during the last step is answered between stages
            periodic = (bool(rc.checkpoint.save_every) and state.step % rc.checkpoint.save_every == 0
                        or stats.save_due)
            if periodic:
                self._save(state, chunks)
            if self.ctx.preemption.agreed():  # every rank stops after this same step
                if not periodic:
                    self._save(state, chunks)
                self.ctx.preempted = True
                return

    def _reload_after_bad_steps(self, state, chunks) -> None:
        """The newest checkpoint's weights (and, when it is of this stage, optimizer and LR
        schedule); step and data position go on, so the batches since are not replayed."""
        from pretrain.reliability.faults import reload_last_checkpoint

        self._settle_saves(wait=True)  # the newest checkpoint may still be being written
        path = checkpoint.latest_checkpoint(self.ctx.ckpt_dir)
        if path is not None and checkpoint.read_train_state(path).get("stage") != self.stage.name:
            checkpoint.load(path, chunks)  # the previous stage's end: its optimizer is not ours
            return
        reload_last_checkpoint(self.ctx.ckpt_dir, chunks, self.optimizer, self.scheduler, state.step)

    def _save(self, state, chunks, stage_final=False):
        from checkpointing.writer import CheckpointWriter

        rc = self.stage.rc
        if self.writer is None:
            self.writer = CheckpointWriter(self.ctx.ckpt_dir, rc.checkpoint.keep_last,
                                           async_saves(rc.checkpoint))
        current_params(self.ddp)
        report = self.writer.save(chunks, self.optimizer, self.scheduler, state, self.ctx.config_yaml,
                                  rc.parallel, stage_final=stage_final,
                                  reshardable=stage_final and self.reshardable_final)
        self.last_save = time.monotonic()
        if stage_final:  # the next stage (or the end of the run) reads it
            report = self.writer.finish() or report
        self.ctx.sink.event(checkpoint_line(report))

    def _settle_saves(self, wait: bool = False) -> None:
        """Publish the save in flight once every rank's files are written (``wait``: wait for it)."""
        if self.writer is not None:
            report = self.writer.poll(blocking=wait)
            if report is not None:
                self.ctx.sink.event(checkpoint_line(report))

    def _record(self, state: TrainState, stats, lr: float) -> dict:
        rc, t = self.stage.rc, self.stage.rc.trainer
        m = rc.model
        mtp = sum(stats.mtp_losses) / len(stats.mtp_losses) if stats.mtp_losses else 0.0
        world = self.ctx.env.world_size
        return {
            "step": state.step,
            "stage": self.stage.name,
            "stage_step": state.stage_step,
            "seq_length": t.seq_length,
            "mixture": rc.data.mixture,
            "global_batch_size": t.global_batch_size,
            "consumed_tokens": state.consumed_tokens,
            **dict(sorted(state.category_tokens.items())),
            "loss": stats.lm_loss + m.mtp_loss_scale * mtp + self.aux_coeff * stats.moe_aux_loss
            + m.dsa.kl_coeff * sum(stats.indexer_kl),
            "lm_loss": stats.lm_loss,
            "loss_tokens": stats.loss_tokens,
            "mtp_loss": mtp,
            **{f"mtp_{i + 1}_loss": v for i, v in enumerate(stats.mtp_losses)},
            "moe_aux_loss": self.aux_coeff * stats.moe_aux_loss,
            "moe_balance_loss": stats.moe_aux_loss / max(1, self.moe_layers_applied),
            "moe_load_imbalance": stats.moe_load_imbalance,
            **indexer_kl_metrics(stats.indexer_kl, m.mtp_num_steps, m.num_layers),
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "skipped": stats.skipped,
            "checkpoint_reloads": self.ctx.nonfinite.reloads,
            "step_time_s": stats.seconds,
            "tokens_per_s": self.stage.tokens_per_step / stats.seconds,
            "tflops_per_s": self.flops_per_step / stats.seconds / 1e12 / world,
            **({"host_syncs": stats.host_syncs} if stats.host_syncs is not None else {}),
        }


def indexer_kl_metrics(per_layer: list, mtp_steps: int, num_layers: int) -> dict:
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
