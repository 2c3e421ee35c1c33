"""Pipeline ends balanced by compute.

The first pipeline rank also runs the embedding (no matmul, little time) and the last runs the
final norm, the output layer and the shared MTP module ``mtp_num_steps`` times, each step with its
own output head: for GLM-5 at 4K that is ~11 decoder layers' worth of FLOPs. Megatron's
``num_layers_in_first/last_pipeline_stage`` move decoder layers off those ranks; this module picks
the values that minimise the slowest rank's compute and says how uneven the result still is.
"""

from __future__ import annotations

from typing import Optional

from parallel.config import rank_layer_counts


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
    loads = [float(n) for n in rank_layer_counts(num_layers, par)]
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



def piece_equivalents(rc) -> tuple[float, float]:
    """(the MTP module at all its steps, the output heads with the loss) in decoder-layer units
    (training FLOPs per token at the stage's sequence length, from the exact counts)."""
    from model_providers.glm5.counting.flops import flops_per_token

    f = flops_per_token(rc.model, rc.trainer.seq_length)
    per_layer = (f.total - f.mtp - f.output_heads) / rc.model.num_layers
    return f.mtp / per_layer, f.output_heads / per_layer


def balanced_layouts(rc, pp: int, vpp: Optional[int]) -> list[str]:
    """megatron ``pipeline_model_parallel_layout`` strings for ``pp`` ranks of ``vpp`` chunks
    whose ranks carry equal compute: the MTP module and the loss with the output heads either
    together in the last chunk or in the last two chunks (on the last two ranks), and the
    decoder layers filled in where the load is lowest (rank r holds chunks r, r + pp, ...; each
    rank's layers split evenly over its chunks, in model order). Empty for pp == 1."""
    if pp < 2:
        return []
    v = vpp or 1
    chunks = pp * v
    n = rc.model.num_layers
    mtp, heads = piece_equivalents(rc)
    has_mtp = bool(rc.model.mtp_num_steps)
    out = []
    placements = [(chunks - 1, chunks - 1)]
    if has_mtp:
        placements.append((chunks - 2, chunks - 1))
    for mtp_chunk, loss_chunk in placements:
        extra = [0.0] * pp
        if has_mtp:
            extra[mtp_chunk % pp] += mtp
        extra[loss_chunk % pp] += heads
        # megatron places every decoder layer before the MTP module: a loss chunk after the MTP
        # chunk holds none
        own = [v] * pp
        if loss_chunk != mtp_chunk:
            own[loss_chunk % pp] -= 1
        layers = [0] * pp
        for _ in range(n):  # water-fill: the next layer to the least loaded rank (the latest on ties)
            r = min((i for i in range(pp) if own[i]), key=lambda i: (layers[i] + extra[i], -i))
            layers[r] += 1
        counts = [0] * chunks
        for r in range(pp):
            for k in range(own[r]):
                counts[k * pp + r] = layers[r] // own[r] + (1 if k >= own[r] - layers[r] % own[r] else 0)
        stages = []
        for c in range(chunks):
            s = ("E" if c == 0 else "") + ("t" * counts[c] if counts[c] < 3 else f"t*{counts[c]}")
            s += ("m" if has_mtp and c == mtp_chunk else "") + ("L" if c == loss_chunk else "")
            stages.append(s)
        layout = "|".join(stages)
        if layout not in out:
            out.append(layout)
    return out
