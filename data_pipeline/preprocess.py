"""``python -m data_pipeline.preprocess [data=<group>] [overrides]``: corpora -> indexed datasets.

Each corpus of the active mixture (or ``corpora=[a,b]``) becomes
``<cache_dir>/indexed/<corpus>-<fingerprint>/`` holding one ``shard_<task>.bin/.idx`` per
DataTrove task and ``stats.json`` (documents, tokens, bytes, invalid UTF-8, per shard). The
fingerprint covers the inputs (path, size, mtime), the tokenizer file, and every setting that
changes the output, so a rerun skips finished corpora and a changed input rebuilds. The folder
only appears, by rename, once complete, with a manifest in ``stats.json``
(:mod:`data_pipeline.integrity`).

Every use verifies the folder first (a stat per file; a file changed since its checksum was taken
is read whole and its checksum compared). A damaged one (a file missing, truncated or altered --
a ``.bin`` overwritten in place included --, or no manifest of this version: an older version
made it) is renamed ``<folder>.damaged-<n>`` with a warning naming the file and problem (both
checksums for an altered file), and rebuilt from its inputs; where it cannot be rebuilt here (the slurm executor
inside a run) it is an error naming the file. Concurrent callers build under a lock; the one that
waited verifies and uses the folder the other published. A corpus whose documents were altered by
``invalid_utf8=replace`` is warned about on every use, and is an error above
``max_invalid_utf8_fraction``.

``data.preprocess.executor=local`` runs the tasks here in worker processes;
``executor=slurm`` submits a Slurm array job (one task per shard) plus a dependent job that
writes ``stats.json`` and renames the folder; the training run then finds it complete.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import codecs
import errno
import glob
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from typing import List, NamedTuple

from data_pipeline import tokenizer
from data_pipeline.config import SAMPLE_SCHEME, CorpusConfig, DataConfig, DataConfigError, active_weights, expand_paths
from data_pipeline.corpus_steps import finalize, num_tasks, pipeline
from data_pipeline.fsutil import building_dir, file_lock, fingerprint
from data_pipeline.integrity import CorpusDamaged, set_aside, verify
from data_pipeline.readers import DataError
from data_pipeline.validation import validate_data

PREPROCESS_VERSION = 1
log = logging.getLogger(__name__)


@dataclass
class CorpusOutput:
    """A finished corpus: absolute shard prefixes with their token counts."""

    name: str
    path: str
    prefixes: List[str]
    shard_tokens: List[int]
    loss_mask: bool
    stats: dict = field(default_factory=dict)


def corpus_files(name: str, c: CorpusConfig, cfg: DataConfig) -> list[str]:
    if c.paths and c.paths[0].startswith(SAMPLE_SCHEME):
        from data_pipeline.samples import materialize

        return materialize(c.paths[0][len(SAMPLE_SCHEME):], cfg.cache_dir, cfg.sample_seed)
    try:
        return [os.path.abspath(f) for f in expand_paths(list(c.paths))]
    except FileNotFoundError as e:
        raise DataError(f"corpus {name!r}: data.corpora.{name}.paths: {e}") from None


def _stat_inputs(files: list[str]) -> list:
    out = []
    for f in files:
        walk = [os.path.join(d, n) for d, _, ns in os.walk(f) for n in ns] if os.path.isdir(f) else [f]
        for p in sorted(walk):
            st = os.stat(p)
            out.append([p, st.st_size, st.st_mtime_ns])
    return out


def output_dir(name: str, c: CorpusConfig, cfg: DataConfig, files: list[str], tok_path: str) -> str:
    from data_pipeline.fsutil import file_digest

    unused = ("category", "packing", "paths", "max_invalid_utf8_fraction")
    settings = {k: v for k, v in asdict(c).items() if k not in unused}
    if codecs.lookup(c.encoding).name == "utf-8":  # keeps the keys from before the field existed
        del settings["encoding"]
    key = fingerprint({
        "version": PREPROCESS_VERSION, "settings": settings, "inputs": _stat_inputs(files),
        "tokenizer": file_digest(tok_path), "eod": cfg.tokenizer.eod_token, "tasks": num_tasks(cfg),
        "chat": asdict(cfg.chat) if c.messages_field else None,
    })
    return os.path.join(os.path.abspath(cfg.cache_dir), "indexed", f"{name}-{key}")


def load_output(name: str, path: str) -> CorpusOutput:
    with open(os.path.join(path, "stats.json")) as f:
        stats = json.load(f)
    shards = stats["shards"]
    return CorpusOutput(name=name, path=path, prefixes=[os.path.join(path, s["prefix"]) for s in shards],
                        shard_tokens=[s["tokens"] for s in shards], loss_mask=stats["loss_mask"], stats=stats)


def prepare_corpus(name: str, cfg: DataConfig, allow_submit: bool = False) -> CorpusOutput | None:
    """The corpus's finished, verified output, building it here (local) when missing or damaged.
    With the slurm executor such an output is submitted (``allow_submit``) and None returned, or
    refused."""
    c = cfg.corpora[name]
    files = corpus_files(name, c, cfg)
    tok_path = tokenizer.resolve(cfg)
    if c.messages_field:
        tok = tokenizer.load(tok_path)
        missing = {k: v for k, v in asdict(cfg.chat).items() if tok.token_to_id(v) is None}
        if missing:
            raise DataConfigError(f"corpus {name!r} renders trajectories, but the chat markers "
                                  f"{', '.join(f'data.chat.{k}={v!r}' for k, v in missing.items())} "
                                  f"are not tokens of {tok_path}")
    final = output_dir(name, c, cfg, files, tok_path)
    problems = verify(final, refresh=True) if os.path.exists(final) else None
    if problems == []:
        return _warn_altered(name, c, load_output(name, final))
    if cfg.preprocess.executor == "slurm":
        if not allow_submit:
            what = (f"is not preprocessed ({final} missing)" if problems is None
                    else f"is damaged ({'; '.join(problems)})")
            error = DataConfigError if problems is None else CorpusDamaged
            raise error(f"corpus {name!r} {what} and data.preprocess.executor=slurm: run "
                        "`python -m data_pipeline.preprocess` first (it sets a damaged folder aside and resubmits)")
        from data_pipeline.slurm import submit

        with file_lock(final):
            _set_aside_if_damaged(name, final)
        submit(name, c, cfg, files, tok_path, final)
        return None
    with file_lock(final):
        _set_aside_if_damaged(name, final)
        if not os.path.isdir(final):
            for stale in glob.glob(glob.escape(final) + ".partial-*"):  # left by a killed build
                shutil.rmtree(stale, ignore_errors=True)
            try:
                with building_dir(final) as tmp:
                    run_local(pipeline(name, c, cfg, files, tok_path, tmp), cfg, os.path.join(tmp, "logs"))
                    finalize(name, tmp, num_tasks(cfg), files)
            except OSError as e:  # published meanwhile by a process the lock did not reach (another node)
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not os.path.isdir(final):
                    raise
                log.warning("corpus %r: %s was published by another process during this build; using it", name, final)
    return checked_output(name, c, final)


class Lacking(NamedTuple):
    """Something a run's data needs that is not on disk yet: what, its state, where it belongs."""

    thing: str  #: e.g. ``corpus 'code'``
    state: str  #: e.g. ``not preprocessed``
    path: str

    def __str__(self) -> str:
        return f"{self.thing} {self.state} ({self.path})"


