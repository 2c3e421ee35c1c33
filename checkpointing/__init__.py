"""Checkpoints: what one is on disk, the training state it holds, and megatron dist-checkpoint I/O a few tensors at a time."""

from checkpointing import safe_metadata

safe_metadata.install()  # before any checkpoint is opened: .metadata never runs code (safe_metadata)
