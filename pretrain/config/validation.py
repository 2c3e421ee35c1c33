"""Every check of a run's config, for every curriculum stage, before any process group exists.

Each check (model, parallel layout, schedule, data, faults, curriculum, command-line overrides,
the run dir, ``checkpoint.init_from``'s tensor shapes) returns a list of problems naming fields
and values; :func:`plan_run` gathers them, prefixes each stage's with its name, and raises one
:class:`~pretrain.config.errors.ConfigError` listing all. Before them, every number of the
config against its range (:mod:`pretrain.config.numbers`): those are named alone, since the
other checks compute with them.
"""

from __future__ import annotations

import os

from typing import Sequence

from pretrain.reliability import faults
from pretrain.config.cluster import cluster_problems
from pretrain.config.schema import RunConfig
from pretrain.config.errors import ConfigError
from pretrain.config.numbers import check_numbers
from pretrain.config.overrides import Change, reach, replaced_by_preset
from pretrain.reliability.run_lock import check_run_dir

__all__ = ["ConfigError", "check_machine", "check_run", "plan_run", "override_notes"]


def check_run(rc: RunConfig, world_size: int, check_paths: bool = True):
    """Problems of one (stage's) run config at ``world_size``: ``(layout or None, problems)``.
    ``check_paths=False`` leaves out what only the cluster can check (corpus and tokenizer files):
    the planner runs where they are not."""
    from data_pipeline.validation import check_data
    from model_providers.glm5.model.config import check_model
    from parallel.config import check_layout
    from parallel.features import check_features
    from pretrain.optim import check_moments, check_schedule

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
        mtp_num_steps=rc.model.mtp_num_steps,
    )
    problems += layout_problems
    problems += check_features(rc.parallel, rc.model, rc.precision.dtype)
    if rc.parallel.overlap_moe_expert_parallel_comm and rc.model.dsa.mode == "warmup":
        problems.append("parallel.overlap_moe_expert_parallel_comm=true cannot run with model.dsa.mode=warmup: "
                        "the warm-up runs the frozen network without autograd in the model's forward, which "
                        "megatron's combined 1F1B schedule does not call (its backward is only the indexers')")
    if layout is not None and rc.model.num_experts:
        problems += _dense_only_pipeline_ranks(rc, layout)
    problems += check_schedule(rc.scheduler, rc.optimizer, t.steps)
    problems += check_moments(rc.optimizer, rc.parallel.distributed_optimizer)
    if not (t.name or "").strip():
        problems.append(f"trainer.name={t.name!r} is empty: it names the run (its run dir runs/<name>, its W&B run)")
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


def check_machine(stages) -> None:
    """Refuse, naming each, the features of any stage this machine cannot run (CUDA, Transformer
    Engine, DeepEP): at launch only -- the planner sizes runs for GPUs it does not have."""
    import torch

    from parallel.features import machine_problems

    problems = []
    for st in stages:
        for p in machine_problems(
                st.rc.parallel, st.rc.precision, st.rc.optimizer, cuda=torch.cuda.is_available()):
            if p not in problems:
                problems.append(p)
    if problems:
        raise ConfigError("this run cannot start here", problems)


def plan_run(rc: RunConfig, world_size: int, changes: Sequence[Change] = (), check_paths: bool = True) -> list:
    """The curriculum's stages, each checked as a whole run config, and ``changes`` (what the
    command line set: :func:`pretrain.config.overrides.changed_fields`) checked to reach a stage.
    Raises :class:`ConfigError` listing every problem; a problem shared by several stages is
    listed once with their names."""
    from pretrain.curriculum import IMPLICIT_STAGE, PRESET_STAGE_KEYS, plan

    check_numbers(rc)  # first: the checks below compute with these numbers
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
    of_stages = len(problems)
    problems += faults.check(rc.faults)
    problems += cluster_problems(rc.cluster, world_size)
    problems += check_run_dir(rc.trainer.run_dir, on_this_host=check_paths)
    if check_paths and not rc.checkpoint.resume:
        problems += fresh_start_problems(rc.trainer.run_dir)
    source = None
    if rc.checkpoint.init_from:
        from checkpointing.state import resolve_init_from

        source, why = resolve_init_from(rc.checkpoint.init_from)
        problems += [why] if why else []
    problems += reach(rc.curriculum.stages, [st.steps for st in stages], list(changes), rc.parallel.stages)[0]
    if implicit and IMPLICIT_STAGE in rc.parallel.stages:
        problems += replaced_by_preset(list(changes), rc.parallel.stages[IMPLICIT_STAGE], IMPLICIT_STAGE,
                                       PRESET_STAGE_KEYS)
    if source and not problems:  # the model builds (on meta) only from a config that validates
        from pretrain.curriculum import where_to_begin

        problems += init_from_shapes(stages[where_to_begin(stages, rc.curriculum, None).stage].rc, source)
    if problems:  # the title names the curriculum only when its stages have a problem
        raise ConfigError("invalid curriculum" if of_stages and not implicit else "invalid run config", problems)
    return stages


