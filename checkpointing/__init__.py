"""Checkpoints: what one is on disk, the training state it holds, and megatron dist-checkpoint I/O a few tensors at a time."""
