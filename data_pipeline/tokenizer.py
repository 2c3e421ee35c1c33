"""The tokenizer: a local HF fast tokenizer (``data.tokenizer.path``; GLM-5's for real runs) or,
by default, a byte-level BPE trained once with ``tokenizers`` on the sample corpora and cached
under ``<cache_dir>/tokenizers/``. Nothing is fetched from a hub.

:func:`tokenizer_vocab_size` answers from the config alone (the trained BPE has exactly
``data.tokenizer.vocab_size`` entries, checked when it is trained), so the run can compare it
with the model's vocabulary before anything is built."""

from __future__ import annotations

import json
import os
from functools import lru_cache

from data_pipeline.config import SAMPLE_KINDS, DataConfig, TokenizerConfig
from data_pipeline.fsutil import building_dir, file_lock, fingerprint

BPE_VERSION = 1


def tokenizer_file(path: str) -> str:
    """``path`` itself when it is a file, else ``path/tokenizer.json``."""
    f = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"no tokenizer.json at {path!r}")
    return f


def special_tokens(cfg: DataConfig) -> list[str]:
    return [cfg.tokenizer.eod_token, cfg.tokenizer.pad_token, *cfg.chat.markers()]


def tokenizer_vocab_size(tcfg: TokenizerConfig) -> int:
    if tcfg.path is None:
        return tcfg.vocab_size
    return load(tokenizer_file(tcfg.path)).get_vocab_size(with_added_tokens=True)


@lru_cache(maxsize=8)
def load(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def trained_dir(cfg: DataConfig) -> str:
    t = cfg.tokenizer
    key = fingerprint({"v": BPE_VERSION, "vocab": t.vocab_size, "bytes": t.train_bytes_per_corpus,
                       "special": special_tokens(cfg), "seed": cfg.sample_seed,
                       "samples": [_sample_key(k, cfg) for k in SAMPLE_KINDS]})
    return os.path.join(os.path.abspath(cfg.cache_dir), "tokenizers", f"bytebpe{t.vocab_size}-{key}")


def _sample_key(kind: str, cfg: DataConfig) -> str:
    from data_pipeline.samples import sample_dir

    return os.path.basename(sample_dir(kind, cfg.cache_dir, cfg.sample_seed))


def resolve(cfg: DataConfig) -> str:
    """Path of the tokenizer.json to use, training the default BPE if it is not cached yet."""
    if cfg.tokenizer.path is not None:
        return os.path.abspath(tokenizer_file(cfg.tokenizer.path))
    final = trained_dir(cfg)
    if not os.path.isdir(final):
        with file_lock(final):
            if not os.path.isdir(final):
                with building_dir(final) as tmp:
                    train_bpe(cfg, tmp)
    return os.path.join(final, "tokenizer.json")


def prepared(cfg: DataConfig) -> str | None:
    """:func:`resolve` without building: the tokenizer.json to use, or None while the default BPE
    is not trained yet (a configured path that is not there raises, as in :func:`resolve`)."""
    if cfg.tokenizer.path is not None:
        return os.path.abspath(tokenizer_file(cfg.tokenizer.path))
    path = os.path.join(trained_dir(cfg), "tokenizer.json")
    return path if os.path.isfile(path) else None


def training_texts(cfg: DataConfig):
    """Up to ``train_bytes_per_corpus`` characters of each sample corpus, in a fixed order;
    trajectories are rendered with the chat template so its markers are learnt in context."""
    from data_pipeline.chat import render
    from data_pipeline.samples import materialize

    for kind in SAMPLE_KINDS:
        budget = cfg.tokenizer.train_bytes_per_corpus
        for path in materialize(kind, cfg.cache_dir, cfg.sample_seed):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    rec = json.loads(line)
                    text = render(rec["messages"], cfg.chat)[0] if "messages" in rec else rec["text"]
                    yield text
                    budget -= len(text)
                    if budget <= 0:
                        break
            if budget <= 0:
                break


def train_bpe(cfg: DataConfig, out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = cfg.tokenizer
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=t.vocab_size, special_tokens=special_tokens(cfg),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=2)
    tok.train_from_iterator(training_texts(cfg), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != t.vocab_size:
        raise ValueError(f"the trained BPE has {got} tokens, not data.tokenizer.vocab_size={t.vocab_size} "
                         "(too little sample text for that many merges)")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": t.eod_token,
                   "pad_token": t.pad_token, "model_max_length": 1 << 30}, f, indent=1)
