"""Megatron dist checkpoints (torch_dist format) written and read a few tensors at a time.

``dist_checkpointing.save`` needs every tensor in memory at once, which a 744B model on one
host cannot offer. :func:`save_lazily` writes the same on-disk format (torch DCP files +
``.metadata``, megatron's ``metadata.json``; the common state a ``common_state`` object of the DCP
files, as megatron 0.19 writes it) from the 1-rank sharded state dict
of a model built on the meta device: each chunk's data is produced by a callback only when the
writer reaches it, chunks are written in model order, one file per layer, and only the most
recent tensor is cached (the SwiGLU factory splits ``linear_fc1`` into two chunks).
megatron's loader reshards by the global tensor keys, so any TP/PP/EP layout can load the result.
:func:`load_tensors` reads chosen tensors back through megatron's own loader.
"""

from __future__ import annotations

import io
import os
import queue
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class CheckpointFileError(ValueError):
    """A checkpoint file that is missing or damaged (truncated, unreadable metadata). Tools print the
    message and exit non-zero, without a traceback."""


#: the DCP key of the common (non-tensor) state, which megatron 0.19's loader reads
#: (``serialization.load_common_state_dict``)
COMMON_STATE_KEY = ShardedObject("common_state", None, (1,), (0,)).unique_key


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a global tensor, and where its data comes from."""

    key: str  #: global tensor key (DCP fqn)
    global_shape: tuple
    offset: tuple  #: global offset, prepended (expert) axes included
    sizes: tuple  #: chunk shape, prepended axes as 1
    name: str  #: state-dict name of the megatron tensor holding the data
    rows: Optional[tuple] = None  #: (start, stop) rows of that tensor, when a factory split it


def _factory_chunks(name: str, fac: ShardedTensorFactory) -> list[ShardedTensor]:
    """Build a factory on a row-index tensor, so each product says which rows it holds."""
    shape = tuple(fac.data.shape)
    rows = torch.arange(shape[0]).view(-1, *([1] * (len(shape) - 1))).expand(shape)
    built = fac.build_fn(fac.key, rows, fac.replica_id, getattr(fac, "flattened_range", None))
    built = list(built.values()) if isinstance(built, dict) else list(built)
    for sh in built:
        if not isinstance(sh, ShardedTensor):
            raise TypeError(f"{name}: factory built {type(sh).__name__}, expected ShardedTensors")
    return built


def plan_chunks(sharded_sd: dict) -> tuple[list[Chunk], dict[str, object]]:
    """Chunks (in model order) and ShardedObjects of a 1-rank model's ``sharded_state_dict()``."""
    chunks, objects = [], {}
    for name, v in sharded_sd.items():
        if isinstance(v, ShardedObject):
            objects[v.unique_key] = v.data
            continue
        if isinstance(v, ShardedTensor):
            parts, rows = [v], [None]
        elif isinstance(v, ShardedTensorFactory):
            parts = _factory_chunks(name, v)
            rows = []
            for sh in parts:
                idx = sh.data.reshape(sh.data.shape[0], -1)[:, 0]
                lo, hi = int(idx[0]), int(idx[-1]) + 1
                if not torch.equal(idx, torch.arange(lo, hi)):
                    raise ValueError(f"{name}: factory chunk is not a contiguous row range")
                rows.append((lo, hi))
        else:
            raise TypeError(f"{name}: unexpected {type(v).__name__} in the sharded state dict")
        for sh, r in zip(parts, rows):
            if sh.flattened_range is not None:
                raise ValueError(f"{name}: flattened shards are not supported")
            chunks.append(Chunk(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                                (1,) * sh.prepend_axis_num + tuple(sh.local_shape), name, r))
    return chunks, objects


class _LazyTensor:
    """A DCP-checkpointable global tensor whose chunks exist only as metadata until written."""

    def __init__(self, chunks: list[Chunk], dtype: torch.dtype):
        self.chunks, self.dtype = chunks, dtype
        self.by_offset = {tuple(c.offset): c for c in chunks}

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(c.offset), i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(c.offset), torch.Size(c.sizes)),
                              properties=props, size=torch.Size(c.global_shape)))
                for i, c in enumerate(self.chunks)]


