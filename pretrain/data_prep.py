"""Every stage's data, prepared before a run's ranks start: the tokenised corpora and the sample
index that each stage's ``build_datasets`` call (:func:`pretrain.stage.run_stage`) asks for.

``python -m data_pipeline.prepare [overrides]`` (:func:`main`: the config and overrides of
``python -m pretrain.train``) builds them in one process, stage by stage. A training launch
(:func:`before_process_group`, called by ``pretrain.train.run``) over several nodes only checks
them, on every rank from the file system alone, and stops with one error line naming the stage and
that command: a build inside the run keeps the other ranks waiting in a collective (0.1-0.3 h for
a stage of a multi-trillion-token corpus) past the process group's timeout. A one-node launch
builds what is missing itself, on rank 0 before any process group exists; its other ranks wait
for it in ``init_process_group`` (``parallel.timeout_minutes``).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from typing import Iterator, Optional, Sequence

from pretrain.config.errors import ConfigError

log = logging.getLogger(__name__)

NOTHING_TO_BUILD = "data: every stage's corpora and sample indices are prepared; nothing to build"
INDEX = "sample index"  #: data_pipeline.readiness.missing's name for it
SUBMITTED = "(submitted)"  #: ends a stage's line whose corpora went to Slurm
SUBMITTED_EXIT = 2  #: python -m data_pipeline.prepare: corpora went to Slurm; run it again after them


def stage_request(stage):
    """The ``build_datasets`` arguments :func:`pretrain.stage.run_stage` uses for ``stage``
    (a ``data_pipeline.readiness.DataRequest``)."""
    from data_pipeline.readiness import DataRequest

    rc, t = stage.rc, stage.rc.trainer
    return DataRequest(rc.data, t.seq_length, t.seed, rc.model.vocab_size,
                       num_samples=max(t.global_batch_size, stage.stream_samples),
                       valid_samples=t.eval_samples if t.eval_every else None)


def stages_to_run(stages: list, cur) -> list:
    """The stages a launch of this config may run: ``curriculum.start`` / ``only`` to the last (a
    resumed run runs the tail of them)."""
    from pretrain.curriculum import where_to_begin

    begin = where_to_begin(stages, cur, None)
    return stages[begin.stage:begin.last + 1]


def unprepared(stages: list, run_dir: str, check: bool = False) -> list[tuple[str, list]]:
    """``(stage name, what it lacks)`` for each of ``stages`` whose data is not all on disk, from
    the file system alone. ``check``: verify the prepared corpora against their manifests too."""
    from data_pipeline.readiness import missing

    found, out = {}, []
    for st in stages:
        req = stage_request(st)
        if req.key not in found:
            found[req.key] = missing(req, run_dir, check)
        if found[req.key]:
            out.append((st.name, found[req.key]))
    return out


def prepare_command(overrides: Optional[Sequence[str]]) -> str:
    """The commands that prepare a run launched with ``overrides`` (None: not known here)."""
    args = " <the run's overrides>" if overrides is None else "".join(" " + shlex.quote(o) for o in overrides)
    return f"python -m data_pipeline.prepare{args} (or sbatch slurm/prepare.sh{args})"


class DataNotPrepared(ConfigError):
    """A launch over several nodes whose stages' data is not on disk; one line, naming the first
    such stage, what it lacks and the command that prepares it."""

    def __init__(self, lacking: list[tuple[str, list]], overrides: Optional[Sequence[str]]):
        name, what = lacking[0]
        if [(w.thing, w.state) for w in what] == [(INDEX, "not built")]:
            first = f"stage {name!r} has no prepared sample index ({what[0].path})"
        else:
            first = f"stage {name!r} has unprepared data: " + "; ".join(str(w) for w in what)
        others = [n for n, _ in lacking[1:]]
        if others:
            first += (f"; {'stages' if len(others) > 1 else 'stage'} {', '.join(repr(n) for n in others)} "
                      f"{'lack' if len(others) > 1 else 'lacks'} prepared data too")
        self.line = (f"{first}: run {prepare_command(overrides)} before training (a run over several "
                     f"nodes does not build data while its ranks wait)")
        super().__init__("data not prepared", [self.line])

    def brief(self) -> str:
        return self.line


def data_errors() -> tuple:
    """The exceptions a data build or check raises for bad input, not bugs (a corpus that cannot
    be read, a damaged or unprepared one, data the config does not fit): what a launch and
    ``python -m data_pipeline.prepare`` print as one ``error:`` line (:func:`error_line`)."""
    from data_pipeline.config import DataConfigError
    from data_pipeline.readers import DataError  # CorpusDamaged is one

    return DataError, DataConfigError


def error_line(e: BaseException) -> str:
    """A data error's message on one line: the list of lines ``  - a``, ``  - b`` under a first line
    ``...:`` (e.g. the files of a damaged corpus) joined as ``...: a; b``."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    items = [ln[2:] if ln.startswith("- ") else ln for ln in lines[1:]]
    return f"{lines[0]} {'; '.join(items)}" if items else lines[0]


