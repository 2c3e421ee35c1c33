"""Interleaved / half-split rotary embedding for the lightning indexer (HF layout), plain or
YaRN-scaled exactly as megatron's MLA rotary is (HF's ``GlmMoeDsaIndexer`` gets the model's own
cos/sin)."""

from __future__ import annotations

import torch


def yarn_inv_freq(dim: int, theta: float, yarn) -> tuple[torch.Tensor, float]:
    """megatron's ``YarnRotaryEmbedding`` frequencies [dim // 2] (fp32, computed as it does, with
    its own correction-range and ramp helpers) and its cos/sin scale (concentration factor).
    ``yarn``: a :class:`~model_providers.glm5.model.config.YarnConfig`."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_get_concentration_factor,
        _yarn_linear_ramp_mask,
    )

    power = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / power, 1.0 / (yarn.factor * power)
    low, high = _yarn_find_correction_range(yarn.beta_fast, yarn.beta_slow, dim, theta,
                                            yarn.original_max_position_embeddings)
    keep = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device="cpu")
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, _yarn_get_concentration_factor(yarn.factor, yarn.mscale, yarn.mscale_all_dim)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype=torch.float32, yarn=None):
    """cos, sin of shape [*positions.shape, dim // 2] (one angle per rotated pair), angles in
    fp64. ``yarn`` (a :class:`~model_providers.glm5.model.config.YarnConfig`, None for plain RoPE):
    megatron's YaRN frequencies, cos and sin multiplied by its scale."""
    if yarn is None:
        inv_freq, scale = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), 1.0
    else:
        inv_freq, scale = yarn_inv_freq(dim, theta, yarn)
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device, torch.float64)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` ([..., dim]); ``cos``/``sin`` broadcast as [..., dim // 2].

    interleaved (GLM-5): pairs are (x0, x1), (x2, x3), ...; half-split (DeepSeek-V3.2): pairs are
    (x_i, x_{i + dim/2}). Both return the rotated pairs in half-split order, as HF does."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
