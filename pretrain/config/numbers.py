"""Every number of a run's config against its range, from one table, before anything else.

:data:`RUN_RULES` maps each numeric field of :class:`~pretrain.config.schema.RunConfig` (a dotted
name; ``*`` stands for a corpus name or a curriculum stage) to a :class:`Rule` -- a finite number,
in a range -- or to :class:`Elsewhere`, naming the check of its own group that already refuses
every bad value of it (NaN and inf included) and the fields it is compared with. A field that
is in neither fails ``tests/unit/config/test_numeric_fields.py``, so a new number gets a rule.

:func:`pretrain.config.validation.plan_run` (``python -m pretrain.train``, ``python -m
data_pipeline.prepare``) and the planner call :func:`check_numbers` first: a NaN, an infinity, a
negative count or a zero divisor is named alone, before the checks that compute with it (a
layout, a step count, a schedule) run on a value they would misread or divide by. The other
command-line tools (``planner.cluster``, ``model_providers.glm5.hf.cli``,
``benchmarks.gpu_check``) check their own numbers with :class:`Rule` too.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Optional

from pretrain.config.errors import ConfigError

UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Rule:
    """``lo <= value <= hi`` (``<`` on an open end), finite; ``integer``: a whole number;
    ``optional``: null allowed; ``note`` follows the message (what 0 means, say)."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False
    note: str = ""

    def problem(self, name: str, value: Any) -> Optional[str]:
        """None when ``value`` obeys the rule, else one line naming ``name`` and ``value``."""
        if value is None and self.optional:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and self.integer:
            ok = float(value).is_integer()
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        if ok and self.hi is not None:
            ok = value < self.hi if self.hi_open else value <= self.hi
        if ok:
            return None
        return f"{name}={value} must be {self.describe()}"

    def describe(self) -> str:
        parts = [] if self.integer else ["a finite number"]  # a count's type is the schema's
        lo, hi = _show(self.lo), _show(self.hi)
        if self.lo is not None and self.hi is not None:
            parts.append(f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {lo}")
        elif self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {hi}")
        what = " ".join(parts) + (" or null" if self.optional else "")
        return what + (f" ({self.note})" if self.note else "")


def _show(x: Optional[float]) -> str:
    return "" if x is None else str(int(x)) if float(x).is_integer() else str(x)


def count(lo: int = 0, hi: Optional[int] = None, optional: bool = False, note: str = "") -> Rule:
    """A whole number in ``[lo, hi]``."""
    return Rule(lo=lo, hi=hi, integer=True, optional=optional, note=note)


def positive(optional: bool = False, note: str = "") -> Rule:
    """A finite number > 0."""
    return Rule(lo=0, lo_open=True, optional=optional, note=note)


def non_negative(optional: bool = False, note: str = "") -> Rule:
    """A finite number >= 0."""
    return Rule(lo=0, optional=optional, note=note)


FINITE = Rule()  #: any finite number (the range is checked with the fields it depends on)


@dataclass(frozen=True)
class Elsewhere:
    """The field's range is checked, with the fields it is compared with, by ``check``."""

    check: str


_MODEL = "model_providers.glm5.model.config.check_model"
_LAYOUT = "parallel.config.check_layout"
_DATA = "data_pipeline.validation.check_data"
_SCHEDULE = "pretrain.optim.schedule.check_schedule"
_MUON = "pretrain.optim.schedule.check_muon (when optimizer.name=muon)"
_STAGE = "pretrain.curriculum.plan (on the values the stage trains with)"

#: every numeric field of RunConfig -> its Rule (or the check that covers it)
RUN_RULES: dict[str, Rule | Elsewhere] = {
    # model (model_providers/glm5/model/config.py: GLM5Config, YarnConfig, DSAConfig)
    "model.num_layers": count(1),
    "model.first_k_dense": Elsewhere(_MODEL),  # in [0, num_layers]
    "model.hidden_size": count(1),
    "model.ffn_hidden_size": count(1),
    "model.num_attention_heads": count(1),
    "model.q_lora_rank": count(1),
    "model.kv_lora_rank": count(1),
    "model.qk_nope_head_dim": count(1),
    "model.qk_rope_head_dim": count(2, note="even"),  # evenness: check_model
    "model.v_head_dim": count(1),
    "model.vocab_size": count(1),  # against the tokenizer's: check_data
    "model.make_vocab_size_divisible_by": count(1),
    "model.max_position_embeddings": count(1),
    "model.rope_theta": positive(),
    # yarn: only finite here; the ranges (factor > 1, beta_fast > beta_slow > 0, mscales >= 0)
    # are check_model's, with rope_type=yarn only (plain RoPE ignores model.yarn)
    "model.yarn.factor": FINITE,
    "model.yarn.original_max_position_embeddings": Elsewhere(_MODEL + " (with rope_type=yarn)"),
    "model.yarn.beta_fast": FINITE,
    "model.yarn.beta_slow": FINITE,
    "model.yarn.mscale": FINITE,
    "model.yarn.mscale_all_dim": FINITE,
    "model.norm_eps": positive(),
    "model.init_std": positive(),
    "model.num_experts": count(1, optional=True, note="null: a dense model"),
    "model.moe_topk": Elsewhere(_MODEL),  # in [1, num_experts]
    "model.moe_ffn_hidden_size": count(1),
    "model.num_shared_experts": count(0),
    "model.moe_routed_scaling_factor": positive(),
    "model.moe_bias_update_rate": non_negative(),
    "model.moe_aux_loss_coeff": non_negative(),
    "model.moe_router_groups": count(1),  # divides num_experts: check_model
    "model.moe_router_group_topk": count(1),
    "model.mtp_num_steps": Elsewhere(_MODEL),
    "model.mtp_loss_scale": non_negative(),
    "model.dsa.index_heads": Elsewhere(_MODEL),
    "model.dsa.index_head_dim": count(1),
    "model.dsa.topk": Elsewhere(_MODEL),
    "model.dsa.kl_coeff": non_negative(),  # > 0 for the indexer-training stages: pretrain.curriculum
    "model.dsa.query_chunk": Elsewhere(_MODEL),
    # parallel (parallel/config.py)
    "parallel.tp": Elsewhere(_LAYOUT),
    "parallel.pp": Elsewhere(_LAYOUT),
    "parallel.vpp": Elsewhere(_LAYOUT),
    "parallel.ep": Elsewhere(_LAYOUT),
    "parallel.etp": Elsewhere(_LAYOUT),
    "parallel.cp": Elsewhere(_LAYOUT),
    "parallel.first_stage_layers": Elsewhere(_LAYOUT),
    "parallel.last_stage_layers": Elsewhere(_LAYOUT),
    "parallel.timeout_minutes": Elsewhere(_LAYOUT),
    # data (data_pipeline/config.py)
    "data.valid_samples": Elsewhere(_DATA),
    "data.max_group_documents": Elsewhere(_DATA),
    "data.index_threads": Elsewhere(_DATA),
    "data.sample_seed": count(0, UINT32_MAX, note="numpy's seed range"),
    "data.tokenizer.vocab_size": Elsewhere(_DATA),
    "data.tokenizer.train_bytes_per_corpus": count(1),
    "data.preprocess.workers": Elsewhere(_DATA),
    "data.preprocess.tasks": Elsewhere(_DATA),
    "data.preprocess.batch_size": Elsewhere(_DATA),
    "data.preprocess.slurm.cpus_per_task": count(1),
    "data.preprocess.slurm.mem_per_cpu_gb": count(1),
    "data.corpora.*.max_invalid_utf8_fraction": Elsewhere(_DATA),
    # optimizer and schedule (pretrain/config/schema.py); min_lr <= lr and the rest: check_schedule
    "optimizer.lr": positive(),
    "optimizer.min_lr": non_negative(),
    "optimizer.weight_decay": non_negative(),
    "optimizer.beta1": Rule(lo=0, hi=1, hi_open=True),
    "optimizer.beta2": Rule(lo=0, hi=1, hi_open=True),
    "optimizer.eps": positive(),
    "optimizer.clip_grad": non_negative(note="0: no clipping"),
    "optimizer.muon.lr": positive(optional=True, note="null: optimizer.lr"),
    "optimizer.muon.min_lr": non_negative(optional=True, note="null: optimizer.min_lr"),
    "optimizer.muon.weight_decay": non_negative(optional=True, note="null: optimizer.weight_decay"),
    "optimizer.muon.momentum": Elsewhere(_MUON),
    "optimizer.muon.ns_steps": Elsewhere(_MUON),
    "scheduler.init_lr": non_negative(),
    "scheduler.warmup_steps": Elsewhere(_SCHEDULE),  # >= 0 and below the decay steps
    "scheduler.decay_steps": count(1, optional=True, note="null: the stage's steps"),
    "scheduler.wsd_decay_steps": count(1, optional=True, note="null: 20% of the steps"),
    "logger.log_every": count(1),
    "checkpoint.save_every": count(0, note="0: off"),
    "checkpoint.save_every_minutes": non_negative(note="0: off"),
    "checkpoint.keep_last": count(0, note="0: keep all"),
    "trainer.steps": count(0),
    "trainer.seq_length": count(1),
    "trainer.micro_batch_size": Elsewhere(_LAYOUT),  # >= 1, divides the global batch per DP rank
    "trainer.global_batch_size": Elsewhere(_LAYOUT),
    "trainer.seed": count(0, UINT32_MAX, note="numpy's seed range"),
    "trainer.eval_every": count(0, note="0: never"),
    "trainer.eval_samples": count(1),
    "trainer.lock_wait_s": non_negative(),
    "cluster.nodes": count(1, optional=True, note="null: any size"),
    "faults.reload_after_bad_steps": Elsewhere("pretrain.reliability.faults.check"),
    "faults.max_reloads": Elsewhere("pretrain.reliability.faults.check"),
    "faults.diverged_after": Elsewhere("pretrain.reliability.faults.check"),
    # curriculum stages (pretrain/curriculum.py: StageConfig); null takes the run's value
    "curriculum.stages.*.tokens": Elsewhere(_STAGE),
    "curriculum.stages.*.steps": Elsewhere(_STAGE),
    "curriculum.stages.*.seq_length": Elsewhere(_STAGE),
    "curriculum.stages.*.global_batch_size": Elsewhere(_STAGE),
    "curriculum.stages.*.micro_batch_size": Elsewhere(_LAYOUT),
    "curriculum.stages.*.lr.peak": Elsewhere(_STAGE),
    "curriculum.stages.*.lr.end": Elsewhere(_STAGE),
    "curriculum.stages.*.lr.init": Elsewhere(_STAGE),
    "curriculum.stages.*.lr.warmup_steps": Elsewhere(_STAGE),
    "curriculum.stages.*.lr.wsd_decay_steps": count(1, optional=True, note="null: scheduler.wsd_decay_steps"),
    "curriculum.stages.*.rope_theta": positive(optional=True, note="null: model.rope_theta"),
    "curriculum.stages.*.eval_every": count(0, optional=True, note="null: trainer.eval_every"),
}


def numeric_fields(value: Any, name: str = "", pattern: str = ""):
    """``(name, pattern, value)`` of every numeric field under ``value`` (a dataclass): ``name``
    as messages show it (``curriculum.stages[3] (extend_512).tokens``), ``pattern`` as
    :data:`RUN_RULES` keys it. Dicts of dataclasses (corpora) and lists of them (stages) are
    walked; free-form dicts (mixtures, stage overrides) are checked by their own groups."""
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        n, p = f"{name}.{f.name}" if name else f.name, f"{pattern}.{f.name}" if pattern else f.name
        if dataclasses.is_dataclass(v):
            yield from numeric_fields(v, n, p)
        elif isinstance(v, dict):
            for k, item in v.items():
                if dataclasses.is_dataclass(item):
                    yield from numeric_fields(item, f"{n}.{k}", f"{p}.*")
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if dataclasses.is_dataclass(item):
                    label = f" ({item.name})" if getattr(item, "name", None) else ""
                    yield from numeric_fields(item, f"{n}[{i}]{label}", f"{p}.*")
        elif _is_number_field(f, v):
            yield n, p, v


def _is_number_field(f: dataclasses.Field, v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return True
    return v is None and any(t in str(f.type) for t in ("int", "float"))


def table_problems(value: Any, rules: dict, name: str = "") -> list[str]:
    """Each field under ``value`` that breaks its rule in ``rules`` (fnmatch patterns), in field
    order; a field the table does not know is left alone (the table's test finds it)."""
    problems = []
    for n, p, v in numeric_fields(value, name, name):
        rule = rules.get(p) or next((r for k, r in rules.items() if fnmatch.fnmatchcase(p, k)), None)
        if isinstance(rule, Rule):
            why = rule.problem(n, v)
            if why:
                problems.append(why)
    return problems


def check_numbers(rc) -> None:
    """Raise :class:`ConfigError` naming every number of ``rc`` (a RunConfig) out of its range."""
    problems = table_problems(rc, RUN_RULES)
    if problems:
        raise ConfigError("invalid run config", problems)
