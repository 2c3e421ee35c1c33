"""Every change this project makes to megatron-core's behaviour, and every place it reaches into
megatron-core's internals, in one package.

- Correctness fixes, on every backend (CPU and GPU): :func:`install` (``fixes.py``,
  ``distrib_optimizer.py``, ``mtp.py``, ``micro_batch.py``), called by ``parallel.initialize``
  before any model or optimizer is built. :func:`set_mtp_block_class` and
  :func:`config_with_mtp_depths` are the per-model hooks of ``mtp.py``; :func:`release_cached_modules` empties megatron's caches and
  :func:`reset_loss_trackers` its per-layer loss trackers (after each stage).
- ``micro_batch.py``: :class:`MicroBatch`, the one per-micro-batch context for what megatron's
  forward does not pass down (the document ids' host copy, the MTP shifts' document boundaries,
  the MLA intermediates the DSA core attention reads); the model's forward makes it active, and
  the installed patches re-enter it in recomputation and carry its hand-overs through the
  core attention's selective recomputation.
- ``schedule_plan.py``: megatron's schedule plans (the EP all-to-all overlap's combined 1F1B)
  for this model: every node runs under its micro-batch, the shared MTP layer is planned per
  depth (``GLM5Model.build_schedule_plan``).
- ``tp_attributes.py``: the TP marks of every linear layer's parameters rewritten from what the
  layer is (Transformer Engine's are wrong for replicated and expert layers); the model provider
  applies it to every chunk it builds.
- ``optimizer_wrappers.py``: what an optimizer taking the place of megatron's inner torch
  optimizer (Muon) reads of megatron's optimizer wrappers, and the replacement itself.
- ``async_writer.py``: the spawned process that writes async checkpoint saves
  (:func:`spawned_writer_queue`, which checks the release itself; imported where used, not here:
  it imports megatron), in place of megatron's fork per save; ``fixes.py``'s
  :func:`deferred_rank_zero_writes` keeps a save's rank-0-only write errors for every rank;
  ``bucket_writes.py`` keeps a failed file write's error (installed by :func:`install` and in
  the writer process).
- ``model_space_shards.py``: the distributed optimizer's state as each rank's own boxes of the
  parameters' global tensors, the format of a stage's final checkpoint into another layout
  (megatron's own gathers, or needs the flattened ranges 0.19.2 refuses, as 0.16.1 did).
- ``meta_rank.py``: megatron's private ``parallel_state`` globals, ``torch.distributed``'s default
  group and ``torch.cuda.current_device`` as one rank of a layout sees them, without process
  groups, for the planner's meta builds (restored on exit).
- ``jit_fusers.py``: megatron's ``torch.compile`` decorator made a plain one without CUDA, before
  megatron is imported (it costs every CPU process ~1.8 s of its start); installed by
  :func:`bootstrap`.
- CPU emulation, only without CUDA: ``cpu_emulation.py`` (CUDA on CPU ranks) and
  ``strict_cuda.py`` (fail where CUDA would), installed by ``cpu_emulation.install``.

Each patch names the upstream behaviour it changes; the installs and the entry points of the
other modules refuse a megatron-core release other than the one they were written for
(``version.py``), so an upgrade shows which to re-check.
"""

import importlib

from parallel.megatron_compat import jit_fusers


def bootstrap() -> None:
    """What a process does before megatron-core's first import, called first by each entry point
    (``pretrain.train``, ``planner``, ``data_pipeline.prepare`` and ``preprocess``, the HF tool,
    ``benchmarks/``, the async checkpoint writer, ``tests/conftest.py`` and the test helpers run
    as processes): :mod:`.jit_fusers`' plain ``torch.compile`` without CUDA. Idempotent; once
    megatron is imported it changes nothing (a process that skips it starts ~1.8 s slower on CPU
    and computes the same). Importing this package imports no megatron: the names below load
    their module on first use."""
    jit_fusers.install()


#: the package's names, each loaded from its module on first use (they import megatron-core)
_NAMES = {"install": "fixes", "release_cached_modules": "fixes", "reset_loss_trackers": "fixes",
          "deferred_rank_zero_writes": "fixes", "take_deferred_write_failure": "fixes",
          "MicroBatch": "micro_batch", "config_with_mtp_depths": "mtp", "set_mtp_block_class": "mtp"}


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)


__all__ = ["bootstrap", *_NAMES]