class _LazyPlanner(DefaultSavePlanner):
    """Resolves a write item by calling the data source; keeps only the latest tensor."""

    def __init__(self, lazy: dict, source: Callable[[str], torch.Tensor], dtypes: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.lazy, self.source, self.dtypes = lazy, source, dtypes
        self._cached: tuple = (None, None)

    def resolve_data(self, write_item: WriteItem):
        obj = self.lazy.get(write_item.index.fqn)
        if not isinstance(obj, _LazyTensor):
            return super().resolve_data(write_item)
        chunk = obj.by_offset[tuple(write_item.index.offset)]
        if self._cached[0] != chunk.name:
            self._cached = (None, None)  # drop the previous tensor before making the next
            self._cached = (chunk.name, self.source(chunk.name).to(self.dtypes[chunk.name]))
        data = self._cached[1]
        if chunk.rows is not None:
            data = data[chunk.rows[0]:chunk.rows[1]]
        if data.numel() != torch.Size(chunk.sizes).numel():
            raise ValueError(f"{chunk.name}: source gave {tuple(data.shape)}, chunk needs {chunk.sizes}")
        return data.reshape(chunk.sizes)

    def transform_object(self, write_item, object):
        return object  # ShardedObjects arrive serialised, as megatron stores them


class _GroupedWriter(FileSystemWriter):
    """One DCP file per model group (layer), items written in plan order by one thread that
    resolves each just before writing it (no copy-ahead). Overrides ``write_data`` only to
    choose the files; the writing itself is torch's (``_write_data``)."""

    def __init__(self, path: str, group_of: Callable[[str], str]):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1,
                         per_thread_copy_ahead=0)
        self.group_of = group_of

    def write_data(self, plan, planner):
        buckets: list[list] = []
        last = object()
        for item in plan.items:
            group = self.group_of(item.index.fqn)
            if group != last or not buckets:
                buckets.append([])
                last = group
            buckets[-1].append(item)
        files: queue.Queue = queue.Queue()
        for i, bucket in enumerate(buckets):
            name = f"{plan.storage_data.prefix}{i}.distcp"
            files.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, files)


def _group_of_key(key: str) -> str:
    if "_extra_state" in key:
        return "_extra_state"
    parts = key.split(".")
    return ".".join(parts[:3]) if parts[0] in ("decoder", "mtp") and len(parts) > 2 else parts[0]


def save_lazily(out_dir: str, chunks: list[Chunk], objects: dict, dtypes: dict,
                source: Callable[[str], torch.Tensor], common: dict) -> None:
    """Write a megatron torch_dist checkpoint into the existing folder ``out_dir`` (the caller
    stages it and publishes it when complete: ``hf_paths.staged_output``). ``dtypes[name]`` is
    the stored dtype of megatron tensor ``name``, ``source(name)`` its data."""
    by_key: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_key.setdefault(c.key, []).append(c)
    lazy: dict = {}
    for key, cs in by_key.items():
        kinds = {dtypes[c.name] for c in cs}
        if len(kinds) != 1:
            raise ValueError(f"{key}: chunks disagree on dtype {kinds}")
        lazy[key] = _LazyTensor(cs, kinds.pop())
    for key, data in {**objects, COMMON_STATE_KEY: common}.items():
        buf = io.BytesIO()
        torch.save([data], buf)
        lazy[key] = buf
    try:
        dcp_save(lazy, storage_writer=_GroupedWriter(out_dir, _group_of_key),
                 planner=_LazyPlanner(lazy, source, dtypes))
    except CheckpointException as e:  # one rank: what ``source`` raised (e.g. a damaged shard)
        raise next(iter(e.failures.values()))[0] from None
    save_config(CheckpointingConfig("torch_dist", 1), out_dir)


def load_common(ckpt_dir: str) -> dict:
    return dist_checkpointing.load_common_state_dict(ckpt_dir)


