"""MLA's kv up-projection (``linear_kv_up_proj``: the kv latent -> per-head k_nope and v) that
up-projects only the leading tokens the core attention reads.

megatron's MLA up-projects every token's latent into n heads' keys and values (2 * lora *
n * (qk_nope + v) FLOPs per token, and twice that again in backward). DSA's sparse mode reads
them only for the dense prefix (the first top-k keys, :meth:`DSACoreAttention._sparse`): every
later query attends in the absorbed form, which reads the latent itself. Under context
parallelism no mode reads the local projection (the keys and values of the whole sequence are
rebuilt from the gathered latent). :class:`GLM5MLASelfAttention` sets ``rows`` before each
forward; the rows past it are zeros (they get no gradient either way).

The module is still called, on the leading rows, so hooks on it (megatron's parameter
all-gather before forward under ``overlap_param_gather``) run as for the full projection.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F


def zero_padded(prefix: torch.Tensor, length: int) -> torch.Tensor:
    """``prefix`` [rows, ...] followed by zero rows up to ``length`` (one full-size tensor, no
    concatenation's second copy). A pad, not a slice assignment into zeros: the backward of
    that (CopySlices) clones the whole full-size gradient, a pad's copies only the prefix rows."""
    rows = prefix.shape[0]
    if rows >= length:
        return prefix
    return F.pad(prefix, (0, 0) * (prefix.dim() - 1) + (0, length - rows))


@lru_cache(maxsize=None)
def kv_up_projection(base: type) -> type:
    """``base`` (a column-parallel linear class) projecting only the first ``rows`` tokens."""

    class KVUpProjection(base):
        #: leading tokens to project (None: all); dim 0 of the input is the sequence, which is
        #: whole on this rank (set only without sequence parallelism)
        rows: int | None = None

        def forward(self, x, *args, **kwargs):
            rows = self.rows
            if rows is None or rows >= x.shape[0]:
                return super().forward(x, *args, **kwargs)
            out, bias = super().forward(x[:rows], *args, **kwargs)
            return zero_padded(out, x.shape[0]), bias

    KVUpProjection.__qualname__ = KVUpProjection.__name__ = f"KVUp{base.__name__}"
    return KVUpProjection
