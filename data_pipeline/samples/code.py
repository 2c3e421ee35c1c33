"""Code sample corpus: whole source files of the installed Python standard library."""

from __future__ import annotations

import json
import random

from data_pipeline.samples.stdlib_files import read_source, stdlib_files


def generate(out_path: str, seed: int, max_bytes: int = 3_000_000) -> None:
    """One JSON line per file, {"text", "path"}, files in a seeded order until ``max_bytes``."""
    files = list(stdlib_files())
    random.Random(seed).shuffle(files)
    total = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for rel, path in files:
            text = read_source(path)
            f.write(json.dumps({"text": text, "path": rel}) + "\n")
            total += len(text)
            if total >= max_bytes:
                break
