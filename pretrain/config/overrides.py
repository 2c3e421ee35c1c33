"""What the command line changed, and whether each change reaches the curriculum's stages.

A stage takes the run's value for every field it leaves unset (``pretrain.curriculum``), so a
command-line override such as ``optimizer.lr=1e-3`` reaches the stages that do not set their
own ``lr.peak``. An override that reaches no stage -- every stage sets the field -- would be
dropped silently; it is a config problem naming the stages and the stage field to override
instead. One that reaches only some stages is reported as a note. A group choice (a preset such
as ``optimizer=muon_split``) is a problem only when none of what it changes reaches a stage.

Overrides are Hydra's strings. A value override (``trainer.steps=200``) changes the fields under
its key; a group choice (``scheduler=wsd``) changes the fields whose values differ from the
config composed without that choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

#: run field -> the stage field that replaces it in a curriculum stage
RUN_TO_STAGE = {
    "trainer.steps": "steps",
    "trainer.seq_length": "seq_length",
    "trainer.global_batch_size": "global_batch_size",
    "trainer.micro_batch_size": "micro_batch_size",
    "trainer.eval_every": "eval_every",
    "data.mixture": "mixture",
    "model.dsa.mode": "dsa_mode",
    "model.rope_theta": "rope_theta",
    "model.rope_type": "rope_type",
    "model.recompute": "recompute",
    "optimizer.lr": "lr.peak",
    "optimizer.min_lr": "lr.end",
    "scheduler.init_lr": "lr.init",
    "scheduler.warmup_steps": "lr.warmup_steps",
    "scheduler.style": "lr.style",
    "scheduler.wsd_decay_steps": "lr.wsd_decay_steps",
    "scheduler.decay_steps": "steps",  # a stage's schedule always decays over its own steps
}
#: run dicts whose keys a stage overrides one by one
RUN_TO_STAGE_PREFIX = {"model.yarn.": "yarn.", "parallel.": "parallel."}


@dataclass(frozen=True)
class Change:
    field: str  #: dotted run-config path of a leaf, e.g. ``scheduler.style``
    value: Any
    override: str  #: the command-line override that made it, e.g. ``scheduler=wsd``


def stage_field(run_field: str) -> Optional[str]:
    if run_field in RUN_TO_STAGE:
        return RUN_TO_STAGE[run_field]
    for prefix, stage_prefix in RUN_TO_STAGE_PREFIX.items():
        if run_field.startswith(prefix):
            return stage_prefix + run_field[len(prefix):]
    return None


def _stage_value(stage_cfg, stage_steps: int, run_field: str, field: str, preset: Optional[dict] = None):
    """The stage's own value of ``field`` (None when it leaves it to the run); ``preset``: the
    cluster preset's entry for the stage (``parallel.stages.<name>``), which comes last."""
    key = (field[len("parallel."):] if field.startswith("parallel.")
           else field if field in ("recompute", "micro_batch_size") else None)  # what an entry may set
    if preset and key in preset:
        return preset[key]
    if run_field == "scheduler.decay_steps":
        return stage_steps
    if field == "steps":
        return stage_cfg.steps if stage_cfg.steps is not None else (
            None if stage_cfg.tokens is None else f"{stage_cfg.tokens:g} tokens")
    head, _, rest = field.partition(".")
    value = getattr(stage_cfg, head)
    if not rest:
        return value
    if isinstance(value, dict):
        return value.get(rest)
    return getattr(value, rest)


def _leaves(node, prefix: str) -> dict:
    if not isinstance(node, dict):
        return {prefix: node}
    out = {}
    for k, v in node.items():
        out.update(_leaves(v, f"{prefix}.{k}"))
    return out


def _select(cfg: DictConfig, key: str) -> dict:
    node = OmegaConf.select(cfg, key, default=None)
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    return _leaves(node, key)


