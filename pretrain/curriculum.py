"""Curricula: training as an ordered list of stages inside one run.

A stage overrides a few fields of the run config (sequence length, batch, LR schedule, data
mixture, DSA mode, trainable parameters, RoPE, parallel layout) for a token or step budget.
:func:`plan` turns the config into one fully-resolved :class:`Stage` per stage, each carrying the
``RunConfig`` that stage trains with, so every existing check (model, layout, data, schedule)
runs on every stage before any compute. :func:`where_to_begin` reads the latest checkpoint's
position and says which stage to run next and how its state is obtained.

With no stages declared, the run is one implicit stage named ``pretrain`` built from
``trainer`` / ``optimizer`` / ``scheduler`` as they are.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from pretrain.config.errors import ConfigError

IMPLICIT_STAGE = "pretrain"
OPTIMIZER_STATES = ("carry", "reset")
LR_STYLES = ("cosine", "linear", "constant", "wsd")


@dataclass
class StageLRConfig:
    """One stage's schedule (megatron ``OptimizerParamScheduler``): linear warm-up from ``init``
    to ``peak`` over ``warmup_steps``, then ``style`` decay from ``peak`` to ``end`` over the rest
    of the stage. With ``warmup_steps: 0`` the stage's first step runs at ``peak``. It applies to
    every parameter group; a separate ``optimizer.muon.lr`` keeps its ratio to ``optimizer.lr``.
    A field left null takes the run's value (named after each field)."""

    peak: Optional[float] = None  #: null = optimizer.lr
    end: Optional[float] = None  #: null = optimizer.min_lr
    init: Optional[float] = None  #: warm-up start (used only when warmup_steps > 0); null = scheduler.init_lr
    warmup_steps: Optional[int] = None  #: null = scheduler.warmup_steps
    style: Optional[str] = None  #: cosine | linear | constant | wsd; null = scheduler.style
    wsd_decay_steps: Optional[int] = None  #: wsd: length of the final decay; null = scheduler.wsd_decay_steps (null: 20% of the stage)


@dataclass
class StageConfig:
    """One stage's fields; a field left null (or a dict key left out) takes the run's value
    (``trainer.*``, ``optimizer.*``, ``scheduler.*``, ``model.*``, ``parallel.*``, ``data.*``)."""

    name: str = "stage"
    tokens: Optional[float] = None  #: budget in tokens (rounded up to whole steps) ...
    steps: Optional[int] = None  #: ... or in optimizer steps; at most one of the two; neither = trainer.steps
    seq_length: Optional[int] = None  #: null = trainer.seq_length
    global_batch_size: Optional[int] = None  #: sequences per optimizer step; null = trainer.global_batch_size
    micro_batch_size: Optional[int] = None  #: null = trainer.micro_batch_size
    lr: StageLRConfig = field(default_factory=StageLRConfig)
    mixture: Optional[str] = None  #: data mixture name; null = data.mixture
    dsa_mode: Optional[str] = None  #: dense | warmup | sparse; null = model.dsa.mode (none, no indexer: only dense or none)
    trainable: List[str] = field(default_factory=list)  #: regexes over parameter names; empty = all the DSA mode trains
    rope_theta: Optional[float] = None  #: null = model.rope_theta
    rope_type: Optional[str] = None  #: rope | yarn; null = model.rope_type
    yarn: Dict[str, Any] = field(default_factory=dict)  #: overrides of model.yarn.* (e.g. factor) for this stage
    recompute: Optional[str] = None  #: activation recomputation for this stage (none | selective | full); null = model.recompute
    parallel: Dict[str, Any] = field(default_factory=dict)  #: overrides of parallel.* for this stage
    optimizer_state: str = "carry"  #: carry (Adam moments continue) | reset (fresh optimizer)
    eval_every: Optional[int] = None  #: validation every N steps and at the stage end; null = trainer.eval_every