def fresh_start_problems(run_dir: str) -> list[str]:
    """``checkpoint.resume=false`` trains from scratch: never into a run dir that holds another
    run's checkpoints (its saves would replace them and its metrics follow theirs)."""
    from checkpointing.state import START_ELSEWHERE, holds_checkpoints

    ckpt_dir = os.path.join(run_dir, "checkpoints")
    held = holds_checkpoints(ckpt_dir)
    if not held:
        return []
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return [f"checkpoint.resume=false: trainer.run_dir={run_dir} holds checkpoints ({shown} in {ckpt_dir}) "
            f"that a fresh run would overwrite; {START_ELSEWHERE}, or continue them (checkpoint.resume=true)"]


def checkpoint_shapes(rc: RunConfig) -> dict[str, tuple]:
    """Global shape of every tensor the model of ``rc`` (one stage's run config) stores in a
    megatron dist checkpoint, by key (local-backend names), in model order: from the 1-rank model
    built on ``meta`` under stand-in parallel state (no memory, no process group, so a 744B
    config on a login node too, and the run's own initialisation later is untouched). A dist
    checkpoint is global -- its keys and shapes are the same at any TP/PP/EP layout -- except the
    padded vocabulary (a multiple of ``make_vocab_size_divisible_by * tp``), sized here for
    ``rc.parallel.tp``."""
    import dataclasses

    import torch

    from checkpointing.dist_io import global_shapes
    from model_providers.glm5.model.config import to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig
    from parallel.megatron_compat.meta_rank import rank_position

    m = rc.model
    model = dataclasses.replace(m, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by * rc.parallel.tp)
    ep = m.num_experts or 1  # one local expert per layer: the expert axis is global all the same
    tcfg = to_transformer_config(model, ParallelConfig(ep=ep), rc.precision)
    tcfg.use_cpu_initialization, tcfg.perform_initialization = True, False  # follow meta, no init
    tcfg.moe_grouped_gemm = False  # the local spec (Transformer Engine allocates on the GPU)
    with rank_position(tp=1, pp=1, cp=1, dp=ep, ep=ep, expert_tp=1, expert_dp=1, world_size=ep):
        with torch.device("meta"):
            (chunk,) = build_model_chunks(model, tcfg, "local")
        return global_shapes(chunk.sharded_state_dict())


def init_from_shapes(rc: RunConfig, source: str) -> list[str]:
    """``checkpoint.init_from`` (resolved to the checkpoint folder ``source``) holds every tensor
    of the model ``rc`` configures, each with its shape, read from the checkpoint's metadata:
    a checkpoint of another model is refused here, before the run dir exists, rather than by
    megatron's load after the banner."""
    from checkpointing.dist_io import shape_mismatch

    why = shape_mismatch(source, checkpoint_shapes(rc))
    return [f"checkpoint.init_from={rc.checkpoint.init_from}: {why}"] if why else []


def override_notes(rc: RunConfig, stages: list, changes: Sequence[Change]) -> list[str]:
    """Command-line changes that reach only some stages (the others set their own value)."""
    return reach(rc.curriculum.stages, [st.steps for st in stages], list(changes), rc.parallel.stages)[1]

