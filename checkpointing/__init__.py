"""Checkpoints: what one is on disk, the training state it holds, and megatron dist-checkpoint I/O a few tensors at a time."""

import parallel.megatron_compat  # noqa: F401 -- installs what must precede megatron-core's import

from checkpointing import safe_metadata  # noqa: E402

safe_metadata.install()  # before any checkpoint is opened: .metadata never runs code (safe_metadata)
