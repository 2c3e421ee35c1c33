"""The device this rank computes on, one answer for every backend."""

from __future__ import annotations

import torch

from parallel.megatron_compat import cpu_emulation


def current_device():
    """What megatron passes as ``device=``: the rank's GPU, or under the CPU emulation the
    emulated one (the CPU in plain mode; a tracked device in strict mode); the CPU otherwise."""
    if torch.cuda.is_available() or cpu_emulation.is_active():
        return torch.cuda.current_device()
    return torch.device("cpu")


def to_device(batch: dict) -> dict:
    """A host batch's tensors on this rank's device (``non_blocking``: asynchronous where the
    host memory is pinned)."""
    device = current_device()
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a real GPU (not only the strict CPU emulation's tracked device): the
    test for choosing GPU kernels and GPU-only numerics paths."""
    return t.is_cuda and torch.cuda.is_available()
