"""``python -m pretrain.train [hydra overrides]``: one training run (a curriculum of stages).

Validates every stage's config before any process group exists (and before megatron-core is
imported: bad input is one ``error:`` line, exit status 1, in seconds), starts torch.distributed
(torchrun or Slurm variables; gloo on CPU), finds where the run stands from its latest
checkpoint, runs the remaining stages (pretrain.stage) and prints a one-line JSON summary as the
last stdout line.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import atexit
import gc
import json
import logging
import os
import sys
import time

import hydra
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pretrain.reliability import faults

from pretrain.reporting import jsonl
from pretrain.config.command_line import hydra_problem, resolve
from pretrain.config.schema import RunConfig, register
from pretrain.reliability.run_lock import RunDirLock, RunDirLocked
from pretrain.config.validation import ConfigError, check_machine, override_notes, plan_run

register()


def read_metrics(path: str) -> list[dict]:
    """The last record of each step (a resumed run rewrites the steps after its checkpoint)."""
    by_step = {rec["step"]: rec for rec in jsonl.read(path)}
    return [by_step[s] for s in sorted(by_step)]


def _on_rank0(fn):
    """``fn()`` on rank 0, its outcome shared: every rank returns its result or raises its error."""
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = (True, fn())
        except (Exception, faults.Preempted) as e:  # noqa: BLE001 -- re-raised on every rank below
            outcome[0] = (False, e)
    dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _check_config_change(rc: RunConfig, stages, latest: str, state: dict, run_dir: str, rank: int,
                         record: bool = True) -> None:
    """A resume must train what its checkpoint trained (pretrain.config.resume_changes).
    ``record``: an accepted change is recorded in the run dir (not before the run holds it)."""
    from checkpointing import state as checkpoint
    from pretrain.config import resume_changes as config_change
    from pretrain.curriculum import plan

    old = config_change.checkpoint_config(checkpoint.read_common(latest))
    if old is None:
        return
    changes = config_change.training_changes(plan(old)[0], stages, state.get("stage") or stages[0].name,
                                             state.get("stage_step", 0))
    if not changes:
        return
    if not rc.checkpoint.allow_config_change:
        raise ConfigError(f"the config trains differently from the one {latest} was trained with "
                          f"(to accept and record it: checkpoint.allow_config_change=true)", changes)
    if record and rank == 0:
        config_change.record(run_dir, state.get("step", 0), changes, latest)
        logging.getLogger(__name__).warning(
            "config changed since %s (recorded in %s): %s", latest, config_change.HISTORY, "; ".join(changes))


def _check_checkpoint_files(latest: str, rank: "int | None" = None) -> None:
    """Before anything is read from it, on rank 0: the checkpoint's DCP metadata names only what
    such metadata holds (:mod:`checkpointing.safe_metadata`) and its data files hold every byte
    range it lists. Every rank raises rank 0's refusal (a collective); given this process's
    ``rank`` (before the process group), only rank 0 checks."""
    from checkpointing.dist_io import CheckpointFileError, check_files

    def check():
        try:
            check_files(latest)
        except CheckpointFileError as e:
            return str(e)
        return None

    if rank is None:
        problem = _on_rank0(check)
    else:
        problem = check() if rank == 0 else None
    if problem:
        raise ConfigError(f"cannot resume from {latest}", [problem])


def _check_optimizer_layout(stage, how: str, latest: str) -> None:
    """Before any model exists: the optimizer state this stage loads from ``latest`` (all of it
    when resuming, the moments when it carries them) must be in a format its layout can load."""
    from checkpointing import state as checkpoint

    if how == "resume" or (how == "carry" and stage.optimizer_state == "carry"):
        problem = checkpoint.optimizer_layout_problem(checkpoint.read_common(latest), stage.rc.parallel)
        if problem:
            raise ConfigError(f"cannot load the optimizer state of {latest} into stage {stage.name!r}", [problem])


def _resume_point(rc: RunConfig, stages, ckpt_dir: str, run_dir: str, rank: int, final: bool):
    """``(latest, its train state, where_to_begin)`` after every check that can refuse the
    launch. Twice: before anything is written to the run dir (the data build, ``.locks/``,
    ``logs/``, the lock), by every rank from the file system alone, the checkpoint's files by
    rank 0, so a refused launch leaves the run dir as it was; and ``final``, under the run-dir
    lock (the run that held it may have saved since), which records an accepted config change."""
    from checkpointing import state as checkpoint
    from pretrain.curriculum import where_to_begin

    try:
        latest = checkpoint.latest_checkpoint(ckpt_dir) if rc.checkpoint.resume else None
    except checkpoint.NoCompleteCheckpoint as e:
        raise ConfigError("cannot resume", [str(e)]) from None
    if latest:
        _check_checkpoint_files(latest, None if final else rank)
    latest_state = checkpoint.read_train_state(latest) if latest else None
    begin = where_to_begin(stages, rc.curriculum, latest_state)
    if latest and not begin.done:
        _check_optimizer_layout(stages[begin.stage], begin.how, latest)
    if latest:  # the last check (an accepted change is recorded in the run dir)
        _check_config_change(rc, stages, latest, latest_state, run_dir, rank, record=final)
    return latest, latest_state, begin


def _lock_and_data(lock: "RunDirLock | None", preemption, data) -> tuple:
    """Before the process group: rank 0 takes the run-dir ``lock`` (None on the other ranks) and
    every rank does ``data`` (:func:`pretrain.data_prep.before_process_group`), in the order that
    writes nothing in the run dir before the lock can refuse the launch. Over several nodes every
    rank only checks its data, from the file system: first, and its refusal is raised at once
    (each rank refuses on its own, before any contact). On one node rank 0 may build the sample
    index in the run dir: under the lock. Returns ``(the lock's warning, None)`` or ``(None, the
    refusal)`` of the lock or the build, for :func:`_shared_refusal` once the ranks are up (the
    other ranks wait for this one in ``init_process_group``, not for its exit)."""
    from parallel.initialize import spans_nodes
    from pretrain.data_prep import data_errors

    def prepare():
        with preemption.stopping("the data build"):
            data()

    several = spans_nodes()
    if several:
        prepare()
    try:
        took_over = lock.acquire() if lock is not None else None
        if lock is not None:
            atexit.register(lock.release)
        if not several:
            prepare()
    except (ConfigError, RunDirLocked, faults.Preempted, *data_errors()) as e:
        return None, e
    return took_over, None


def _shared_refusal(mine: "BaseException | None") -> "BaseException | None":
    """Right after the process group starts: the refusal a rank met before it (rank 0's: the
    run-dir lock, the data build it does alone on one node, a preemption signal during either),
    so every rank stops with the same line instead of waiting in a collective for a rank that
    stopped. This rank's own, else the lowest rank's (rebuilt from its class, args and attributes:
    a ConfigError's constructor does not take its message)."""
    world = dist.get_world_size()
    if world == 1:
        return mine
    everyone = [None] * world
    dist.all_gather_object(everyone, None if mine is None else (type(mine), mine.args, vars(mine)))
    if mine is not None:
        return mine
    for sent in everyone:
        if sent is not None:
            cls, args, attrs = sent
            refusal = cls.__new__(cls)
            refusal.args = args
            refusal.__dict__.update(attrs)
            return refusal
    return None


def _checkpoints_listing(ckpt_dir: str) -> "tuple | None":
    """What the checkpoint scan depends on: the folder's entries and what ``latest`` says."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return None
    try:
        with open(os.path.join(ckpt_dir, "latest"), "rb") as f:
            hint = f.read(256)
    except OSError:
        hint = None
    return tuple(names), hint


def _init_from_source(rc: RunConfig) -> "tuple[str, bool] | None":
    """``checkpoint.init_from`` as the folder the first stage loads and whether it has a
    manifest (None without init_from); a source gone since the config's check is refused here."""
    from checkpointing import state as checkpoint
    from checkpointing.files import MANIFEST

    if not rc.checkpoint.init_from:
        return None
    source, why = checkpoint.resolve_init_from(rc.checkpoint.init_from)
    if why:
        raise ConfigError("cannot start from checkpoint.init_from", [why])
    return source, os.path.isfile(os.path.join(source, MANIFEST))


def _raise_if_gone(given: str, source: str, had_manifest: bool) -> None:
    """After the first stage failed while starting from ``source``: a source deleted meanwhile
    (its run's retention) is named as such, instead of the load's traceback."""
    from checkpointing import state as checkpoint

    if os.path.isdir(source) and not (had_manifest and checkpoint.verify(source)):
        return
    raise ConfigError(f"checkpoint.init_from={given}", [
        f"{source} disappeared while this run loaded it (deleted meanwhile, e.g. by the checkpoint "
        f"retention of the run that wrote it); start from a checkpoint that stays: a stage's final "
        f"checkpoint (retention keeps those) or a copy"]) from None


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


def run(rc: RunConfig, config_yaml: str, changes=(), overrides=None) -> dict:
    """``changes``: what the command line set (:func:`pretrain.config.overrides.changed_fields`);
    ``overrides``: the command line itself (named in the data-preparation error, when known)."""
    from pretrain.reporting import console
    from pretrain.reporting import logs
    routing = logs.route(rc.logger.verbose)  # first: megatron logs and warns as it is imported
    started = time.time()
    from parallel.initialize import destroy_model_parallel_groups, dist_env, start_process_group

    env = dist_env()
    routing.rank = env.rank  # ranks > 0 keep our lines off the console from the start
    stages = plan_run(rc, env.world_size, changes)  # before megatron's imports: bad input fails fast
    check_machine(stages)  # what this machine lacks (the planner does not ask)
    if env.rank == 0:
        for note in override_notes(rc, stages, changes):
            print(f"note: {note}", file=sys.stderr, flush=True)
    from model_providers.glm5.model.specs import resolve_backend
    from parallel.megatron_compat import release_cached_modules, reset_loss_trackers
    from checkpointing import state as checkpoint
    from pretrain.data_prep import before_process_group
    from pretrain.reporting.metrics import MetricsSink
    from pretrain.reporting.plots import plot_curriculum
    from pretrain.run_context import RunContext
    from pretrain.stage import run_stage

    preemption = faults.PreemptionSignal()  # USR1/SIGTERM -> save after the current step, exit
    backend = resolve_backend(rc.model.layer_backend)
    owns_process_group = not dist.is_initialized()  # else: a caller's, kept for its next run
    run_dir = os.path.abspath(rc.trainer.run_dir)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    seen = _checkpoints_listing(ckpt_dir)
    checked = _resume_point(rc, stages, ckpt_dir, run_dir, env.rank, final=False)  # nothing written yet
    lock = RunDirLock(run_dir, rc.trainer.lock_wait_s,
                      pause=lambda s: preemption.sleep(s, "the wait for the run dir lock")) if env.rank == 0 else None
    took_over, refused = _lock_and_data(lock, preemption, lambda: before_process_group(
        rc, stages, env, overrides, group_given=not owns_process_group))
    start_process_group(env, rc.parallel.timeout_minutes, cpu_emulation_mode=rc.parallel.cpu_emulation)
    refused = _shared_refusal(refused)
    if refused is not None:
        if lock is not None:  # held when the data refused the launch: the next launch need not wait
            lock.release()
            atexit.unregister(lock.release)
        raise refused
    if took_over and env.rank == 0:
        logging.getLogger(__name__).warning(took_over)
    if preemption.agreed():  # a signal while the ranks started or waited: nothing to save yet
        raise faults.Preempted(preemption.agreed_signal, "the start of the run")
    if _on_rank0(lambda: _checkpoints_listing(ckpt_dir) == seen):  # as checked: record what it accepted
        latest, latest_state, begin = checked
        if latest and rc.checkpoint.allow_config_change:
            _check_config_change(rc, stages, latest, latest_state, run_dir, env.rank)
    else:  # another run saved (or its retention removed) checkpoints meanwhile
        latest, latest_state, begin = _resume_point(rc, stages, ckpt_dir, run_dir, env.rank, final=True)
    repaired = _on_rank0(lambda: jsonl.repair(metrics_path) if rc.checkpoint.resume else None)
    if repaired and env.rank == 0:
        logging.getLogger(__name__).warning(repaired)
    if env.rank == 0:  # after the last check that can refuse the launch
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(config_yaml)
    dist.barrier()
    log_path = routing.to_file(run_dir, env.rank)
    todo = [] if begin.done else stages[begin.stage:begin.last + 1]
    resolved = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=True)
    start_step = latest_state["step"] if latest_state else 0
    total = start_step + sum(st.steps for st in todo) - (
        latest_state.get("stage_step", 0) if latest_state and begin.how == "resume" else 0)
    sink = MetricsSink(rc.logger, run_dir, total, start_step, rc.trainer.name, resolved,
                       latest_state.get("wandb_run_id") if latest_state else None, env.rank)
    ctx = RunContext(env, run_dir, config_yaml, backend, sink, preemption,
                     faults.NonFinitePolicy(rc.faults))
    if env.rank == 0:
        start = console.start_text(begin.how, latest, latest_state, rc.checkpoint.init_from, begin.done)
        console.say(*console.banner(rc, todo, env.world_size, backend, run_dir, log_path,
                                    sink.wandb_where, start))
    how = begin.how
    source = _init_from_source(rc) if how == "fresh" else None
    for i, st in enumerate(todo):
        last = i == len(todo) - 1
        sink.event(console.stage_line(st, len(stages), how))
        following = stages[st.index + 1] if st.index + 1 < len(stages) else None
        try:
            run_stage(st, how, latest, ctx, save_final=rc.checkpoint.save_at_end or not last, following=following)
        except Exception:
            if source is not None and how == "fresh":
                _raise_if_gone(rc.checkpoint.init_from, *source)
            raise
        release_cached_modules()
        reset_loss_trackers()  # the next stage (or the next run in this process) starts with none
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
        "skipped_steps": sum(1 for rec in history if rec.get("skipped")),
        "diverged": faults.divergence(history, rc.faults) if history else None,
    }
    if env.rank == 0:
        console.say(*console.summary_lines(summary, time.time() - started))
    destroy_model_parallel_groups()
    dist.barrier()
    if owns_process_group:
        dist.destroy_process_group()
    if lock is not None:
        lock.release()
        atexit.unregister(lock.release)
    routing.close()
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task)
    try:
        summary = run(*resolve(cfg, overrides), overrides=overrides)
    except (ConfigError, RunDirLocked) as e:
        # bad input, not a bug: one line naming the field and value (a list when there are
        # several), exit status 1 and no traceback (Hydra prints one for any exception; it
        # lets SystemExit by)
        raise SystemExit(f"error: {e.brief() if isinstance(e, ConfigError) else e}") from None
    except faults.Preempted as e:  # a signal before the first step: nothing to save
        print(f"error: {e.line()}", file=sys.stderr, flush=True)
        raise SystemExit(faults.PREEMPTED_EXIT) from None
    except Exception as e:  # noqa: BLE001 -- a checkpoint save the disk refused, bad data: one line, status 1
        from checkpointing.files import CheckpointSaveError  # loaded: it is what raised
        from pretrain.data_prep import data_errors, error_line

        if isinstance(e, CheckpointSaveError):
            raise SystemExit(f"error: {e}") from None
        if isinstance(e, data_errors()):  # a corpus that cannot be read, a damaged or unprepared one
            raise SystemExit(f"error: {error_line(e)}") from None
        raise
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
        print(json.dumps(summary), flush=True)
    if summary["preempted"]:
        raise SystemExit(faults.PREEMPTED_EXIT)  # slurm/pretrain.sh requeues the job
    if summary["diverged"]:
        raise SystemExit(f"error: {summary['diverged']}")


if __name__ == "__main__":
    if not any(a.startswith("-") for a in sys.argv[1:]):  # Hydra's own flags (--help, --cfg) go to Hydra
        problem = hydra_problem(sys.argv[1:])
        if problem:
            raise SystemExit(f"error: {problem}")
    main()