def existing_output(name: str, cfg: DataConfig, check: bool = False) -> tuple[CorpusOutput | None, Lacking | None]:
    """:func:`prepare_corpus` without building anything (the file system alone): ``(output,
    None)`` when the corpus's finished folder for the current inputs is there, else ``(None, what
    is missing)``; ``check``: its folder must also verify against its manifest (a stat and a few
    index bytes per shard file; a re-hash of a file changed since its checksum; nothing written)."""
    from data_pipeline.samples import sample_dir

    c = cfg.corpora[name]
    if c.paths and c.paths[0].startswith(SAMPLE_SCHEME):
        kind = c.paths[0][len(SAMPLE_SCHEME):]
        folder = sample_dir(kind, cfg.cache_dir, cfg.sample_seed)
        if not os.path.isdir(folder):
            return None, Lacking(f"sample corpus {kind!r}", "not generated", folder)
    tok_path = tokenizer.prepared(cfg)
    if tok_path is None:
        return None, Lacking("tokenizer", "not trained", tokenizer.trained_dir(cfg))
    final = output_dir(name, c, cfg, corpus_files(name, c, cfg), tok_path)
    if not os.path.isfile(os.path.join(final, "stats.json")):
        return None, Lacking(f"corpus {name!r}", "not preprocessed", final)
    problems = verify(final) if check else []
    if problems:
        return None, Lacking(f"corpus {name!r}", "damaged: " + "; ".join(p.replace(final + os.sep, "") for p in problems),
                             final)
    return load_output(name, final), None


