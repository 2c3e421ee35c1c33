"""Checkpoints on disk: scanning, init_from, backend key mapping."""
