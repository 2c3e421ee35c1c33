"""Muon's orthogonalisation of one momentum matrix, whole or split into row blocks.

The quintic Newton-Schulz iteration and the RMS-matching scale are torch's (``torch.optim.Muon``,
torch 2.13): its iteration runs in bf16 and is used as is for ``ns_dtype="bf16"``. For
``ns_dtype="fp32"`` the same iteration (same coefficients, same normalisation) runs in fp32,
because torch's function hard-casts to bf16; fp32 keeps layouts that differ only in summation
order (TP gathers, DP shards) within float rounding of each other.

After 5 steps the singular values of the result lie in a band around 1 (roughly [0.5, 1.5], not
exactly 1: the coefficients maximise the slope at zero instead of converging); see
``SINGULAR_VALUE_BAND``.
"""

from __future__ import annotations

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
#: where the quintic iteration puts the singular values after 5 steps (torch's docstring: ~U(0.5, 1.5))
SINGULAR_VALUE_BAND = (0.5, 1.5)
NS_DTYPES = ("fp32", "bf16")
SCALES = ("match_rms_adamw", "original")


def _newton_schulz_fp32(m: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = COEFFICIENTS
    x = m.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalize(m: torch.Tensor, steps: int, ns_dtype: str) -> torch.Tensor:
    """[rows, cols] -> [rows, cols] fp32 with singular values in ``SINGULAR_VALUE_BAND``."""
    if ns_dtype == "bf16":
        return _zeropower_via_newtonschulz(m, COEFFICIENTS, steps, EPS).float()
    return _newton_schulz_fp32(m, steps)


def rms_scale(shape, scale: str) -> float:
    """Factor on the orthogonalised update of a [rows, cols] matrix: ``match_rms_adamw`` gives it
    Adam's typical update RMS (0.2 sqrt(max(rows, cols)), Moonshot's rule) so one LR schedule serves
    Muon and Adam; ``original`` is Keller Jordan's sqrt(max(1, rows / cols))."""
    return _adjust_lr(1.0, scale, torch.Size(shape))


def row_blocks(rows: int, block_rows: tuple[int, ...] | None) -> list[int]:
    """Row sizes of the independently orthogonalised blocks: ``block_rows`` repeated to cover
    ``rows`` (one repetition per attention head), or the whole matrix when None."""
    if not block_rows:
        return [rows]
    period = sum(block_rows)
    if rows % period:
        raise ValueError(f"{rows} rows are not a whole number of {block_rows} head blocks")
    return list(block_rows) * (rows // period)


def orthogonalized_blocks(m: torch.Tensor, block_rows, steps: int, ns_dtype: str, scale: str):
    """Each row block of a [rows, cols] momentum matrix (or the whole matrix) orthogonalised on its
    own: a list of (first_row, orthogonalised [block_rows, cols] fp32, its ``rms_scale``)."""
    out, first = [], 0
    for block in torch.split(m, row_blocks(m.size(0), block_rows), dim=0):
        out.append((first, orthogonalize(block, steps, ns_dtype), rms_scale(block.shape, scale)))
        first += block.size(0)
    return out


def orthogonalized_update(m: torch.Tensor, block_rows, steps: int, ns_dtype: str,
                          scale: str) -> torch.Tensor:
    """The scaled Muon direction of a [rows, cols] momentum matrix, [rows, cols] fp32."""
    return torch.cat([o * r for _, o, r in orthogonalized_blocks(m, block_rows, steps, ns_dtype, scale)])