@dataclass
class CurriculumConfig:
    stages: List[StageConfig] = field(default_factory=list)  #: empty = one stage from trainer/optimizer/scheduler
    start: Optional[str] = None  #: begin at this stage (earlier ones are taken as done)
    only: Optional[str] = None  #: run exactly this stage, then stop (one Slurm job per stage)
    plot: bool = True  #: write <run_dir>/curriculum.png at each stage end


@dataclass
class Stage:
    """A resolved stage: its index, name, step count and the run config it trains with."""

    index: int
    name: str
    steps: int
    rc: Any  #: pretrain.config.schema.RunConfig with this stage's overrides applied
    optimizer_state: str
    trainable: List[str]
    data_offset: int = 0  #: samples of this stage's data stream consumed by earlier stages
    stream_samples: int = 0  #: samples the whole stream needs (every stage on it builds the same dataset)
    continues: Optional[str] = None  #: the earlier stage whose data stream this one continues (None: its own)


    @property
    def tokens_per_step(self) -> int:
        return self.rc.trainer.global_batch_size * self.rc.trainer.seq_length

    def trains_signature(self) -> tuple:
        """What decides the optimizer's parameter set (state can carry only when equal)."""
        return (self.rc.model.dsa.mode, tuple(self.trainable))


def _or(value, run_value):
    return run_value if value is None else value


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _stage_steps(s: StageConfig, rc, where: str, problems: list) -> int:
    if s.tokens is not None and s.steps is not None:
        problems.append(f"{where}: set one of tokens ({s.tokens}) and steps ({s.steps}), not both")
        return 0
    if s.tokens is None:
        steps = _or(s.steps, rc.trainer.steps)
        if steps <= 0:
            problems.append(f"{where}.steps={steps} must be > 0")
        return steps
    if not _positive(s.tokens):  # inf too: no whole number of steps
        problems.append(f"{where}.tokens={s.tokens} must be a finite number > 0")
        return 0
    per_step = _or(s.global_batch_size, rc.trainer.global_batch_size) * _or(s.seq_length, rc.trainer.seq_length)
    return math.ceil(s.tokens / per_step) if per_step > 0 else 0


def _apply(rc, s: StageConfig, steps: int, where: str, problems: list):
    """A copy of ``rc`` with the fields the stage sets."""
    out = copy.deepcopy(rc)
    t = out.trainer
    t.steps = steps
    t.seq_length = _or(s.seq_length, t.seq_length)
    t.global_batch_size = _or(s.global_batch_size, t.global_batch_size)
    if s.micro_batch_size is not None:
        t.micro_batch_size = s.micro_batch_size
    if s.eval_every is not None:
        t.eval_every = s.eval_every
    if s.mixture is not None:
        out.data.mixture = s.mixture
    if s.dsa_mode is not None and not (s.dsa_mode == "dense" and out.model.dsa.mode == "none"):
        out.model.dsa.mode = s.dsa_mode  # a dense stage of a model without an indexer stays none
    if s.rope_theta is not None:
        out.model.rope_theta = s.rope_theta
    if s.rope_type is not None:
        out.model.rope_type = s.rope_type
    if s.yarn:
        out.model.yarn = _merged(out.model.yarn, s.yarn, f"{where}.yarn", problems)
    if s.recompute is not None:
        out.model.recompute = None if s.recompute == "none" else s.recompute
    if s.parallel:
        out.parallel = _merged(out.parallel, s.parallel, f"{where}.parallel", problems)
    if s.name in rc.parallel.stages:  # the cluster preset's layout for this stage comes last
        _apply_preset_entry(out, rc.parallel.stages[s.name], s.name, problems)
    opt, sch = out.optimizer, out.scheduler
    opt.lr, opt.min_lr = _or(s.lr.peak, opt.lr), _or(s.lr.end, opt.min_lr)
    muon = opt.muon
    if muon.lr is not None:  # a separate Muon LR keeps its ratio to the stage's schedule
        ratio = muon.lr / rc.optimizer.lr if _positive(rc.optimizer.lr) else 1.0  # else: plan() reports it
        muon.lr, muon.min_lr = opt.lr * ratio, opt.min_lr * ratio
    else:
        muon.min_lr = None
    sch.style = _or(s.lr.style, sch.style)
    sch.init_lr = _or(s.lr.init, sch.init_lr)
    sch.warmup_steps = _or(s.lr.warmup_steps, sch.warmup_steps)
    sch.decay_steps = steps
    sch.wsd_decay_steps = _or(s.lr.wsd_decay_steps, sch.wsd_decay_steps)
    return out


