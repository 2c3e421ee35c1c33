"""A resumed run against the config its checkpoint was trained with.

Resuming with another sequence length, LR, batch or data mixture silently trains something else
than the run dir's history says. The stages the checkpoint has started (up to and including
its own) are resolved from both configs and compared field by field; a difference in anything
that alters the training is an error listing each field with both values, unless
``checkpoint.allow_config_change=true``, which records the change in
``<run_dir>/config_history.jsonl``. What does not alter the training may change freely: the
parallel layout (checkpoints reshard), layer backend and recomputation, logging, checkpointing,
fault handling, validation, preprocessing workers (not the shard count: other shards give
another sample order) and where the data lives. Stages not yet
begun may change too.

Extending a finished run (the last stage's ``steps`` / ``trainer.steps`` raised after it
completed) is such a change: the LR schedule ended there, and with ``allow_config_change`` the
extra steps run at the schedule's final LR (``optimizer.min_lr`` / the stage's ``lr.end``). A
new curriculum stage is the way to give them their own schedule.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Optional

#: run-config fields that alter the training (prefixes); EXEMPT narrows them
ALTERS = ("model.", "precision.", "optimizer.", "scheduler.", "trainer.seq_length",
          "trainer.global_batch_size", "trainer.seed", "steps", "data.mixture", "data.active_mixture.",
          "data.active_corpora.", "data.shards_per_corpus", "data.split", "data.eod_mask_loss", "data.sample_seed",
          "data.tokenizer.", "data.chat.")
EXEMPT = ("model.layer_backend", "model.recompute", "model.recompute_modules",
          "scheduler.decay_steps")  # decay_steps follows the stage's steps, compared as ``steps``
EXEMPT_CORPUS_FIELDS = ("paths",)
HISTORY = "config_history.jsonl"


def _flatten(value: Any, prefix: str, out: dict) -> dict:
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value
    return out


def _training_fields(stage) -> dict:
    """The fields of one resolved stage that decide what it trains, flattened."""
    from data_pipeline.corpus_steps import num_tasks

    rc = stage.rc
    active = rc.data.mixtures.get(rc.data.mixture, {})
    data = {k: getattr(rc.data, k) for k in ("mixture", "split", "eod_mask_loss", "sample_seed",
                                              "tokenizer", "chat")}
    data["active_mixture"] = dict(active)
    data["shards_per_corpus"] = num_tasks(rc.data)  # other shards: another blended sample order
    data["active_corpora"] = {
        name: {k: v for k, v in dataclasses.asdict(rc.data.corpora[name]).items() if k not in EXEMPT_CORPUS_FIELDS}
        for name in sorted(active) if name in rc.data.corpora}
    flat = _flatten({"model": rc.model, "precision": rc.precision, "optimizer": rc.optimizer,
                     "scheduler": rc.scheduler, "trainer": rc.trainer, "data": data}, "", {})
    flat["steps"] = stage.steps
    return {k: v for k, v in flat.items()
            if k.startswith(ALTERS) and not k.startswith(EXEMPT)}


def training_changes(old_stages: list, new_stages: list, stage_name: str, stage_step: int) -> list[str]:
    """Each difference that alters what the checkpoint's stages (up to ``stage_name``) train."""
    changes = []
    new_by_name = {s.name: s for s in new_stages}
    for old in old_stages:
        where = "" if len(old_stages) == 1 and not old_stages[0].rc.curriculum.stages else f"stage {old.name!r}: "
        new = new_by_name.get(old.name)
        if new is None:
            changes.append(f"{where}the checkpoint trained this stage; the new config has no stage of that name")
        else:
            a, b = _training_fields(old), _training_fields(new)
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    note = ""
                    if key == "steps" and old.name == stage_name and stage_step >= old.steps and \
                            (b.get(key) or 0) > (a.get(key) or 0):
                        note = (" (extends a finished schedule: the extra steps would run at its final "
                                "LR; a new curriculum stage gives them their own)")
                    changes.append(f"{where}{_name(key)}: {a.get(key)!r} in the checkpoint -> "
                                   f"{b.get(key)!r} now{note}")
        if old.name == stage_name:
            break
    return changes


def _name(key: str) -> str:
    return (key.replace("data.active_mixture.", "data.mixtures.<active>.")
               .replace("data.active_corpora.", "data.corpora."))


def record(run_dir: str, step: int, changes: list[str], checkpoint: str) -> None:
    """Append the accepted change to the run's config history."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "step": step, "checkpoint": checkpoint,
             "changes": changes}
    with open(os.path.join(run_dir, HISTORY), "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def checkpoint_config(common: dict) -> Optional[Any]:
    """The RunConfig a checkpoint was trained with (None when it has none or it no longer fits
    the schema: then there is nothing to compare against)."""
    from omegaconf import OmegaConf

    from pretrain.config.schema import to_run_config

    text = common.get("config_yaml")
    if not text:
        return None
    try:
        return to_run_config(OmegaConf.create(text))
    except Exception:  # noqa: BLE001 -- an older schema: reported by the caller as not comparable
        return None
