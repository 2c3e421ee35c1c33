"""The run: Hydra entry point, training loop, optimizer, checkpoints, metrics."""