def _merged(base, overrides: dict, where: str, problems: list):
    """``base`` (a dataclass) with a stage's ``overrides`` merged in, type-checked by OmegaConf;
    on a bad key or value, a problem naming the stage field and ``base`` unchanged."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(base), dict(overrides)))
    except Exception as e:  # noqa: BLE001 -- OmegaConf's key/type errors
        known = [f.name for f in fields(base)]
        problems.append(f"{where}={dict(overrides)}: {str(e).splitlines()[0]} "
                        f"({type(base).__name__} fields: {known})")
        return base


def _check_stage(s: StageConfig, st: Stage, where: str) -> list:
    """Problems of one stage's own fields, checked on the values it trains with (a field the
    stage leaves null is named by its run field)."""
    def name(stage_field: str, run_field: str) -> str:
        lr_field = stage_field.startswith("lr.")
        own = getattr(s.lr, stage_field[3:]) if lr_field else getattr(s, stage_field)
        return f"{where}.{stage_field}" if own is not None else f"{run_field} (for {where})"

    p = []
    t, opt, sch = st.rc.trainer, st.rc.optimizer, st.rc.scheduler
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", s.name or ""):
        p.append(f"{where}.name={s.name!r} must be a non-empty word (letters, digits, _ . -)")
    if t.seq_length <= 0:
        p.append(f"{name('seq_length', 'trainer.seq_length')}={t.seq_length} must be > 0")
    if t.global_batch_size <= 0:
        p.append(f"{name('global_batch_size', 'trainer.global_batch_size')}={t.global_batch_size} must be > 0")
    if s.optimizer_state not in OPTIMIZER_STATES:
        p.append(f"{where}.optimizer_state={s.optimizer_state!r} must be one of {list(OPTIMIZER_STATES)}")
    if sch.style not in LR_STYLES:
        p.append(f"{name('lr.style', 'scheduler.style')}={sch.style!r} must be one of {list(LR_STYLES)}")
    lrs = {name('lr.peak', 'optimizer.lr'): opt.lr, name('lr.end', 'optimizer.min_lr'): opt.min_lr,
           name('lr.init', 'scheduler.init_lr'): sch.init_lr}
    non_finite = [f"{n}={v} must be a finite number" for n, v in lrs.items() if not math.isfinite(v)]
    p += non_finite
    if math.isfinite(opt.lr) and opt.lr <= 0:
        p.append(f"{name('lr.peak', 'optimizer.lr')}={opt.lr} must be > 0")
    if not non_finite and (opt.min_lr < 0 or sch.init_lr < 0):
        p.append(f"{name('lr.end', 'optimizer.min_lr')}={opt.min_lr} and "
                 f"{name('lr.init', 'scheduler.init_lr')}={sch.init_lr} must be >= 0")
    if sch.warmup_steps < 0 or (st.steps and sch.warmup_steps >= st.steps):  # megatron asserts it
        p.append(f"{name('lr.warmup_steps', 'scheduler.warmup_steps')}={sch.warmup_steps} must be in "
                 f"[0, the stage's {st.steps} steps)")
    for pattern in s.trainable:
        try:
            re.compile(pattern)
        except re.error as e:
            p.append(f"{where}.trainable: {pattern!r} is not a regex ({e})")
    d = st.rc.model.dsa
    if d.mode in ("warmup", "sparse"):
        if d.index_heads < 1 or d.index_head_dim < 1 or d.topk < 1:
            p.append(f"{where}.dsa_mode={d.mode} needs the DSA indexer fields: model.dsa.index_heads="
                     f"{d.index_heads}, index_head_dim={d.index_head_dim}, topk={d.topk} must be >= 1")
        if d.kl_coeff <= 0:
            p.append(f"{where}.dsa_mode={d.mode} trains the indexer through its KL loss, but "
                     f"model.dsa.kl_coeff={d.kl_coeff}")
    return p


def _indexer_problems(s: StageConfig, model_mode: str, where: str) -> list:
    """``model.dsa.mode=none`` builds no indexer (DeepSeek-V3): whether the network has one is
    the model's, not a stage's, so a stage may not switch between none and the indexer modes
    (its checkpoint would lack, or carry, the indexer's parameters). A dense stage (attention over
    every key, no indexer computed) is what such a model does anyway: it stays none."""
    if s.dsa_mode is None or (s.dsa_mode == "none") == (model_mode == "none") or \
            (s.dsa_mode, model_mode) == ("dense", "none"):
        return []
    if model_mode == "none":
        return [f"{where}.dsa_mode={s.dsa_mode} needs the DSA lightning indexer, but model.dsa.mode=none "
                "builds none (a model without one, such as DeepSeek-V3: leave the stage's dsa_mode unset or dense)"]
    return [f"{where}.dsa_mode=none removes the DSA indexer that model.dsa.mode={model_mode} builds: "
            "set model.dsa.mode=none for a model without one"]


#: what a cluster preset's stage entry (``parallel.stages.<name>``) may set besides ``parallel``
#: fields: the memory knobs that go with a layout on a cluster (Megatron-Bridge's per-GPU
#: performance configs set them with TP/PP/EP); none of them changes what is trained
PRESET_STAGE_KEYS = {"recompute": "model.recompute", "recompute_modules": "model.recompute_modules",
                     "micro_batch_size": "trainer.micro_batch_size"}


def _apply_preset_entry(out, entry: dict, name: str, problems: list) -> None:
    """``out`` (a stage's run config, changed in place) with the cluster preset's entry for it."""
    layout = dict(entry)
    knobs = {k: layout.pop(k) for k in PRESET_STAGE_KEYS if k in layout}
    if "timeout_minutes" in layout:  # the process group starts once, before any stage
        problems.append(f"parallel.stages.{name}.timeout_minutes: one timeout serves the whole run "
                        f"(set parallel.timeout_minutes)")
    if knobs.get("recompute") is not None:
        out.model.recompute = None if knobs["recompute"] == "none" else knobs["recompute"]
    if knobs.get("recompute_modules") is not None:
        out.model.recompute_modules = list(knobs["recompute_modules"])
    if knobs.get("micro_batch_size") is not None:
        out.trainer.micro_batch_size = knobs["micro_batch_size"]
    out.parallel = _merged(out.parallel, layout, f"parallel.stages.{name}", problems)


def plan(rc) -> tuple[List[Stage], List[str]]:
    """Resolve every stage; returns the stages and the problems found (empty when it can run)."""
    cur = rc.curriculum
    if not cur.stages:
        if cur.start not in (None, IMPLICIT_STAGE) or cur.only not in (None, IMPLICIT_STAGE):
            return [], [f"curriculum.start={cur.start!r} / curriculum.only={cur.only!r}: the "
                        f"curriculum has no stages (only the implicit {IMPLICIT_STAGE!r})"]
        problems, run = [], rc
        if IMPLICIT_STAGE in rc.parallel.stages:  # a cluster preset's entry for the one stage
            run = copy.deepcopy(rc)
            _apply_preset_entry(run, rc.parallel.stages[IMPLICIT_STAGE], IMPLICIT_STAGE, problems)
        return [Stage(0, IMPLICIT_STAGE, run.trainer.steps, run, "carry", [], 0,
                      run.trainer.steps * run.trainer.global_batch_size)], problems
    problems, stages = [], []
    m = rc.optimizer.muon
    if rc.optimizer.name == "muon" and m.lr is not None and not _positive(rc.optimizer.lr):
        problems.append(f"optimizer.lr={rc.optimizer.lr} must be a finite number > 0: each stage's "
                        f"optimizer.muon.lr keeps its ratio to it (optimizer.muon.lr={m.lr})")
    for i, s in enumerate(cur.stages):
        where = f"curriculum.stages[{i}] ({s.name})"
        steps = _stage_steps(s, rc, where, problems)
        st = Stage(i, s.name, steps, _apply(rc, s, steps, where, problems), s.optimizer_state,
                   list(s.trainable))
        problems += _check_stage(s, st, where)
        problems += _indexer_problems(s, rc.model.dsa.mode, where)
        stages.append(st)
    _assign_data_offsets(stages)
    names = [s.name for s in stages]
    for n in rc.parallel.stages:
        if n not in names:
            problems.append(f"parallel.stages.{n}: no curriculum stage is named {n!r} (stages: {names})")
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"curriculum.stages: the name {n!r} is used more than once")
    for key in ("start", "only"):
        v = getattr(cur, key)
        if v is not None and v not in names:
            problems.append(f"curriculum.{key}={v!r} is not a stage ({names})")
    if cur.start is not None and cur.only is not None:
        problems.append(f"curriculum.start={cur.start!r} and curriculum.only={cur.only!r}: set one")
    for prev, st in zip(stages, stages[1:]):
        if st.optimizer_state == "carry" and st.trains_signature() != prev.trains_signature():
            problems.append(
                f"curriculum.stages[{st.index}] ({st.name}).optimizer_state=carry, but it trains other "
                f"parameters than {prev.name!r} (dsa mode/trainable {st.trains_signature()} vs "
                f"{prev.trains_signature()}); use optimizer_state: reset")
    return stages, problems


def _assign_data_offsets(stages: List[Stage]) -> None:
    """Stages that read the same data stream (same data config, mixture and sequence length, so
    the same blended dataset) continue it instead of re-reading its first samples."""
    consumed: dict = {}
    last_on: dict = {}
    for st in stages:
        key = (repr(st.rc.data), st.rc.trainer.seq_length, st.rc.trainer.seed)
        st.data_offset = consumed.get(key, 0)
        st.continues = last_on.get(key)
        consumed[key] = st.data_offset + st.steps * st.rc.trainer.global_batch_size
        last_on[key] = st.name
    for st in stages:
        st.stream_samples = consumed[(repr(st.rc.data), st.rc.trainer.seq_length, st.rc.trainer.seed)]


@dataclass
class Begin:
    """Where the run picks up. ``how``: ``fresh`` (initialise, or ``checkpoint.init_from``),
    ``resume`` (full state of a checkpoint inside this stage), ``carry`` (weights -- and optimizer
    when the stage carries it -- from the previous stage's final checkpoint)."""

    stage: int
    how: str
    last: int  #: index of the last stage this run executes
    done: bool = False  #: nothing left to run


def where_to_begin(stages: List[Stage], cur: CurriculumConfig, latest: Optional[dict]) -> Begin:
    """``latest``: the train state of the newest checkpoint (None when there is none)."""
    names = [s.name for s in stages]
    first = names.index(cur.start or cur.only) if (cur.start or cur.only) else 0
    last = names.index(cur.only) if cur.only else len(stages) - 1
    if latest is None:
        return Begin(first, "fresh", last)
    stage_name = latest.get("stage") or names[0]
    if stage_name not in names:
        raise ConfigError("cannot resume", [
            f"the latest checkpoint is in stage {stage_name!r}, which this curriculum does not "
            f"have ({names}); use a new run dir or add it back"])
    j = names.index(stage_name)
    finished = latest.get("stage_step", 0) >= stages[j].steps
    at, how = (j + 1, "carry") if finished else (j, "resume")
    if at < first:
        if cur.only is not None:
            pos = (f"the end of stage {stage_name!r}" if finished else
                   f"step {latest.get('stage_step', 0)}/{stages[j].steps} of stage {stage_name!r}")
            raise ConfigError("cannot resume", [
                f"curriculum.only={cur.only!r}, but the latest checkpoint is at {pos}: run the "
                f"stages before {cur.only!r} first"])
        return Begin(first, "carry", last)
    if at > last:
        return Begin(at, how, last, done=True)
    return Begin(at, how, last)
