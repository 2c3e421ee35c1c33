"""Local (non-Transformer-Engine) building blocks for GLM-5: an RMSNorm that works under
sequence parallelism. (MLA's core attention, with its unequal q/k and v head dims, is
:class:`model_providers.glm5.model.dsa.attention.DSACoreAttention`.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """RMSNorm whose weight is marked ``sequence_parallel`` when SP is on, so megatron's DDP
    all-reduces its gradient across the TP group (each rank saw only its sequence shard)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

