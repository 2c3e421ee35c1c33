"""Preprocessing and loader throughput, measured in one run on this machine.

1. tokens/s of our preprocessing (DataTrove local executor, batched tokenisation, each task
   writing its own shard with megatron's IndexedDatasetBuilder) on a ~100 MB JSON-lines corpus
   at 1 and 2 workers, against a baseline doing what Megatron-LM's tools/preprocess_data.py does
   (one reader process feeding a multiprocessing.Pool that JSON-decodes and encodes one document
   per call; the main process appends each document to the builder), once with the raw
   ``tokenizers`` encode (conservative) and once through transformers as Megatron's
   HuggingFaceTokenizer does. All use the default trained BPE and must write the same tokens.
2. samples/s of the runtime loader (blended ``MixtureDataset`` through ``micro_batches``) for
   the tiny run (seq 128) and for 8K packed agent data, against what the tiny model's training
   step consumes (median step time of a short real run).
3. utilisation of best-fit packing of the sample agent corpus at 8K.

Also the ceiling: the tokenizer alone on the texts in memory on every core (no preprocessing can
beat it on this machine).

``python benchmarks/preprocess.py [--mb 100]``
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import argparse
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_pipeline.chat import render  # noqa: E402
from data_pipeline.config import CorpusConfig, DataConfig, PreprocessConfig, TokenizerConfig  # noqa: E402


def default_cfg() -> DataConfig:
    from omegaconf import OmegaConf

    node = OmegaConf.load(os.path.join(REPO, "conf", "data", "samples.yaml"))
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), node))
    cfg.cache_dir = os.path.join(REPO, cfg.cache_dir) if not os.path.isabs(cfg.cache_dir) else cfg.cache_dir
    return cfg


def make_corpus(cfg: DataConfig, path: str, megabytes: int) -> int:
    """~``megabytes`` of JSON lines cycled from the sample corpora (trajectories as rendered text)."""
    from data_pipeline.samples import materialize

    texts = []
    for kind in ("prose", "code", "math", "agent"):
        for f in materialize(kind, cfg.cache_dir, cfg.sample_seed):
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    rec = json.loads(line)
                    texts.append(render(rec["messages"], cfg.chat)[0] if "messages" in rec else rec["text"])
    rng, written = random.Random(0), 0
    with open(path, "w", encoding="utf-8") as out:
        while written < megabytes * 1_000_000:
            rng.shuffle(texts)
            for t in texts:
                line = json.dumps({"text": t}) + "\n"
                out.write(line)
                written += len(line.encode())
                if written >= megabytes * 1_000_000:
                    break
    return written


# --- the Megatron-LM-style baseline (tools/preprocess_data.py, no sentence splitting) ----------


class Encoder:
    """Per-document encode in a pool worker. ``kind``: ``tokenizers`` (the raw fast tokenizer, a
    conservative baseline) or ``transformers`` (what Megatron's HuggingFaceTokenizer calls:
    ``AutoTokenizer(...)(text).input_ids``)."""

    def __init__(self, tokenizer_path: str, eod: int, kind: str):
        self.tokenizer_path, self.eod, self.kind = tokenizer_path, eod, kind

    def initializer(self):
        if self.kind == "transformers":
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_file=self.tokenizer_path)
            Encoder.tokenize = staticmethod(lambda text: hf(text).input_ids)
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(self.tokenizer_path)
            Encoder.tokenize = staticmethod(lambda text: tok.encode(text, add_special_tokens=False).ids)

    def encode(self, json_line: str):
        text = json.loads(json_line)["text"]
        ids = Encoder.tokenize(text)
        ids.append(self.eod)
        return ids, [len(ids)], len(json_line)


def megatron_baseline(corpus: str, tokenizer_path: str, out_prefix: str, workers: int, kind: str) -> int:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    encoder = Encoder(tokenizer_path, tok.token_to_id("<|endoftext|>"), kind)
    builder = IndexedDatasetBuilder(out_prefix + ".bin", dtype=DType.optimal_dtype(tok.get_vocab_size()))
    tokens = 0
    with open(corpus, encoding="utf-8") as fin, multiprocessing.get_context("fork").Pool(
            workers, initializer=encoder.initializer) as pool:
        for doc, lengths, _ in pool.imap(encoder.encode, fin, 32):
            builder.add_document(doc, lengths)
            tokens += len(doc)
    builder.finalize(out_prefix + ".idx")
    return tokens


def ours(corpus: str, tokenizer_path: str, cache: str, workers: int):
    from data_pipeline.preprocess import prepare

    cfg = DataConfig(cache_dir=cache, corpora={"bench": CorpusConfig(paths=[corpus])},
                     mixtures={"default": {"bench": 1.0}}, tokenizer=TokenizerConfig(path=tokenizer_path),
                     preprocess=PreprocessConfig(workers=workers))
    return prepare(cfg)["bench"]


def tokenizer_ceiling(corpus: str, tokenizer_path: str, tokens: int) -> float:
    """tokens/s of the BPE alone over the corpus's texts in memory, batched on every core: what
    no preprocessing of this corpus with this tokenizer on this machine can beat."""
    code = f"""
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "true"
from tokenizers import Tokenizer
tok = Tokenizer.from_file({tokenizer_path!r})
with open({corpus!r}, encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for line in f]
t0 = time.perf_counter()
for i in range(0, len(texts), 512):
    tok.encode_batch_fast(texts[i:i + 512], add_special_tokens=False)