def changed_fields(overrides: list[str], compose: Callable[[list[str]], DictConfig], conf_dir: str,
                   full: Optional[DictConfig] = None) -> list[Change]:
    """The run fields ``overrides`` set (curriculum.* and hydra.* aside). ``compose`` composes
    the run config for a list of overrides (``full``: the config of all of them, when known);
    ``conf_dir`` holds the config groups. A group choice whose counterpart cannot be composed
    (a group from a search path only the app sees) is left out."""
    from hydra.errors import HydraException

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    changes: dict[str, Change] = {}
    for i, o in enumerate(parsed):
        key = o.key_or_group
        if key.split(".")[0].split("/")[0] in ("hydra", "curriculum"):
            continue
        full = full if full is not None else compose(list(overrides))
        now = _select(full, key)
        if os.path.isdir(os.path.join(conf_dir, key)):  # a group choice: what it changes
            try:
                before = _select(compose(list(overrides[:i]) + list(overrides[i + 1:])), key)
            except HydraException:
                continue
            now = {f: v for f, v in now.items() if f not in before or before[f] != v}
        for f, v in now.items():
            changes[f] = Change(f, v, o.input_line)
    return list(changes.values())


def reach(curriculum_stages: list, stage_steps: list[int], changes: list[Change],
          preset_stages: Optional[dict] = None) -> tuple[list[str], list[str]]:
    """(problems, notes). A value override that no stage receives is a problem; so is a group
    choice none of whose changes reaches a stage (``scheduler=wsd`` when every stage sets its
    ``lr.style``). A change that some stages (or, for a group choice, only some of its fields)
    do not receive is a note naming the stages that keep their own value."""
    problems, notes = [], []
    if not curriculum_stages:
        return problems, notes
    group_reaches: dict[str, bool] = {}
    unreached: list[tuple[Change, str, list]] = []
    for ch in changes:
        field = stage_field(ch.field)
        own = [] if field is None else [
            (i, s.name, v) for i, (s, n) in enumerate(zip(curriculum_stages, stage_steps))
            if (v := _stage_value(s, n, ch.field, field, (preset_stages or {}).get(s.name))) is not None]
        group_reaches[ch.override] = group_reaches.get(ch.override, False) or len(own) < len(curriculum_stages)
        if own:
            unreached.append((ch, field, own))
    for ch, field, own in unreached:
        value_override = ch.override.split("=")[0].lstrip("+~") == ch.field
        what = ch.override if value_override else f"{ch.override} (sets {ch.field}={ch.value!r})"
        listed = ", ".join(f"{name}: {v}" for _, name, v in own)
        shown = "steps/tokens" if field == "steps" else field
        if len(own) < len(curriculum_stages) or (not value_override and group_reaches[ch.override]):
            notes.append(f"{what} does not reach the stages that set their own {shown} ({listed})")
        elif ch.field == "scheduler.decay_steps":
            problems.append(f"{what} reaches no stage: each curriculum stage's schedule decays over "
                            f"its own steps ({listed}); set curriculum.stages.<i>.steps, or train "
                            f"without stages (curriculum=none)")
        else:
            i, name, _ = own[0]
            problems.append(
                f"{what} reaches no stage: every curriculum stage sets its own {shown} ({listed}); "
                f"override the stages instead (e.g. curriculum.stages.{i}.{field}={ch.value} for "
                f"{name}), or train without stages (curriculum=none)")
    return problems, notes


def replaced_by_preset(changes: list[Change], entry: dict, stage: str, run_fields: dict) -> list[str]:
    """Command-line values the cluster preset's entry for ``stage`` (``parallel.stages.<stage>``,
    applied last) replaces: a problem each, naming the entry's field to override instead.
    ``run_fields``: the entry's non-``parallel`` keys and the run fields they set."""
    problems = []
    for ch in changes:
        if ch.override.split("=")[0].lstrip("+~") != ch.field:
            continue  # a group choice's fields: the preset entry is part of the run it composes
        key = next((k for k, f in run_fields.items() if f == ch.field), None)
        if key is None and ch.field.startswith("parallel."):
            key = ch.field[len("parallel."):]
        if key in entry and entry[key] != ch.value:
            problems.append(f"{ch.override} does not reach stage {stage!r}: the cluster preset sets "
                            f"parallel.stages.{stage}.{key}={entry[key]!r}, which comes last; override "
                            f"that instead (parallel.stages.{stage}.{key}={ch.value})")
    return problems