def _set_aside_if_damaged(name: str, final: str) -> None:
    """Under the corpus's lock: a damaged ``final`` is renamed out of the way, with a warning."""
    problems = verify(final) if os.path.exists(final) else []
    if problems:
        aside = set_aside(final)
        log.warning("corpus %r: %s is damaged (%s); set aside as %s and rebuilt", name, final,
                    "; ".join(p.replace(final + os.sep, "") for p in problems), os.path.basename(aside))


def checked_output(name: str, c: CorpusConfig, final: str) -> CorpusOutput:
    problems = verify(final, refresh=True)
    if problems:
        raise CorpusDamaged(f"corpus {name!r}: {final} is damaged:\n  - " + "\n  - ".join(problems))
    return _warn_altered(name, c, load_output(name, final))


def _warn_altered(name: str, c: CorpusConfig, out: CorpusOutput) -> CorpusOutput:
    """Documents altered by ``invalid_utf8=replace`` are a warning on every use, and an error
    above ``max_invalid_utf8_fraction`` (the output stays cached: raising it needs no rebuild)."""
    altered, documents = out.stats["invalid_utf8_documents"], out.stats["documents"]
    if altered:
        where = f"data.corpora.{name}"
        what = (f"corpus {name!r}: {altered} of {documents} documents ({altered / documents:.2%}) had bytes "
                f"that are not valid {c.encoding}, replaced by U+FFFD ({where}.invalid_utf8={c.invalid_utf8})")
        if altered / documents > c.max_invalid_utf8_fraction:
            raise DataError(f"{what}, more than {where}.max_invalid_utf8_fraction={c.max_invalid_utf8_fraction}. "
                            f"If the input is in another encoding (e.g. Latin-1), set {where}.encoding; "
                            f"{where}.invalid_utf8=reject names the first bad byte; raising "
                            f"{where}.max_invalid_utf8_fraction trains on the altered text")
        log.warning(what)
    return out


def worker_start_method() -> str:
    """``fork`` from a plain single-threaded process (fast: workers inherit the imports);
    ``forkserver`` when this process already runs other threads (a training run triggering the
    preprocessing: process-group, W&B and pool threads), where a forked worker can inherit a lock
    held by one of them and hang; and when this process handles SIGTERM itself (a training run's
    preemption handler), which forked workers would inherit: the pool ends its workers with
    SIGTERM, and workers that only note it never exit."""
    import signal
    import threading

    import torch.distributed as dist

    busy = threading.active_count() > 1 or (dist.is_available() and dist.is_initialized())
    own_sigterm = signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    return "forkserver" if busy or own_sigterm else "fork"


def run_local(steps: list, cfg: DataConfig, logging_dir: str) -> None:
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (imported once, inherited by forked workers)
    from datatrove.executor import LocalPipelineExecutor

    tasks = num_tasks(cfg)
    LocalPipelineExecutor(pipeline=steps, tasks=tasks, workers=min(cfg.preprocess.workers, tasks),
                          logging_dir=logging_dir, skip_completed=False,
                          start_method=worker_start_method()).run()


def prepare(cfg: DataConfig, names: list[str] | None = None, allow_submit: bool = False) -> dict:
    """Finished outputs of ``names`` (default: the active mixture's corpora with weight > 0)."""
    names = list(names) if names else list(active_weights(cfg))
    unknown = [n for n in names if n not in cfg.corpora]
    if unknown:
        raise DataConfigError(f"corpora={unknown} not in data.corpora {sorted(cfg.corpora)}")
    return {n: prepare_corpus(n, cfg, allow_submit) for n in names}


# --- CLI ---------------------------------------------------------------------------------------


@dataclass
class PreprocessRunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    corpora: List[str] = field(default_factory=list)  #: empty = the active mixture's corpora


def main() -> None:
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="preprocess_schema", node=PreprocessRunConfig)

    @hydra.main(version_base=None, config_path="../conf", config_name="preprocess")
    def _run(cfg) -> None:
        merged = OmegaConf.merge(OmegaConf.structured(PreprocessRunConfig), OmegaConf.to_container(cfg))
        run_cfg: PreprocessRunConfig = OmegaConf.to_object(merged)
        validate_data(run_cfg.data)
        outputs = prepare(run_cfg.data, run_cfg.corpora, allow_submit=True)
        summary = {n: (None if o is None else {"path": o.path, **{k: o.stats[k] for k in
                       ("documents", "tokens", "bytes", "invalid_utf8_documents")}, "shards": len(o.prefixes)})
                   for n, o in outputs.items()}
        print(json.dumps(summary), flush=True)

    _run()


if __name__ == "__main__":
    main()
