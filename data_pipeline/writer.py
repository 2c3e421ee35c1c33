"""Tokenise one task's documents in batches and write them as a megatron indexed dataset shard.

DataTrove step after :class:`data_pipeline.readers.CorpusReader`. Each document becomes one
sequence (and one document) of ``shard_<task>.bin/.idx`` written by megatron-core's
``IndexedDatasetBuilder``, EOD appended. Trajectories also get ``shard_<task>-lossmask.bin/.idx``
(uint8, same lengths): 1 where the token may be a training target. ``shard_<task>.json`` holds
the shard's stats and each file's checksum (:mod:`data_pipeline.integrity`: hashed by the task
that wrote it, so a Slurm array's tasks share that work). A task with no documents writes nothing.
"""

from __future__ import annotations

import json
import os

import numpy as np
from datatrove.utils.batching import batched
from datatrove.utils.tokenization import PipelineStepWithTokenizer

from data_pipeline.chat import loss_mask, token_kinds
from data_pipeline.fsutil import file_digest
from data_pipeline.integrity import MASK_SUFFIX, records


def shard_prefix(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"shard_{rank:05d}")


class IndexedShardWriter(PipelineStepWithTokenizer):
    name = "indexed shard writer"
    type = "🔢 - TOKENIZER"

    def __init__(self, out_dir: str, tokenizer_path: str, eod_token: str, batch_size: int,
                 mask_template: bool = True, mask_tool_results: bool = True, tasks_per_node: int = 1):
        super().__init__(tokenizer_path, eos_token=None)
        self.out_dir, self.eod_token, self.batch_size = out_dir, eod_token, batch_size
        self.mask_template, self.mask_tool_results = mask_template, mask_tool_results
        self.tasks_per_node = tasks_per_node  #: tasks sharing this machine's cores at once

    def _configure_tokenizer(self):
        """The task's share of the cores goes to the tokenizer's batch threads (a Slurm task's
        affinity is its allocation; local tasks split the machine). Tokens do not change."""
        threads = max(1, len(os.sched_getaffinity(0)) // self.tasks_per_node)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
        os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when this process first runs a batch
        return self.tokenizer

    def run(self, data, rank: int = 0, world_size: int = 1):
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        tok = self._configure_tokenizer()
        eod = tok.token_to_id(self.eod_token)
        if eod is None:
            raise ValueError(f"data.tokenizer.eod_token={self.eod_token!r} is not a token of {self.tokenizer_name_or_path}")
        dtype = DType.optimal_dtype(tok.get_vocab_size(with_added_tokens=True))
        prefix = shard_prefix(self.out_dir, rank)
        stats = {"documents": 0, "tokens": 0, "bytes": 0, "empty_documents": 0,
                 "invalid_utf8_documents": 0, "replacement_chars": 0, "loss_tokens": 0}
        builder = masks = None
        for batch in batched(data, self.batch_size):
            docs = [d for d in batch if d.text]
            stats["empty_documents"] += len(batch) - len(docs)
            if not docs:
                continue
            chat = "spans" in docs[0].metadata
            texts = [d.text for d in docs]
            with self.track_time(unit="batch"):
                encs = (tok.encode_batch(texts, add_special_tokens=False) if chat
                        else tok.encode_batch_fast(texts, add_special_tokens=False))
                ids = [e.ids for e in encs]
                lengths = [len(x) + 1 for x in ids]
                flat = np.empty(sum(lengths), dtype=dtype)
                ends = np.cumsum(lengths)
                for x, end in zip(ids, ends):
                    flat[end - len(x) - 1 : end - 1] = x
                flat[ends - 1] = eod
            if builder is None:
                builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
                if chat:
                    masks = IndexedDatasetBuilder(prefix + MASK_SUFFIX + ".bin", dtype=np.uint8)
            start = 0
            for i, end in enumerate(ends):
                builder.add_document(flat[start:end], [int(end - start)])
                if chat:
                    kinds = token_kinds(encs[i].offsets, docs[i].metadata["spans"])
                    m = np.append(loss_mask(kinds, self.mask_template, self.mask_tool_results), np.uint8(1))
                    masks.add_document(m, [len(m)])
                    stats["loss_tokens"] += int(m.sum())
                start = end
            stats["documents"] += len(docs)
            stats["tokens"] += int(ends[-1])
            stats["bytes"] += sum(len(t.encode("utf-8")) for t in texts)
            replaced = [d.metadata.get("replaced", 0) for d in docs]
            stats["invalid_utf8_documents"] += sum(1 for r in replaced if r)
            stats["replacement_chars"] += sum(replaced)
        for key, value in stats.items():
            self.stat_update(key, value=value)
        if builder is None:
            return
        stats["tokenizer"] = file_digest(self.tokenizer_name_or_path)  # checked by data_pipeline.blend
        builder.finalize(prefix + ".idx")
        if masks is not None:
            masks.finalize(prefix + MASK_SUFFIX + ".idx")
        else:
            stats["loss_tokens"] = stats["tokens"]
        stats["loss_mask"] = masks is not None
        names = [os.path.basename(prefix) + s + e for s in ("", MASK_SUFFIX)[: 1 + stats["loss_mask"]]
                 for e in (".bin", ".idx")]
        stats["files"] = records(self.out_dir, names)  # the manifest's digests, taken here once per shard
        with open(prefix + ".json", "w") as f:
            json.dump(stats, f)
