"""The ``data`` config group: tokenizer, corpus registry, mixtures, preprocessing, splits.

A *corpus* is a named set of local inputs with a category (general, code, math, agent, ...); a
*mixture* maps corpus names to sampling weights; ``data.mixture`` picks the active one, so a
curriculum stage can switch mixtures by name. :func:`data_pipeline.validation.check_data` lists every problem it can find
from the config alone (no process groups, no tokenisation), each naming the field and value.
"""

from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

SAMPLE_SCHEME = "samples:"  #: ``paths: ["samples:code"]`` = a corpus generated at first use
SAMPLE_KINDS = ("prose", "code", "math", "agent")
FORMATS = ("auto", "jsonl", "text", "parquet", "hf_disk")
PACKINGS = ("concat", "best_fit")
UTF8_POLICIES = ("replace", "reject")
EXECUTORS = ("local", "slurm")


@dataclass
class TokenizerConfig:
    path: Optional[str] = None  #: local HF tokenizer dir (or tokenizer.json); null = byte-level BPE trained on the samples
    vocab_size: int = 512  #: size of the trained BPE, special tokens included (ignored with ``path``)
    train_bytes_per_corpus: int = 800_000  #: sample text per corpus the BPE is trained on
    eod_token: str = "<|endoftext|>"  #: appended to every document
    pad_token: str = "<|pad|>"  #: fills packed sequences; falls back to eod when the tokenizer has none


@dataclass
class ChatTemplateConfig:
    """GLM-style markers for rendering trajectories; every one must be a token of the tokenizer."""

    system: str = "<|system|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"
    observation: str = "<|observation|>"  #: opens the tool-result turn
    tool_call_start: str = "<tool_call>"
    tool_call_end: str = "</tool_call>"
    tool_response_start: str = "<tool_response>"
    tool_response_end: str = "</tool_response>"

    def markers(self) -> List[str]:
        return [self.system, self.user, self.assistant, self.observation, self.tool_call_start,
                self.tool_call_end, self.tool_response_start, self.tool_response_end]


@dataclass
class CorpusConfig:
    category: str = "general"  #: metrics key ``tokens_<category>``; several corpora may share one
    paths: List[str] = field(default_factory=list)  #: files, folders or globs; ``samples:<kind>`` = generated
    format: str = "auto"  #: auto (from the extension) | jsonl (.jsonl/.json/.gz) | text (one file = one doc) | parquet | hf_disk
    text_field: str = "text"  #: the document text (ignored when messages_field is set)
    messages_field: Optional[str] = None  #: list of {role, content, tool_calls, name}: rendered with data.chat
    packing: str = "concat"  #: concat (GPT windows across documents) | best_fit (whole documents per sequence)
    mask_tool_results: bool = True  #: no loss on tool-result turns (trajectories)
    mask_template: bool = True  #: no loss on role markers (trajectories)
    encoding: str = "utf-8"  #: of jsonl/text input bytes; any ASCII-compatible codec (latin-1, cp1252, ...)
    invalid_utf8: str = "replace"  #: bytes invalid in ``encoding``: replace (U+FFFD, counted) | reject (error naming file, byte)
    max_invalid_utf8_fraction: float = 0.01  #: documents ``replace`` may alter (each use warns); above: an error


@dataclass
class SlurmConfig:
    partition: str = "cpu"
    time: str = "04:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: int = 2
    qos: str = "normal"
    venv_path: Optional[str] = None  #: activate script sourced by each array task
    sbatch_args: Dict[str, str] = field(default_factory=dict)


@dataclass
class PreprocessConfig:
    executor: str = "local"  #: local (worker processes here) | slurm (array job over input shards)
    workers: int = 2  #: local: tasks run at once
    tasks: int = 0  #: output shards per corpus (= datatrove tasks); 0 = workers
    batch_size: int = 512  #: documents per tokenizer call
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class DataConfig:
    cache_dir: str = ".cache/data"  #: generated samples, tokenizers, indexed datasets (shared by runs)
    corpora: Dict[str, CorpusConfig] = field(default_factory=dict)
    mixtures: Dict[str, Any] = field(default_factory=dict)  #: name -> {corpus: weight} (weights checked by check_mixture)
    mixture: str = "default"  #: the active mixture
    split: str = "98,2,0"  #: train,valid,test share of each corpus's documents (megatron split string)
    valid_samples: int = 64  #: validation samples (split evenly over the mixture's categories)
    #: a corpus's consecutive shards are read as one megatron dataset of up to this many documents
    #: (megatron's document ids are int32); 0 = one megatron dataset per shard (data_pipeline/groups.py)
    max_group_documents: int = 2**31 - 1
    #: megatron datasets (shard groups) whose indices are built at once on the building rank
    #: (megatron's ``num_dataset_builder_threads``; the same indices, in less time, more memory)
    index_threads: int = 16
    eod_mask_loss: bool = True  #: no loss where the target is the next document's first token
    sample_seed: int = 1234  #: seed of the generated sample corpora
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    chat: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)


