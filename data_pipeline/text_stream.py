"""A deterministic byte-level token stream from real text every machine has: the installed
Python standard library's source. Placeholder data behind the same sample interface megatron's
``GPTDataset`` has (``tokens``, ``labels``, ``loss_mask``, ``position_ids`` per sample)."""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

EOD = 256  #: document separator; byte tokens are 0..255
VOCAB_SIZE = 257


@dataclass
class DataConfig:
    source: str = "python_stdlib"  #: the only placeholder source: stdlib .py files, bytes
    max_bytes: int = 8_000_000  #: cap on the stream (files in sorted order until reached)
    seed: int = 1234  #: sample shuffle seed


@lru_cache(maxsize=2)
def stdlib_tokens(max_bytes: int) -> np.ndarray:
    """Bytes of the stdlib's .py files in sorted path order, EOD after each file."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            parts.append(np.frombuffer(data, dtype=np.uint8).astype(np.int32))
            parts.append(np.array([EOD], dtype=np.int32))
            total += len(data) + 1
            if total >= max_bytes:
                return np.concatenate(parts)[:max_bytes]
    return np.concatenate(parts)


class TextStreamDataset(torch.utils.data.Dataset):
    """Sample ``i`` is a window of ``seq_length + 1`` tokens at a shuffled, fixed offset."""

    def __init__(self, cfg: DataConfig, seq_length: int):
        if cfg.source != "python_stdlib":
            raise ValueError(f"data.source={cfg.source!r}: only 'python_stdlib' exists")
        self.tokens = stdlib_tokens(cfg.max_bytes)
        self.seq_length = seq_length
        n = (len(self.tokens) - 1) // seq_length
        self.order = np.random.default_rng(cfg.seed).permutation(n)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict:
        start = int(self.order[idx % len(self.order)]) * self.seq_length
        window = torch.from_numpy(self.tokens[start : start + self.seq_length + 1].astype(np.int64))
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }
