"""Interleaved / half-split rotary embedding for the lightning indexer (HF layout)."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype=torch.float32):
    """cos, sin of shape [*positions.shape, dim // 2] (one angle per rotated pair)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` ([..., dim]); ``cos``/``sin`` broadcast as [..., dim // 2].

    interleaved (GLM-5): pairs are (x0, x1), (x2, x3), ...; half-split (DeepSeek-V3.2): pairs are
    (x_i, x_{i + dim/2}). Both return the rotated pairs in half-split order, as HF does."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