def before_process_group(rc, stages: list, env, overrides: Optional[Sequence[str]] = None,
                         group_given: bool = False) -> None:
    """What a training launch does about its data before any collective (``env``: this rank's
    ``parallel.initialize.DistEnv``; ``overrides``: the command line, for the error message;
    ``group_given``: a caller started the process group already).

    Over several nodes (:func:`parallel.initialize.spans_nodes`) every rank checks its stages on
    the file system (rank 0 also verifies the corpora) and raises :class:`DataNotPrepared` when
    any lacks data. On one node, rank 0 builds what is missing (the other ranks go on and wait
    for it in ``init_process_group``); with a caller's process group it leaves the build to the
    stages (megatron's builder then runs on every rank, rank 0 first)."""
    from parallel.initialize import spans_nodes

    run_dir = os.path.abspath(rc.trainer.run_dir)
    todo = stages_to_run(stages, rc.curriculum)
    if spans_nodes():
        lacking = unprepared(todo, run_dir, check=env.rank == 0)
        if lacking:
            raise DataNotPrepared(lacking, overrides)
        if env.rank == 0:
            log.info(NOTHING_TO_BUILD)
        return
    if env.rank != 0:
        return
    lacking = unprepared(todo, run_dir, check=True)
    if not lacking:
        log.info(NOTHING_TO_BUILD)
        return
    names = [n for n, _ in lacking]
    if group_given:
        log.info("data: stages %s lack data; each builds its own as it starts", ", ".join(names))
        return
    from pretrain.reporting.logs import children_to_file

    log.info("data: building the data of %s %s before the ranks start", "stages" if len(names) > 1 else "stage",
             ", ".join(repr(n) for n in names))
    with children_to_file(os.path.join(run_dir, "logs", f"rank{env.rank}.log")):  # DataTrove's workers
        for line in prepare_stages([st for st in todo if st.name in names], run_dir):
            log.info("data: %s", line)


def prepare_stages(stages: list, run_dir: str, submit: bool = False) -> Iterator[str]:
    """Build each stage's data (what it lacks; corpora verified, a damaged one set aside and
    rebuilt), yielding one line per stage: what was built or already there, and the seconds.
    ``submit``: corpora of ``data.preprocess.executor=slurm`` are submitted as Slurm jobs (the
    stage's line says so and its index waits for a later call) instead of refused."""
    from data_pipeline.readiness import build, index_dir, missing

    done: dict = {}
    queued: list = []  #: corpora submitted to Slurm by an earlier stage
    for st in stages:
        req = stage_request(st)
        if req.key in done:
            yield f"stage {st.name!r}: the same data as stage {done[req.key]!r} ({index_dir(req, run_dir)})"
            continue
        started = time.perf_counter()
        before = missing(req, run_dir, check=True)
        if before and submit and req.data.preprocess.executor == "slurm" and before[-1].thing != INDEX:
            from data_pipeline.config import active_weights
            from data_pipeline.preprocess import prepare

            names = [n for n in active_weights(req.data) if n not in queued]
            now = [n for n, out in prepare(req.data, names, allow_submit=True).items() if out is None] if names else []
            waiting = [n for n in active_weights(req.data) if n in queued or n in now]
            queued += now
            if waiting:
                yield (f"stage {st.name!r}: corpora {', '.join(waiting)} submitted to Slurm "
                       f"(data.preprocess.executor=slurm); run this again once they finish to build the "
                       f"sample index [{time.perf_counter() - started:.1f} s] {SUBMITTED}")
                continue
        if before:
            build(req, run_dir)
        done[req.key] = st.name
        what = "built " + ", ".join(w.thing for w in before) + (", " + INDEX if before[-1].thing != INDEX else "") \
            if before else "already prepared"
        yield f"stage {st.name!r}: {what} [{time.perf_counter() - started:.1f} s] ({index_dir(req, run_dir)})"


def main(argv: list[str]) -> int:
    """``python -m data_pipeline.prepare [overrides]``: exit status 0 every stage's data is
    prepared, 1 bad config or data (one ``error:`` line), 2 corpora were submitted to Slurm."""
    from pretrain.reporting import logs

    routing = logs.route(verbose="logger.verbose=true" in argv)  # megatron's import-time warnings off the console
    try:
        return _main(argv)
    finally:
        routing.close()


def _main(argv: list[str]) -> int:
    from pretrain.config.validation import plan_run
    from pretrain.config.command_line import hydra_problem

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.split("\n\n")[0] + "\n\nusage: python -m data_pipeline.prepare [the overrides of "
              "python -m pretrain.train ...]")
        return 0
    problem = hydra_problem(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        rc, stages = _plan(argv, plan_run)
        todo = stages_to_run(stages, rc.curriculum)
        run_dir = os.path.abspath(rc.trainer.run_dir)
        print(f"prepare: {len(todo)} stage{'s' if len(todo) != 1 else ''} of {run_dir} "
              f"({' '.join(argv) or 'no overrides'})", flush=True)
        submitted = False
        for line in prepare_stages(todo, run_dir, submit=True):
            submitted |= line.endswith(SUBMITTED)
            print(f"prepare: {line}", flush=True)
    except (ConfigError, *data_errors()) as e:
        print(f"error: {e.brief() if isinstance(e, ConfigError) else error_line(e)}", file=sys.stderr)
        return 1
    return SUBMITTED_EXIT if submitted else 0


def _plan(overrides: list[str], plan_run):
    """``(rc, stages)`` as ``pretrain.train`` resolves and validates them: at the run's cluster's
    world size where it names one (a recipe), else at the smallest world size every stage's
    layout divides (a world a launch could use is a multiple of it, so a config a launch accepts
    is accepted here; the data does not depend on the world size)."""
    from math import lcm

    from pretrain.config.cluster import cluster_world
    from pretrain.config.schema import compose
    from pretrain.curriculum import plan
    from pretrain.config.command_line import resolve

    rc, _, changes = resolve(compose(overrides), overrides)
    world = cluster_world(rc.cluster)
    if world:
        return rc, plan_run(rc, world, changes)
    world = 1
    for st in plan(rc)[0]:
        p = st.rc.parallel
        sizes = (p.tp * p.pp * p.cp, p.ep * p.expert_tp * p.pp)
        world = lcm(world, *(s for s in sizes if s > 0))
    return rc, plan_run(rc, world, changes)