class DataConfigError(ValueError):
    """The data config cannot work; raised before anything is tokenised."""


def active_weights(cfg: DataConfig) -> Dict[str, float]:
    """The active mixture's corpora with a positive weight (call after :func:`check_data`)."""
    return {k: float(w) for k, w in cfg.mixtures[cfg.mixture].items() if w > 0}


def split_vector(split: str) -> List[float]:
    parts = [p.strip() for p in split.split(",")]
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+(\.\d*)?", p) for p in parts):
        raise DataConfigError(f"data.split={split!r} must be up to 3 comma-separated non-negative numbers")
    vec = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if vec[0] <= 0:
        raise DataConfigError(f"data.split={split!r} gives the train split no documents")
    return vec


def check_mixture(cfg: DataConfig) -> List[str]:
    if cfg.mixture not in cfg.mixtures:
        return [f"data.mixture={cfg.mixture!r} is not one of data.mixtures {sorted(cfg.mixtures)}"]
    problems = []
    weights = cfg.mixtures[cfg.mixture]
    where = f"data.mixtures.{cfg.mixture}"
    if not isinstance(weights, dict) or not weights:
        return [f"{where}={weights!r} must map corpus names to weights"]
    for name, w in weights.items():
        if name not in cfg.corpora:
            problems.append(f"{where}: unknown corpus {name!r} (data.corpora has {sorted(cfg.corpora)})")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or math.isnan(w) or math.isinf(w) or w < 0:
            problems.append(f"{where}.{name}={w} must be a finite weight >= 0")
    if not problems and not any(w > 0 for w in weights.values()):
        problems.append(f"{where}: all weights are zero ({dict(weights)}); at least one must be > 0")
    return problems


def expand_paths(paths: List[str]) -> List[str]:
    """Files named by ``paths`` (folders walked, globs expanded), sorted; missing ones raise."""
    files = []
    for p in paths:
        if glob.has_magic(p):
            hits = sorted(glob.glob(p, recursive=True))
            if not hits:
                raise FileNotFoundError(f"no file matches {p!r}")
            files.extend(hits)
        elif os.path.isdir(p) and not os.path.exists(os.path.join(p, "dataset_info.json")):
            found = [os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if not f.startswith(".")]
            if not found:
                raise FileNotFoundError(f"folder {p!r} has no files")
            files.extend(sorted(found))
        elif os.path.exists(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder {p!r}")
    return files


def _ascii_compatible(encoding: str) -> bool:
    """JSON lines are split at b"\\n" and parsed as ASCII JSON, so the codec must keep ASCII as is."""
    try:
        return "{}\n".encode(encoding) == b"{}\n" and b"{}\n".decode(encoding) == "{}\n"
    except (LookupError, TypeError):
        return False


def check_corpus(name: str, c: CorpusConfig, check_paths: bool = True) -> List[str]:
    where = f"data.corpora.{name}"
    problems = []
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        problems.append(f"{where}: corpus names are letters, digits and '_' only")
    if not re.fullmatch(r"[A-Za-z0-9_]+", c.category or ""):
        problems.append(f"{where}.category={c.category!r} must be a non-empty word (it becomes tokens_<category>)")
    elif c.category == "per_s":
        problems.append(f"{where}.category='per_s' would collide with the metric tokens_per_s")
    for key, value, allowed in (("format", c.format, FORMATS), ("packing", c.packing, PACKINGS),
                                ("invalid_utf8", c.invalid_utf8, UTF8_POLICIES)):
        if value not in allowed:
            problems.append(f"{where}.{key}={value!r} must be one of {list(allowed)}")
    if not _ascii_compatible(c.encoding):
        problems.append(f"{where}.encoding={c.encoding!r} must be an ASCII-compatible codec Python knows "
                        "(utf-8, latin-1, cp1252, ...)")
    if not 0 <= c.max_invalid_utf8_fraction <= 1:
        problems.append(f"{where}.max_invalid_utf8_fraction={c.max_invalid_utf8_fraction} must be in [0, 1]")
    if not c.paths:
        problems.append(f"{where}.paths is empty")
    samples = [p for p in c.paths if p.startswith(SAMPLE_SCHEME)]
    for p in samples:
        if p[len(SAMPLE_SCHEME):] not in SAMPLE_KINDS:
            problems.append(f"{where}.paths: {p!r} is not one of {[SAMPLE_SCHEME + k for k in SAMPLE_KINDS]}")
    if samples and len(samples) != len(c.paths):
        problems.append(f"{where}.paths: a generated sample corpus cannot be mixed with files")
    if check_paths and not samples:
        try:
            expand_paths(list(c.paths))
        except FileNotFoundError as e:
            problems.append(f"{where}.paths: {e}")
    return problems
