"""Every number of the run config against its range (pretrain/config/numbers.py): the table
covers every numeric field; a field of each kind out of range is named alone, with its value,
before the checks that compute with it; the checks the table points to for the other fields
really refuse a NaN or a negative value of them."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from pretrain.config.errors import ConfigError
from pretrain.config.numbers import RUN_RULES, Elsewhere, Rule
from pretrain.config.schema import RunConfig, compose, to_run_config
from pretrain.config.validation import plan_run


def _schema_numbers(tp, prefix: str):
    """``(pattern, type)`` of every int/float field of a dataclass type, through nested groups,
    the corpora (dict of CorpusConfig) and the curriculum's stages (list of StageConfig)."""
    hints = typing.get_type_hints(tp)
    for f in dataclasses.fields(tp):
        t, name = hints[f.name], f"{prefix}.{f.name}" if prefix else f.name
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (list, dict) and args and dataclasses.is_dataclass(args[-1]):
            yield from _schema_numbers(args[-1], f"{name}.*")
            continue
        base = args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t
        if dataclasses.is_dataclass(base):
            yield from _schema_numbers(base, name)
        elif base in (int, float):
            yield name, base


NUMBERS = dict(_schema_numbers(RunConfig, ""))


def test_the_table_has_a_rule_for_every_number_of_the_schema():
    assert len(NUMBERS) == 103
    assert sorted(set(NUMBERS) - set(RUN_RULES)) == []  # a new field needs its rule
    assert sorted(set(RUN_RULES) - set(NUMBERS)) == []  # ... and a removed one loses it


def _problems(*overrides):
    with pytest.raises(ConfigError) as e:
        plan_run(to_run_config(compose(list(overrides))), 1, check_paths=False)
    return e.value


# one row per kind of field; each message is the one line `python -m pretrain.train <override>`
# prints after "error: invalid run config: "
@pytest.mark.parametrize("override, message", [
    ("optimizer.weight_decay=nan", "optimizer.weight_decay=nan must be a finite number >= 0"),
    ("model.rope_theta=inf", "model.rope_theta=inf must be a finite number > 0"),
    ("optimizer.clip_grad=-1", "optimizer.clip_grad=-1.0 must be a finite number >= 0 (0: no clipping)"),
    ("optimizer.beta2=1", "optimizer.beta2=1.0 must be a finite number in [0, 1)"),
    ("optimizer.lr=0", "optimizer.lr=0.0 must be a finite number > 0"),
    ("model.yarn.beta_fast=nan", "model.yarn.beta_fast=nan must be a finite number"),
    ("trainer.seq_length=0", "trainer.seq_length=0 must be >= 1"),
    ("trainer.eval_samples=-4", "trainer.eval_samples=-4 must be >= 1"),
    ("model.moe_router_groups=0", "model.moe_router_groups=0 must be >= 1"),  # was a ZeroDivisionError
    ("logger.log_every=0", "logger.log_every=0 must be >= 1"),
    ("trainer.seed=-1", "trainer.seed=-1 must be in [0, 4294967295] (numpy's seed range)"),
    ("scheduler.decay_steps=0", "scheduler.decay_steps=0 must be >= 1 or null (null: the stage's steps)"),
    ("optimizer.muon.lr=inf", "optimizer.muon.lr=inf must be a finite number > 0 or null (null: optimizer.lr)"),
    ("data.preprocess.slurm.mem_per_cpu_gb=0", "data.preprocess.slurm.mem_per_cpu_gb=0 must be >= 1"),
    ("trainer.lock_wait_s=nan", "trainer.lock_wait_s=nan must be a finite number >= 0"),
    ("curriculum.stages.2.rope_theta=-1",
     "curriculum.stages[2] (extend_256).rope_theta=-1.0 must be a finite number > 0 or null (null: model.rope_theta)"),
], ids=lambda v: v.split("=")[0] if "must" not in v else "")
def test_a_number_out_of_range_is_named_alone(override, message):
    e = _problems(*([] if override.startswith("curriculum.") else ["curriculum=none"]), override)
    assert e.brief() == f"invalid run config: {message}"


def test_several_numbers_are_listed_together_in_field_order():
    e = _problems("curriculum=none", "trainer.seq_length=0", "optimizer.eps=inf", "model.init_std=-0.02")
    assert e.problems == ["model.init_std=-0.02 must be a finite number > 0",
                          "optimizer.eps=inf must be a finite number > 0",
                          "trainer.seq_length=0 must be >= 1"]


def test_an_infinite_stage_budget_is_a_problem_not_a_crash():
    e = _problems("curriculum.stages.0.steps=null", "curriculum.stages.0.tokens=inf")
    assert "curriculum.stages[0] (pretrain_general).tokens=inf must be a finite number > 0" in e.problems


def _elsewhere_case(pattern: str) -> tuple[list[str], str]:
    """Overrides setting the field ``pattern`` to a bad value, and the text its check prints."""
    field = pattern.replace("curriculum.stages.*", "curriculum.stages.0").replace("data.corpora.*", "data.corpora.prose")
    value = "nan" if NUMBERS[pattern] is float else "-1"
    base = [] if field.startswith("curriculum.") else ["curriculum=none"]
    if field.startswith("optimizer.muon."):
        base.append("optimizer=muon")
    if field.startswith("model.yarn."):
        base += ["model.rope_type=yarn", "model.yarn.factor=4"]
    if field == "curriculum.stages.0.tokens":
        base.append("curriculum.stages.0.steps=null")
    shown = "-1.0" if field.endswith("max_invalid_utf8_fraction") and value == "-1" else value
    return base + [f"{field}={value}"], f"{field.rsplit('.', 1)[1]}={shown}"


@pytest.mark.parametrize("pattern", sorted(p for p, r in RUN_RULES.items() if isinstance(r, Elsewhere)))
def test_the_checks_the_table_points_to_refuse_a_bad_value(pattern):
    overrides, shown = _elsewhere_case(pattern)
    e = _problems(*overrides)
    assert any(shown in p for p in e.problems), (overrides, e.problems)


def test_rules_describe_themselves():
    assert Rule(lo=0, hi=1, lo_open=True).problem("x", float("inf")) == "x=inf must be a finite number in (0, 1]"
    assert Rule(lo=1, integer=True, optional=True).problem("n", None) is None
    assert Rule(lo=1, integer=True).problem("n", 1.5) == "n=1.5 must be >= 1"
