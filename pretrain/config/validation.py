"""Every check of a run's config, for every curriculum stage, before any process group exists.

Each check (model, parallel layout, schedule, data, faults, curriculum, command-line overrides)
returns a list of problems naming fields and values; :func:`plan_run` gathers them, prefixes
each stage's with its name, and raises one :class:`~pretrain.config.errors.ConfigError` listing all.
"""

from __future__ import annotations

from typing import Sequence

from pretrain.reliability import faults
from pretrain.config.schema import RunConfig
from pretrain.config.errors import ConfigError
from pretrain.config.overrides import Change, reach

__all__ = ["ConfigError", "check_run", "plan_run", "override_notes"]


def check_run(rc: RunConfig, world_size: int, check_paths: bool = True):
    """Problems of one (stage's) run config at ``world_size``: ``(layout or None, problems)``.
    ``check_paths=False`` leaves out what only the cluster can check (corpus and tokenizer files):
    the planner runs where they are not."""
    from data_pipeline.validation import check_data
    from model_providers.glm5.model.config import check_model
    from parallel.config import check_layout
    from pretrain.optim import check_schedule

    t = rc.trainer
    problems = check_model(rc.model, rc.precision, t.seq_length)
    layout, layout_problems = check_layout(
        rc.parallel,
        world_size=world_size,
        num_layers=rc.model.num_layers,
        num_attention_heads=rc.model.num_attention_heads,
        num_experts=rc.model.num_experts,
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
    )
    problems += layout_problems
    if layout is not None and rc.model.num_experts:
        problems += _dense_only_pipeline_ranks(rc, layout)
    problems += check_schedule(rc.scheduler, rc.optimizer, t.steps)
    if t.steps < 0:
        problems.append(f"trainer.steps={t.steps} must be >= 0")
    problems += check_data(rc.data, rc.model.vocab_size, check_paths)
    if rc.logger.wandb.mode not in ("online", "offline", "disabled"):
        problems.append(f"logger.wandb.mode={rc.logger.wandb.mode!r} must be online, offline or disabled")
    if layout is not None and t.eval_every and t.eval_samples % (t.micro_batch_size * layout.dp):
        problems.append(f"trainer.eval_samples={t.eval_samples} must be a multiple of "
                        f"micro_batch_size={t.micro_batch_size} x data-parallel size {layout.dp}")
    return layout, problems


def _dense_only_pipeline_ranks(rc: RunConfig, layout) -> list[str]:
    """megatron's MoE aux-loss tracker all-reduces over the pipeline group from the ranks that
    hold MoE layers only: a pipeline rank with none (all its layers among the first_k_dense)
    never joins, and the step hangs."""
    pp, counts = rc.parallel.pp, layout.layers_per_stage
    starts = [sum(counts[:c]) for c in range(len(counts))]
    problems = []
    for r in range(pp):
        moe = sum(max(0, starts[c] + counts[c] - max(starts[c], rc.model.first_k_dense))
                  for c in range(r, len(counts), pp))
        if moe == 0:
            problems.append(
                f"pipeline rank {r} holds no MoE layer (its layers are among model.first_k_dense="
                f"{rc.model.first_k_dense}): megatron's MoE loss all-reduce over the pipeline would "
                f"hang; give it more layers (parallel.first_stage_layers={rc.parallel.first_stage_layers})")
    return problems


def plan_run(rc: RunConfig, world_size: int, changes: Sequence[Change] = (), check_paths: bool = True) -> list:
    """The curriculum's stages, each checked as a whole run config, and ``changes`` (what the
    command line set: :func:`pretrain.config.overrides.changed_fields`) checked to reach a stage.
    Raises :class:`ConfigError` listing every problem; a problem shared by several stages is
    listed once with their names."""
    from pretrain.curriculum import plan

    stages, problems = plan(rc)
    implicit = not rc.curriculum.stages
    by_problem: dict[str, list[str]] = {}
    for st in stages:
        for p in check_run(st.rc, world_size, check_paths)[1]:
            by_problem.setdefault(p, []).append(st.name)
    for p, names in by_problem.items():
        if implicit:
            problems.append(p)
        elif len(names) == len(stages) > 1:
            problems.append(f"every stage: {p}")
        else:
            label = "stage" if len(names) == 1 else "stages"
            problems.append(f"{label} {', '.join(repr(n) for n in names)}: {p}")
    problems += faults.check(rc.faults)
    if rc.checkpoint.init_from:
        from checkpointing.state import resolve_init_from

        problems += [why for why in resolve_init_from(rc.checkpoint.init_from)[1:] if why]
    problems += reach(rc.curriculum.stages, [st.steps for st in stages], list(changes), rc.parallel.stages)[0]
    if problems:
        raise ConfigError("invalid run config" if implicit else "invalid curriculum", problems)
    return stages


def override_notes(rc: RunConfig, stages: list, changes: Sequence[Change]) -> list[str]:
    """Command-line changes that reach only some stages (the others set their own value)."""
    return reach(rc.curriculum.stages, [st.steps for st in stages], list(changes), rc.parallel.stages)[1]

