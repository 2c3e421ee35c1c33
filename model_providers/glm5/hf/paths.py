"""The folders an HF ``import`` / ``export`` / ``loss`` reads and writes: checked before any
work, and the output staged so that nothing which exists is ever deleted or overwritten.

OUT must be absent or an empty folder, and must not be, contain or lie inside a source (compared
as resolved real paths). The result is written to ``<OUT>.partial`` next to OUT (holding a
:data:`MARKER` file while it is being written) and renamed to OUT when complete, so an
interrupted conversion never leaves something at OUT. A rerun removes a leftover
``<OUT>.partial`` only when it carries the marker, i.e. when this tool made it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil

from checkpointing.dist_io import CheckpointFileError

PARTIAL_SUFFIX = ".partial"
MARKER = ".glm5_hf_partial"  #: inside a staging folder while it is written


class HFPathError(CheckpointFileError):
    """A source that is missing or damaged, or an output that is in use. The CLI prints the
    message and exits non-zero, without a traceback."""


def _entries(path: str, limit: int = 5) -> str:
    names = sorted(os.listdir(path))
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"{len(names)} {'entry' if len(names) == 1 else 'entries'}: {shown}"


def check_hf_dir(path: str) -> None:
    """``path`` is an HF model folder: a folder with ``config.json`` and either
    ``model.safetensors`` or ``model.safetensors.index.json`` (their contents are checked by
    ``hf_mapping.HFReader``)."""
    if not os.path.isdir(path):
        raise HFPathError(f"HF model folder {path} does not exist" if not os.path.exists(path)
                          else f"HF model folder {path} is not a folder")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise HFPathError(f"{config} is missing: {path} is not a Hugging Face model folder "
                          f"({_entries(path)})")
    try:
        with open(config) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        raise HFPathError(f"{config} is not readable JSON: {e}") from None
    weights = [os.path.join(path, n) for n in ("model.safetensors.index.json", "model.safetensors")]
    if not any(os.path.isfile(w) for w in weights):
        raise HFPathError(f"{path} has no weights: neither {weights[0]} nor {weights[1]} exists")


def check_checkpoint_dir(path: str) -> None:
    """``path`` is a megatron dist checkpoint folder (``metadata.json`` + torch's ``.metadata``), e.g. an
    import or one ``iter_XXXXXXX`` folder of a run; a run dir gets a hint at its newest one."""
    if not os.path.isdir(path):
        raise HFPathError(f"checkpoint folder {path} does not exist" if not os.path.exists(path)
                          else f"checkpoint {path} is not a folder")
    missing = [n for n in ("metadata.json", ".metadata") if not os.path.isfile(os.path.join(path, n))]
    if missing:
        iters = sorted(os.path.join(d, n) for d in (path, os.path.join(path, "checkpoints"))
                       if os.path.isdir(d) for n in os.listdir(d)
                       if n.startswith("iter_") and not n.endswith(".tmp"))
        hint = f"; a run's checkpoints are its iter_* folders, e.g. {iters[-1]}" if iters else ""
        raise HFPathError(f"{path} is not a megatron dist checkpoint ({' and '.join(missing)} "
                          f"missing){hint}")


def _inside(child: str, parent: str) -> bool:
    return os.path.commonpath([child, parent]) == parent


def check_output(out: str, source: str) -> None:
    """OUT is new or an empty folder, and neither is nor contains nor lies inside ``source``."""
    real, src = os.path.realpath(out), os.path.realpath(source)
    if real == src:
        raise HFPathError(f"OUT {out} is the source {source}: write the result to a new folder")
    if _inside(real, src):
        raise HFPathError(f"OUT {out} is inside the source {source}: write the result elsewhere")
    if _inside(src, real):
        raise HFPathError(f"the source {source} is inside OUT {out}: write the result elsewhere")
    if os.path.lexists(out):
        if not os.path.isdir(out):
            raise HFPathError(f"OUT {out} exists and is not a folder; nothing is overwritten: "
                              "give a new or empty folder")
        if os.listdir(out):
            raise HFPathError(f"OUT {out} exists and is not empty ({_entries(out)}); nothing is "
                              "overwritten: give a new or empty folder")


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files + ["."]:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@contextlib.contextmanager
def staged_output(out: str):
    """Yields the staging folder ``<OUT>.partial`` to write the result into; on success it
    becomes OUT (a rename, which fails rather than replace a folder that is no longer empty),
    on any error it is removed. Call :func:`check_output` first."""
    final = os.path.realpath(out)
    tmp = final + PARTIAL_SUFFIX
    if os.path.lexists(tmp):
        if not os.path.isfile(os.path.join(tmp, MARKER)):
            raise HFPathError(f"{tmp} exists and was not made by this tool (no {MARKER} in it); "
                              "move it away or give another OUT")
        shutil.rmtree(tmp)  # left by an interrupted run of this tool
    try:
        os.makedirs(tmp)
        open(os.path.join(tmp, MARKER), "w").close()
    except OSError as e:
        raise HFPathError(f"cannot create the staging folder {tmp}: {e.strerror}") from None
    try:
        yield tmp
        os.remove(os.path.join(tmp, MARKER))
        _fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise HFPathError(f"OUT {out} was filled while the result was written; nothing is "
                              "overwritten, the result is discarded") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
