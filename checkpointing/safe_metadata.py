"""A distributed checkpoint's ``.metadata`` read without running code from it.

torch's ``FileSystemReader.read_metadata`` (which megatron's torch_dist loader inherits) reads
``.metadata`` with a plain ``pickle.load``: a crafted file runs any code it names as soon as a
checkpoint is validated, resumed, used by ``checkpoint.init_from`` or opened by the HF tool.
:func:`install` gives torch's filesystem module a ``pickle`` whose ``load`` admits only the
classes a checkpoint's metadata is made of (:data:`ALLOWED`, and torch's dtypes, layouts and
memory formats by name); anything else is refused before it is called, with the file and the
class in one :class:`UnsafeCheckpointError`. Writing is unchanged (``pickle.dump``).

What else a checkpoint holds is read without pickle's globals already: ``common.pt`` and the
data files' byte items with ``torch.load(weights_only=True)``, ``metadata.json`` and the
manifest as JSON (docs/reliability.md says what is trusted).
"""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint import filesystem

from checkpointing.dist_io import CheckpointFileError

_DCP = "torch.distributed.checkpoint"
#: (module, name) of every class or function a DCP metadata pickle may name (torch 2.13; megatron
#: 0.16.1's and 0.19.2's torch_dist write the same): the metadata dataclasses, the save plans kept in
#: ``all_local_plans``, the storage info, torch.Size, the layout lookup and the checkpoint id
#: (a path, when the writer was given one: the HF import's)
ALLOWED = frozenset({
    *((f"{_DCP}.metadata", n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                         "StorageMeta", "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                        "LoadPlan", "ReadItem", "LoadItemType")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
})


class UnsafeCheckpointError(CheckpointFileError):
    """A checkpoint file that names a class or function it may not (see the module docstring)."""


def _torch_constant(module: str, name: str) -> bool:
    """``torch.<name>`` that is a dtype, layout or memory format (pickled by name)."""
    return module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format))


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or _torch_constant(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path} names {module}.{name}, which a checkpoint's metadata never holds: refused "
            f"without running it (the file was not written by torch's checkpoint writer)")


def load(file):
    """``pickle.load`` restricted to :data:`ALLOWED`."""
    return _MetadataUnpickler(file, getattr(file, "name", "a checkpoint's .metadata")).load()


class _RestrictedPickle:
    """torch's filesystem module's view of ``pickle``: ``load`` restricted, the rest as is."""

    load = staticmethod(load)

    def __getattr__(self, name):
        return getattr(pickle, name)


def install() -> None:
    """Make torch's DCP filesystem reader (and megatron's, which inherits it) read ``.metadata``
    through :func:`load`. Idempotent."""
    if not isinstance(filesystem.pickle, _RestrictedPickle):
        filesystem.pickle = _RestrictedPickle()