def check_files(ckpt_dir: str) -> None:
    """Every data file the checkpoint's DCP metadata names exists and holds the byte ranges it
    lists: a missing or truncated file is named (with the first tensor it cuts) before any
    tensor is read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(ckpt_dir).read_metadata()
    except CheckpointFileError:  # a class the metadata may not name (checkpointing.safe_metadata)
        raise
    except Exception as e:  # torch raises whatever its unpickling hits
        raise CheckpointFileError(f"{os.path.join(ckpt_dir, '.metadata')} is missing or unreadable "
                          f"({type(e).__name__}: {e})") from None
    items: dict[str, list] = {}
    for index, info in meta.storage_data.items():
        items.setdefault(info.relative_path, []).append((info.offset + info.length, index.fqn))
    for rel, ends in sorted(items.items()):
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointFileError(f"checkpoint file {path} is missing (it holds {min(ends)[1]}, ...)")
        size = os.path.getsize(path)
        cut = sorted(e for e in ends if e[0] > size)
        if cut:
            raise CheckpointFileError(f"checkpoint file {path} is truncated: {size} bytes, {max(ends)[0]} "
                              f"expected ({cut[0][1]} is cut)")


def stored_dtypes(ckpt_dir: str) -> dict[str, torch.dtype]:
    """dtype of every tensor key in the checkpoint (from its metadata, nothing is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(ckpt_dir).read_metadata()
    return {k: md.properties.dtype for k, md in meta.state_dict_metadata.items()
            if hasattr(md, "properties")}


def global_shapes(sharded_sd: dict) -> dict[str, tuple]:
    """Global shape of every tensor key of a model's ``sharded_state_dict()`` -- what a dist
    checkpoint's metadata records for it -- in model order, without touching data: a factory
    (the SwiGLU split of ``linear_fc1``) is built on its own tensor, which may be on ``meta``."""
    out: dict[str, tuple] = {}
    for v in sharded_sd.values():
        if isinstance(v, ShardedTensorFactory):
            built = v.build_fn(v.key, v.data, v.replica_id, getattr(v, "flattened_range", None))
            parts = list(built.values()) if isinstance(built, dict) else list(built)
        else:
            parts = [v]
        for sh in parts:
            if isinstance(sh, ShardedTensor):
                out.setdefault(sh.key, tuple(sh.global_shape))
    return out


def shape_mismatch(ckpt_dir: str, expected: dict[str, tuple]) -> Optional[str]:
    """The first tensor of ``expected`` (checkpoint key in local-backend naming -> global shape,
    :func:`global_shapes`) that the checkpoint stores with another shape or not at all, as a
    sentence; None when all of them fit. Read from the DCP metadata alone (no tensor, no process
    group); a checkpoint in Transformer Engine naming is compared through ``backend_keys``.
    Tensors only the checkpoint holds are fine: megatron loads what the model asks for."""
    from torch.distributed.checkpoint import FileSystemReader

    from checkpointing import backend_keys

    try:
        meta = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    except CheckpointFileError as e:  # a class the metadata may not name (checkpointing.safe_metadata)
        return str(e)
    except Exception as e:  # torch raises whatever its unpickling hits
        return f"{os.path.join(ckpt_dir, '.metadata')} is missing or unreadable ({type(e).__name__}: {e})"
    stored: dict[str, tuple] = {}
    for key, md in meta.items():
        local = backend_keys.te_to_local(key) if hasattr(md, "size") else None  # not a ShardedObject
        if local is not None:
            stored.setdefault(local, tuple(md.size))
    bad = [(k, stored.get(k), tuple(shape)) for k, shape in expected.items() if stored.get(k) != tuple(shape)]
    if not bad:
        return None
    key, have, want = bad[0]
    more = f" ({len(bad)} of the model's {len(expected)} tensors differ)" if len(bad) > 1 else ""
    if have is None:
        return f"{ckpt_dir} has no {key}, which the configured model has with shape {want}{more}"
    return (f"{key} has shape {have} in {ckpt_dir} but {want} in the configured model{more}; "
            f"model.* must describe the checkpoint's model")


def load_tensors(ckpt_dir: str, sharded_sd: dict, names: list[str], dtypes: dict) -> dict:
    """Read megatron tensors ``names`` (1-rank state-dict names, from a meta-device model's
    ``sharded_state_dict()``) into fresh CPU tensors of their stored dtype."""
    sub = {}
    for name in names:
        v = sharded_sd[name]
        dtype = dtypes[v.key]
        data = torch.empty(v.data.shape, dtype=dtype)
        sub[name] = replace(v, data=data) if isinstance(v, ShardedTensorFactory) else \
            replace(v, data=data, dtype=dtype)
    loaded = dist_checkpointing.load(sub, ckpt_dir)
    return {name: loaded[name] for name in names}