print(time.perf_counter() - t0)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return tokens / float(out.stdout.split()[-1])  # the EOD per document is not BPE work: a hair high


def concat_tokens(prefixes, dtype) -> np.ndarray:
    """All tokens of the shards in order (a .bin is the tokens back to back)."""
    return np.concatenate([np.fromfile(p + ".bin", dtype=dtype) for p in prefixes])


def loader_rate(dataset, seq_length: int, global_batch: int, micro_batch: int, seconds: float = 3.0) -> float:
    from data_pipeline.batches import micro_batches

    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and n + global_batch <= len(dataset):
        for _ in micro_batches(dataset, n, global_batch, micro_batch, 0, 1):
            pass
        n += global_batch
    return n / (time.perf_counter() - t0)


def training_consumption(tmp: str) -> float:
    """Samples/s the tiny model's training step consumes (median step of a short real run)."""
    run_dir = os.path.join(tmp, "train")
    subprocess.run([sys.executable, "-m", "pretrain.train", "trainer.steps=8", "curriculum=none", f"trainer.run_dir={run_dir}",
                    "logger.wandb.mode=disabled", "logger.progress_bar=false", "scheduler.warmup_steps=1",
                    "checkpoint.save_at_end=false"], cwd=REPO, check=True, capture_output=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f][2:]
    return 16 / float(np.median([r["step_time_s"] for r in steps]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from megatron.core.datasets.indexed_dataset import DType  # imported before forking workers

    from data_pipeline import tokenizer
    from data_pipeline.build import build_datasets

    cfg = default_cfg()
    tok_path = tokenizer.resolve(cfg)
    tmp = tempfile.mkdtemp(prefix="bench-preprocess-")
    try:
        corpus = os.path.join(tmp, "corpus.jsonl")
        size = make_corpus(cfg, corpus, args.mb)
        rows, reference = [], None
        dtype = DType.optimal_dtype(512)
        for workers in (1, 2):
            t0 = time.perf_counter()
            out = ours(corpus, tok_path, os.path.join(tmp, f"ours{workers}"), workers)
            t_ours = time.perf_counter() - t0
            ours_arr = concat_tokens(out.prefixes, dtype)
            walls = {}
            for kind in ("tokenizers", "transformers"):
                prefix = os.path.join(tmp, f"base-{kind}-{workers}")
                t0 = time.perf_counter()
                base_tokens = megatron_baseline(corpus, tok_path, prefix, workers, kind)
                walls[kind] = time.perf_counter() - t0
                assert out.stats["tokens"] == base_tokens
                assert np.array_equal(ours_arr, concat_tokens([prefix], dtype)), f"outputs differ ({kind})"
                os.remove(prefix + ".bin")
            reference = out.stats["tokens"]
            rows.append((workers, reference / walls["tokenizers"], reference / walls["transformers"],
                         reference / t_ours))
        ceiling = tokenizer_ceiling(corpus, tok_path, reference)
        print(f"\npreprocessing: {size / 1e6:.0f} MB JSON lines, {reference / 1e6:.1f} M tokens, "
              "identical output from all three")
        print(f"{'workers':>7} | {'megatron-style tok/s':>20} | {'megatron+transformers':>21} | {'ours tok/s':>12} | "
              f"{'ours / megatron-style':>21} | {'ours / +transformers':>20}")
        for w, b, h, o in rows:
            print(f"{w:>7} | {b:>20,.0f} | {h:>21,.0f} | {o:>12,.0f} | {o / b:>20.2f}x | {o / h:>19.2f}x")
        print(f"ceiling: the tokenizer alone on texts in memory, all {os.cpu_count()} cores, no reading or "
              f"writing: {ceiling:,.0f} tok/s")

        tiny, _ = build_datasets(cfg, 128, 1234, os.path.join(tmp, "run"), 512, num_samples=16 * 400)
        long_cfg = default_cfg()
        long_cfg.mixtures = {"default": {"agent": 1.0}}
        agent, _ = build_datasets(long_cfg, 8192, 1234, os.path.join(tmp, "run8k"), 512, num_samples=64)
        consume = training_consumption(tmp)
        r_tiny, r_long = loader_rate(tiny, 128, 16, 4), loader_rate(agent, 8192, 8, 1)
        print("\nruntime loader (one process)")
        print(f"  tiny run, seq 128, default mixture : {r_tiny:>9,.0f} samples/s = {r_tiny * 128:>12,.0f} tokens/s")
        print(f"  agent, seq 8192, best-fit packed   : {r_long:>9,.0f} samples/s = {r_long * 8192:>12,.0f} tokens/s")
        print(f"  tiny model training consumes       : {consume:>9,.1f} samples/s  "
              f"(loader headroom {r_tiny / consume:,.0f}x)")
        pad = agent.dataset.datasets[0].config.tokenizer.fill
        real = total = 0
        for shard in agent.dataset.datasets:
            for i in range(len(shard.packed["bin_offsets"]) - 1):
                s = shard[i]
                real += int((s["tokens"] != pad).sum()) + int(s["labels"][-1] != pad)
                total += 8193
        print(f"\nbest-fit packing of the sample agent corpus at 8K: utilisation {real / total:.4f} "
              f"({total // 8193} sequences)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
