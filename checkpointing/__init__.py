"""Checkpoints: what one is on disk, the training state it holds, and megatron dist-checkpoint I/O a few tensors at a time."""

import parallel.megatron_compat  # noqa: F401 -- installs what must precede megatron-core's import
