"""Walsh-Hadamard rotation of the last dim (scaled by dim^-0.5, so it is orthonormal), as
DeepSeek-V3.2's indexer applies to q and k. Uses the CUDA ``fast_hadamard_transform`` package
when present for CUDA tensors; otherwise a pure-torch butterfly (any device, any float dtype)."""

from __future__ import annotations

import torch

from parallel.device import on_gpu

try:
    from fast_hadamard_transform import hadamard_transform as _cuda_hadamard
except ImportError:
    _cuda_hadamard = None


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    dim = x.shape[-1]
    if dim & (dim - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {dim}")
    if _cuda_hadamard is not None and on_gpu(x):
        return _cuda_hadamard(x, scale=dim ** -0.5)
    shape = x.shape
    y = x.reshape(-1, dim)
    h = 1
    while h < dim:
        y = y.view(-1, dim // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return (y.reshape(shape) * dim ** -0.5).to(x.dtype)
