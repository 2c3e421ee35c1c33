"""Pipeline ends balanced by compute.

The first pipeline rank also runs the embedding (no matmul, little time) and the last runs the
final norm, the output layer and the shared MTP module ``mtp_num_steps`` times, each step with its
own output head: for GLM-5 at 4K that is ~11 decoder layers' worth of FLOPs. Megatron's
``num_layers_in_first/last_pipeline_stage`` move decoder layers off those ranks; this module picks
the values that minimise the slowest rank's compute and says how uneven the result still is.
"""

from __future__ import annotations

from typing import Optional

from parallel.config import _rank_layer_counts


def layer_equivalents(rc) -> tuple[float, float]:
    """(extra compute of the first rank, of the last rank) in decoder-layer units (training FLOPs
    per token of the stage's model at its sequence length, from the exact counts)."""
    from model_providers.glm5.counting.flops import flops_per_token

    f = flops_per_token(rc.model, rc.trainer.seq_length)
    per_layer = (f.total - f.mtp - f.output_heads) / rc.model.num_layers
    return 0.0, (f.mtp + f.output_heads) / per_layer


def rank_loads(num_layers: int, pp: int, first: Optional[int], last: Optional[int],
               extra_first: float, extra_last: float) -> list[float]:
    """Layer-equivalents per pipeline rank for these ends."""
    from parallel.config import ParallelConfig

    par = ParallelConfig(pp=pp, first_stage_layers=first, last_stage_layers=last)
    loads = [float(n) for n in _rank_layer_counts(num_layers, par)]
    loads[0] += extra_first
    loads[-1] += extra_last
    return loads


def _valid(num_layers: int, pp: int, vpp: Optional[int], first, last) -> bool:
    """Whether megatron accepts these ends (the run's own layer checks, on a layout of pp ranks)."""
    from parallel.config import ParallelConfig, check_layout

    par = ParallelConfig(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    layout, _ = check_layout(par, world_size=pp, num_layers=num_layers, num_attention_heads=1,
                             num_experts=None, seq_length=2, micro_batch_size=1, global_batch_size=pp)
    return layout is not None


def balanced_ends(rc, pp: int, vpp: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """``(first_stage_layers, last_stage_layers)`` (None = even) minimising the slowest rank's
    compute for ``pp`` ranks of ``vpp`` chunks; ties keep the even split."""
    n = rc.model.num_layers
    extra_first, extra_last = layer_equivalents(rc)
    options = [None] + list(range(1, n + 1))
    best = (max(rank_loads(n, pp, None, None, extra_first, extra_last)), 0, None, None) \
        if _valid(n, pp, vpp, None, None) else (float("inf"), 0, None, None)
    for first in options:
        for last in options:
            if (first, last) == (None, None) or pp < 2 or not _valid(n, pp, vpp, first, last):
                continue
            score = max(rank_loads(n, pp, first, last, extra_first, extra_last))
            changes = (first is not None) + (last is not None)
            if (score, changes) < best[:2]:
                best = (score, changes, first, last)
    return best[2], best[3]

