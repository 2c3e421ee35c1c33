"""Every data problem visible before any tokenisation: the mixture, each corpus's settings and
paths, the split, and the tokenizer file's vocabulary against the model's. Each problem names its
field and value."""

from __future__ import annotations

from typing import List, Optional

from data_pipeline.config import (EXECUTORS, DataConfig, DataConfigError, active_weights, check_corpus, check_mixture,
                                  split_vector)
from data_pipeline.tokenizer import tokenizer_vocab_size


def check_data(cfg: DataConfig, model_vocab_size: Optional[int] = None, check_paths: bool = True) -> List[str]:
    """Every data problem visible from the config (and the tokenizer file, when one is named)."""
    problems = check_mixture(cfg)
    if not problems:
        for name in active_weights(cfg):
            problems += check_corpus(name, cfg.corpora[name], check_paths)
    try:
        split_vector(cfg.split)
    except DataConfigError as e:
        problems.append(str(e))
    if cfg.valid_samples < 0:
        problems.append(f"data.valid_samples={cfg.valid_samples} must be >= 0")
    if cfg.index_threads < 1:
        problems.append(f"data.index_threads={cfg.index_threads} must be >= 1")
    if not 0 <= cfg.max_group_documents <= 2**31 - 1:
        problems.append(f"data.max_group_documents={cfg.max_group_documents} must be in [0, 2**31 - 1] "
                        "(megatron's document ids are int32; 0 = one dataset per shard)")
    p = cfg.preprocess
    if p.executor not in EXECUTORS:
        problems.append(f"data.preprocess.executor={p.executor!r} must be one of {list(EXECUTORS)}")
    if p.workers < 1:
        problems.append(f"data.preprocess.workers={p.workers} must be >= 1")
    if p.tasks < 0:
        problems.append(f"data.preprocess.tasks={p.tasks} must be >= 0 (0 = workers)")
    if p.batch_size < 1:
        problems.append(f"data.preprocess.batch_size={p.batch_size} must be >= 1")
    if cfg.tokenizer.path is None and cfg.tokenizer.vocab_size < 300:
        problems.append(f"data.tokenizer.vocab_size={cfg.tokenizer.vocab_size} must be >= 300 "
                        "(256 byte tokens + special tokens + merges)")
    if not check_paths and cfg.tokenizer.path is not None:
        return problems  # the tokenizer file is on the cluster
    try:
        vocab = tokenizer_vocab_size(cfg.tokenizer)
    except (OSError, ValueError) as e:
        problems.append(f"data.tokenizer.path={cfg.tokenizer.path!r}: {e}")
    else:
        if model_vocab_size is not None and model_vocab_size < vocab:
            problems.append(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                            f"vocabulary ({vocab}, data.tokenizer.path={cfg.tokenizer.path!r})")
    return problems


def validate_data(cfg: DataConfig, model_vocab_size: Optional[int] = None) -> None:
    problems = check_data(cfg, model_vocab_size)
    if problems:
        raise DataConfigError("invalid data config:\n  - " + "\n  - ".join(problems))
