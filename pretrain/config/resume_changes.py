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

Each begun stage's place in its data stream is compared too: ``data offset`` (the samples of
its stream that earlier stages read, where it starts) and ``data stream continues`` (the earlier
stage whose stream it continues, :func:`pretrain.curriculum._assign_data_offsets`). An earlier
stage's other step count or mixture moves them; they are listed with it.

A stage the checkpoint is in the middle of compares its stream's length too (``data stream
samples``: every stage on the stream reads it, so it is the ``num_samples`` its sample index is
built for, :func:`pretrain.data_prep.stage_request`). A stage on that stream added, removed
or resized (a stage appended to continue it, most often) changes that length, and megatron
orders even the stream's first samples by it: a concat-layout corpus (megatron's ``GPTDataset``
indices) whose epoch count, or whether its last epoch is shuffled apart (under 80% of one),
changes is reshuffled from its first sample (the blend's corpus order and the ``best_fit`` layout
are prefix-stable). The rest of the stage would then read another order than the one its
checkpoint trained on. Once the stage has ended, the stream's later stages may change like any
stage not yet begun.

The stages up to and including the checkpoint's must be the same names in the same order. A
stage inserted, removed or moved there is refused even with ``allow_config_change``
(:class:`CurriculumOrderChanged`): the checkpoint's weights hold what the old order trained, so
an inserted stage would never run, a removed one would stay trained but unrecorded, every later
stage's index (its seed: ``trainer.seed + index``) and data offset would move, and the run dir's
history would no longer describe the run. Restore the order, or start a new run dir from the
checkpoint (``checkpoint.init_from``). Stages after the checkpoint's may be inserted, removed or
reordered freely.

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

from pretrain.config.errors import ConfigError

#: run-config fields that alter the training (prefixes); EXEMPT narrows them
ALTERS = ("model.", "precision.", "optimizer.", "scheduler.", "trainer.seq_length",
          "trainer.global_batch_size", "trainer.seed", "steps", "data.mixture", "data.active_mixture.",
          "data.active_corpora.", "data.shards_per_corpus", "data.split", "data.eod_mask_loss", "data.sample_seed",
          "data.tokenizer.", "data.chat.", "data_offset", "data_continues")
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
    flat["data_offset"] = stage.data_offset  # where the stage starts in its data stream
    flat["data_continues"] = stage.continues  # ... and whose stream that is
    return {k: v for k, v in flat.items()
            if k.startswith(ALTERS) and not k.startswith(EXEMPT)}


class CurriculumOrderChanged(ConfigError):
    """The stages up to the checkpoint's were inserted, removed or reordered: not a change
    ``checkpoint.allow_config_change`` accepts (the module docstring says why)."""


def order_problem(old_stages: list, new_stages: list, stage_name: str) -> Optional[str]:
    """None when the stages up to and including ``stage_name`` keep their names and order, else
    one line naming what was inserted, removed or moved and both orders."""
    old_all = [s.name for s in old_stages]
    if stage_name not in old_all:  # a checkpoint without a stage name: nothing to place it by
        return None
    old = old_all[:old_all.index(stage_name) + 1]
    names = [s.name for s in new_stages]
    new = names[:names.index(stage_name) + 1] if stage_name in names else names[:len(old)]
    if new == old:
        return None
    found = {"inserted": [n for n in new if n not in old_all],
             "moved before it": [n for n in new if n in old_all and n not in old],
             "removed": [n for n in old if n not in names],
             "moved after it": [n for n in old if n in names and n not in new]}
    what = "; ".join(f"{label}: {', '.join(map(repr, ns))}" for label, ns in found.items() if ns) or "reordered"
    return (f"the curriculum's stages up to the checkpoint's stage {stage_name!r} changed ({what}): "
            f"{old} in the checkpoint -> {new} now; stages before or at the resumed one cannot be "
            f"inserted, removed or moved, not even with checkpoint.allow_config_change=true (restore "
            f"the order, or start a new run dir with checkpoint.init_from=<the checkpoint>)")


def training_changes(old_stages: list, new_stages: list, stage_name: str, stage_step: int) -> list[str]:
    """Each difference that alters what the checkpoint's stages (up to ``stage_name``) train.
    Raises :class:`CurriculumOrderChanged` when those stages were inserted, removed or reordered."""
    problem = order_problem(old_stages, new_stages, stage_name)
    if problem:
        raise CurriculumOrderChanged("cannot resume", [problem])
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
            if new is not None and stage_step < old.steps:  # in the middle of it: its stream goes on
                moved = stream_change(old, new, old_stages, new_stages, stage_step)
                changes += [where + moved] if moved else []
            break
    return changes


def stream_change(old, new, old_stages: list, new_stages: list, stage_step: int) -> Optional[str]:
    """None when the stage ``old`` (resumed at ``stage_step``) has its data stream built for the
    same length as ``new``, else the line naming both lengths and why that matters."""
    if old.stream_samples == new.stream_samples:
        return None
    was, now = _on_stream(old_stages, old.name), _on_stream(new_stages, new.name)
    members = f" (the stream's stages: {was} in the checkpoint -> {now} now)" if was != now else ""
    at = old.data_offset + stage_step * old.rc.trainer.global_batch_size
    return (f"data stream samples (the length its sample index is built for): {old.stream_samples} in the "
            f"checkpoint -> {new.stream_samples} now{members}; megatron orders even the stream's first "
            f"samples by its length (a concat corpus whose epoch count changes is reshuffled), so this "
            f"stage would go on from sample {at} of another order than the one it trained on: keep the "
            f"stream's stages as they were until this stage has ended")


def _on_stream(stages: list, name: str) -> list[str]:
    """The stages reading the same data stream as stage ``name`` (``continues`` chains)."""
    root: dict = {}
    for s in stages:
        root[s.name] = root.get(s.continues, s.continues) if s.continues else s.name
    return [s.name for s in stages if root[s.name] == root.get(name)]


def _name(key: str) -> str:
    if key in ("data_offset", "data_continues"):
        return {"data_offset": "data offset (samples of its data stream read by earlier stages)",
                "data_continues": "data stream continues stage"}[key]
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
