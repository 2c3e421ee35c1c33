"""The DataTrove steps that turn one corpus's files into a folder of indexed shards, and the finish
that sums the shards' stats into ``stats.json``: the same for the local executor
(:mod:`data_pipeline.preprocess`) and the Slurm one (:mod:`data_pipeline.slurm`)."""

from __future__ import annotations

import json
import os

from data_pipeline.config import CorpusConfig, DataConfig
from data_pipeline.fsutil import write_json_atomic
from data_pipeline.integrity import MASK_SUFFIX, CorpusDamaged, manifest, verify
from data_pipeline.readers import CorpusReader, DataError
from data_pipeline.writer import IndexedShardWriter


def num_tasks(cfg: DataConfig) -> int:
    return cfg.preprocess.tasks or cfg.preprocess.workers


def finalize(name: str, work_dir: str, tasks: int, files: list[str]) -> dict:
    """Sum the shards' stats into ``stats.json``; an empty corpus is an error."""
    shards = []
    for rank in range(tasks):
        meta = os.path.join(work_dir, f"shard_{rank:05d}.json")
        if os.path.exists(meta):
            with open(meta) as f:
                shards.append({"prefix": f"shard_{rank:05d}", **json.load(f)})
    keys = ("documents", "tokens", "bytes", "empty_documents", "invalid_utf8_documents",
            "replacement_chars", "loss_tokens")
    totals = {k: sum(s[k] for s in shards) for k in keys}
    if totals["documents"] == 0:
        raise DataError(f"corpus {name!r} is empty: no documents with text in {len(files)} input file(s) "
                        f"{files[:3]}{' ...' if len(files) > 3 else ''}")
    for s in shards:
        for suffix in ("", MASK_SUFFIX if s["loss_mask"] else None):
            if suffix is not None and not all(os.path.exists(os.path.join(work_dir, s["prefix"] + suffix + e))
                                              for e in (".bin", ".idx")):
                raise DataError(f"corpus {name!r}: shard {s['prefix']}{suffix} is incomplete in {work_dir}")
    stats = {"corpus": name, **totals, "loss_mask": shards[0]["loss_mask"], "shards": shards,
             "inputs": len(files), "manifest": manifest(work_dir, shards)}
    write_json_atomic(os.path.join(work_dir, "stats.json"), stats)
    problems = verify(work_dir, deep=True)  # a fresh build: everything, once
    if problems:
        raise CorpusDamaged(f"corpus {name!r}: the shards just written are inconsistent:\n  - "
                            + "\n  - ".join(problems))
    return stats


def pipeline(name: str, c: CorpusConfig, cfg: DataConfig, files: list[str], tok_path: str, out_dir: str):
    at_once = 1 if cfg.preprocess.executor == "slurm" else min(cfg.preprocess.workers, num_tasks(cfg))
    return [
        CorpusReader(name, files, c.format, c.text_field, c.messages_field, c.invalid_utf8, cfg.chat,
                     c.encoding),
        IndexedShardWriter(out_dir, tok_path, cfg.tokenizer.eod_token, cfg.preprocess.batch_size,
                           c.mask_template, c.mask_tool_results,
                           tasks_per_node=at_once),
    ]
