"""Reading one corpus's local inputs as a DataTrove pipeline step, sharded over its tasks.

Formats: JSON lines (``.jsonl``/``.json``/``.ndjson``, optionally ``.gz``), plain-text files
(one file = one document), parquet and saved HF datasets (both through HF ``datasets``).
Uncompressed JSON lines are split by byte range, so one big file still spreads over all tasks (a
line belongs to the task its first byte falls in); other inputs are split by whole files, and a
saved dataset by row range. Bytes are decoded with the corpus's ``encoding``; invalid ones are
replaced (and counted) or rejected with the file and byte offset, per ``invalid_utf8``.
Trajectories (``messages_field``) are rendered here with the chat template; the token-kind spans
travel in the document's metadata.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os

from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep

from data_pipeline.chat import TrajectoryError, render
from data_pipeline.config import ChatTemplateConfig


class DataError(ValueError):
    """An input cannot be read as configured; names the corpus, file and position."""


def detect_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if os.path.isdir(path):
        return "hf_disk"
    ext = os.path.splitext(name)[1].lower()
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if ext == ".parquet":
        return "parquet"
    if ext in (".txt", ".md", ".text", ".rst") or ext == "":
        return "text"
    raise DataError(f"{path}: cannot tell the format from the extension {ext!r}; set format")


def byte_range(sizes: list[int], rank: int, world_size: int) -> tuple[int, int]:
    total = sum(sizes)
    return total * rank // world_size, total * (rank + 1) // world_size


class CorpusReader(PipelineStep):
    name = "corpus reader"
    type = "📖 - READER"

    def __init__(self, corpus: str, files: list[str], fmt: str, text_field: str,
                 messages_field: str | None, invalid_utf8: str, chat: ChatTemplateConfig,
                 encoding: str = "utf-8"):
        super().__init__()
        self.corpus, self.files, self.fmt = corpus, list(files), fmt
        self.text_field, self.messages_field = text_field, messages_field
        self.invalid_utf8, self.chat, self.encoding = invalid_utf8, chat, encoding
        self.formats = [detect_format(f) if fmt == "auto" else fmt for f in self.files]
        if len(set(self.formats)) > 1:
            raise DataError(f"corpus {corpus!r} mixes formats {sorted(set(self.formats))}; split it in two corpora")

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        fmt = self.formats[0] if self.files else "jsonl"
        if fmt == "hf_disk":
            yield from self._read_hf_disk(rank, world_size)
            return
        sizes = [os.path.getsize(f) for f in self.files]
        lo, hi = byte_range(sizes, rank, world_size)
        start = 0
        for path, size in zip(self.files, sizes):
            begin, end = max(lo - start, 0), min(hi - start, size)
            splittable = fmt == "jsonl" and not path.endswith(".gz")
            if splittable and begin < end:
                yield from self._read_jsonl(path, begin, end)
            elif not splittable and lo <= start < hi:
                if fmt == "jsonl":
                    yield from self._read_jsonl(path, 0, None)
                elif fmt == "text":
                    yield from self._read_text(path)
                elif fmt == "parquet":
                    yield from self._read_parquet(path)
            start += size

    # --- decoding and record access ---------------------------------------------------------

    def _decode(self, raw: bytes, where: str) -> tuple[str, int]:
        try:
            return raw.decode(self.encoding), 0
        except UnicodeDecodeError as e:
            if self.invalid_utf8 == "reject":
                what = ("UTF-8" if codecs.lookup(self.encoding).name == "utf-8"
                        else f"{self.encoding} (data.corpora.{self.corpus}.encoding)")
                raise DataError(f"corpus {self.corpus!r}: {where}: invalid {what} at byte {e.start} "
                                f"(data.corpora.{self.corpus}.invalid_utf8=reject)") from None
            text = raw.decode(self.encoding, errors="replace")
            return text, text.count("\ufffd")

    def _document(self, rec, where: str, doc_id: str, replaced: int = 0) -> Document:
        if not isinstance(rec, dict):
            raise DataError(f"corpus {self.corpus!r}: {where}: expected an object, got {type(rec).__name__}")
        field = self.messages_field or self.text_field
        if field not in rec:
            raise DataError(f"corpus {self.corpus!r}: {where}: no field {field!r} (fields: {sorted(rec)[:20]}); "
                            f"set data.corpora.{self.corpus}.{'messages_field' if self.messages_field else 'text_field'}")
        meta = {"replaced": replaced}
        if self.messages_field:
            try:
                text, spans = render(rec[field], self.chat)
            except TrajectoryError as e:
                raise DataError(f"corpus {self.corpus!r}: {where}: field {field!r}: {e}") from None
            meta["spans"] = spans
        else:
            text = rec[field]
            if not isinstance(text, str):
                raise DataError(f"corpus {self.corpus!r}: {where}: field {field!r} is {type(text).__name__}, not text")
        return Document(text=text, id=doc_id, metadata=meta)  # empty ones are counted by the writer

    # --- formats -----------------------------------------------------------------------------

    def _read_jsonl(self, path: str, begin: int, end: int | None):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            pos = begin
            if begin > 0:
                f.seek(begin - 1)
                if f.read(1) != b"\n":
                    pos += len(f.readline())  # that line started in the previous task's range
            while end is None or pos < end:
                line = f.readline()
                if not line:
                    break
                where, offset = f"{path}: line at byte {pos}", pos
                pos += len(line)
                if not line.strip():
                    continue
                text, replaced = self._decode(line, where)
                try:
                    rec = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"corpus {self.corpus!r}: {where}: not JSON ({e.msg})") from None
                yield self._document(rec, where, f"{os.path.basename(path)}:{offset}", replaced)

    def _read_text(self, path: str):
        with open(path, "rb") as f:
            raw = f.read()
        text, replaced = self._decode(raw, path)
        yield self._document({self.text_field: text}, path, os.path.basename(path), replaced)

    def _read_parquet(self, path: str):
        import datasets

        ds = datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True)
        for i, rec in enumerate(ds):
            yield self._document(rec, f"{path}: row {i}", f"{os.path.basename(path)}:{i}")

    def _read_hf_disk(self, rank: int, world_size: int):
        import datasets

        for path in self.files:
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise DataError(f"corpus {self.corpus!r}: {path}: a DatasetDict without a 'train' split ({list(ds)})")
                ds = ds["train"]
            n = len(ds)
            for i in range(n * rank // world_size, n * (rank + 1) // world_size):
                yield self._document(ds[i], f"{path}: row {i}", f"{os.path.basename(path)}:{i}")
