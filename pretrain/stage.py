"""One curriculum stage: build what the stage trains (layout, data, then model chunks,
trainable set, DDP, optimizer and LR schedule through :mod:`pretrain.stage_build`) from its config
and a starting checkpoint, and hand it to :class:`pretrain.stage_loop.StageLoop`, which trains it
to its budget and saves the stage's final checkpoint."""

from __future__ import annotations

from typing import Optional

from checkpointing import state as checkpoint
from checkpointing.state import TrainState
from pretrain.curriculum import Stage
from pretrain.run_context import RunContext
from pretrain.stage_build import build_stage
from pretrain.stage_loop import StageLoop


def _stage_start_state(stage: Stage, previous: Optional[TrainState]) -> TrainState:
    if previous is None:
        return TrainState(stage=stage.name)
    return TrainState(step=previous.step, wandb_run_id=previous.wandb_run_id, stage=stage.name,
                      consumed_tokens=previous.consumed_tokens,
                      category_tokens=dict(previous.category_tokens),
                      tokens_before_stage=dict(previous.category_tokens))


def _load_moments_only(path: str, chunks, optimizer) -> None:
    """Carry the optimizer's state (moments, step counts) from the previous stage, but keep this
    stage's hyper-parameters: megatron's param groups store max_lr / min_lr / weight decay,
    which the scheduler reads, so the loaded groups' values are put back to this stage's."""
    hyper = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in optimizer.param_groups]
    checkpoint.load(path, chunks, optimizer)
    for g, h in zip(optimizer.param_groups, hyper):
        g.update(h)


def run_stage(stage: Stage, how: str, latest: Optional[str], ctx: RunContext,
              save_final: bool = True, following: Optional[Stage] = None) -> TrainState:
    """Train ``stage`` to its budget. ``how``: fresh | resume | carry (see
    :class:`pretrain.curriculum.Begin`); ``latest`` is the checkpoint to resume or carry from.
    ``save_final``: write the stage-final checkpoint (always, except ``checkpoint.save_at_end:
    false`` on the run's last stage). ``following``: the curriculum's next stage, if any: when it
    carries the optimizer state into another model-parallel layout, the final checkpoint is
    written in the format any layout loads."""
    from megatron.core import tensor_parallel

    from data_pipeline.build import CategoryTokens, build_datasets
    from pretrain.data_prep import stage_request
    from parallel.initialize import initialize, set_seeds
    from pretrain.reporting.logs import children_to_file
    from pretrain.step import configure_model_hooks

    rc, t = stage.rc, stage.rc.trainer
    initialize(rc.parallel, t.seed, ctx.env)
    # data first: a damaged or missing corpus stops the stage before any model exists
    req = stage_request(stage)  # the arguments data_pipeline.prepare built for (pretrain.data_prep)
    with children_to_file():  # a run given a process group preprocesses: datatrove's workers write to stderr
        dataset, valid = build_datasets(req.data, req.seq_length, req.seed, ctx.run_dir, req.vocab_size,
                                        req.num_samples, valid_samples=req.valid_samples)
    valid = valid if t.eval_every else None
    weights = None  # the checkpoint whose weights the stage starts from (before DDP copies them)
    if how == "fresh" and rc.checkpoint.init_from:
        weights, why = checkpoint.resolve_init_from(rc.checkpoint.init_from)  # checked in plan_run
        if why:
            raise RuntimeError(why)
    elif how == "carry":
        weights = latest
    load = None if weights is None else (lambda chunks: checkpoint.load(weights, chunks))
    built = build_stage(rc, ctx.backend, stage.trainable, stage.steps, load_weights=load)
    chunks, ddp, optimizer, scheduler = built.chunks, built.ddp, built.optimizer, built.scheduler
    probe = configure_model_hooks(built.tcfg, ddp, optimizer)

    if how == "resume":
        state = checkpoint.load(latest, chunks, optimizer, scheduler)
    else:
        previous = TrainState(**checkpoint.read_train_state(latest)) if how == "carry" else None
        if how == "carry" and stage.optimizer_state == "carry":
            _load_moments_only(latest, chunks, optimizer)
        state = _stage_start_state(stage, previous)
        set_seeds(t.seed + stage.index)  # a stage's randomness does not depend on how it was reached
        tensor_parallel.model_parallel_cuda_manual_seed(t.seed + stage.index)
    state.wandb_run_id = ctx.sink.wandb_run_id or state.wandb_run_id

    categories = CategoryTokens(dataset, t.seq_length, stage.data_offset + state.consumed_samples,
                                start=stage.data_offset)
    loop = StageLoop(stage, ddp, optimizer, scheduler, probe, dataset, valid, categories, ctx,
                     save_final, reshardable_final=_layout_changes_with_moments(stage, following))
    loop.train(state, chunks)
    return state


def _layout_changes_with_moments(stage: Stage, following: Optional[Stage]) -> bool:
    """The next stage loads this stage's optimizer state into another model-parallel layout."""
    return (following is not None and following.optimizer_state == "carry"
            and checkpoint.optimizer_layout_changes(stage.rc.parallel, following.rc.parallel))
