"""A run's data before its ranks start: what one stage's datasets need on disk, found on the file
system alone (no process group, nothing written), and built ahead in one process.

A stage asks :func:`data_pipeline.build.build_datasets` for its datasets with the arguments of a
:class:`DataRequest`. :func:`missing` says what of it is not there yet -- a sample corpus not
generated, the default tokenizer not trained, a corpus not preprocessed for its current inputs
(or, ``check``, damaged), the sample index not complete (or, ``check``, damaged: a file differs
from the checksum its ``.complete`` records) -- and :func:`build` makes it (a damaged index is
removed and rebuilt); the run's
own ``build_datasets`` then only verifies and loads. Used by ``python -m data_pipeline.prepare``
and by a training launch before its process group (``pretrain.data_prep``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from data_pipeline.config import DataConfig, active_weights
from data_pipeline.preprocess import Lacking, existing_output


@dataclass
class DataRequest:
    """The arguments of one ``build_datasets`` call (so: one sample index)."""

    data: DataConfig
    seq_length: int
    seed: int
    vocab_size: int
    num_samples: int
    valid_samples: Optional[int] = None  #: held-out samples (None: ``data.valid_samples``)

    @property
    def key(self) -> str:
        """Equal for requests that build the same index (stages continuing one data stream)."""
        return repr(self)


def _outputs(req: DataRequest, check: bool) -> tuple[dict, list[Lacking]]:
    outputs, lacking = {}, []
    for name in active_weights(req.data):
        out, why = existing_output(name, req.data, check)
        if why is None:
            outputs[name] = out
        elif why not in lacking:  # the tokenizer, missing for every corpus, once
            lacking.append(why)
    return outputs, lacking


def _index_dir(req: DataRequest, outputs: dict, run_dir: str) -> str:
    from data_pipeline import tokenizer
    from data_pipeline.build import plan_index

    return plan_index(req.data, outputs, req.seq_length, req.seed, run_dir, req.vocab_size, req.num_samples,
                      req.valid_samples, tok_path=tokenizer.prepared(req.data)).index_dir


def index_dir(req: DataRequest, run_dir: str) -> Optional[str]:
    """The request's sample-index folder under ``<run_dir>/data_index/``; None while a corpus it
    blends is not prepared (the folder's name depends on the corpora's shards)."""
    outputs, lacking = _outputs(req, check=False)
    return None if lacking else _index_dir(req, outputs, run_dir)


def missing(req: DataRequest, run_dir: str, check: bool = False) -> list[Lacking]:
    """What of ``req`` is not on disk yet ([] = the run's build only loads). ``check``: verify each
    prepared corpus and the sample index against their manifests too (a stat per file and a few
    index bytes per shard; a file changed since its checksum was taken is read whole and its
    checksum compared); without it the index's manifest must only be one this code reads. A
    damaged index lacks with ``damaged: <file> has sha256 <now>, the manifest says <then>``."""
    from data_pipeline.build import index_problems

    outputs, lacking = _outputs(req, check)
    if lacking:
        return lacking
    where = _index_dir(req, outputs, run_dir)
    problems = index_problems(where, check)
    if problems is None:
        return [Lacking("sample index", "not built", where)]
    if problems:
        return [Lacking("sample index", "damaged: " + "; ".join(p.replace(where + os.sep, "") for p in problems),
                        where)]
    return []


def build(req: DataRequest, run_dir: str) -> None:
    """Everything ``req`` needs, built here (corpora: generated, tokenised, verified -- a damaged
    one set aside and rebuilt; then the sample index), as the run's ``build_datasets`` would."""
    from data_pipeline.build import build_datasets

    build_datasets(req.data, req.seq_length, req.seed, run_dir, req.vocab_size, req.num_samples,
                   valid_samples=req.valid_samples)
