"""One pipeline rank's model chunks and DDP buffers, built on the meta device without process groups.

The planner sizes a rank from the objects training builds, not from formulas: the project's
provider (``model_providers.glm5.model.provider.build_model_chunks``) builds the rank's chunks (every
virtual stage; embedding on the first, output layer and MTP on the last), the stage's trainable
set is applied (DSA mode, ``curriculum.stages[].trainable``), and megatron's own
``DistributedDataParallel`` (:func:`pretrain.stage_build.build_stage`, as the run) lays out its gradient buffers,
with the distributed optimizer's padding. Every tensor is on ``meta``: nothing is allocated and
a 744B rank builds in well under a second.

megatron-core's global parallel state is set as this rank of the layout would see it, with no
process group, by ``parallel.megatron_compat.meta_rank.rank_position`` (restored on exit); the
planner only says which rank of which layout.

The chunks use the local layer spec (no Transformer Engine: its layers allocate on the GPU even
under ``meta``) without grouped GEMM: the parameter set equals the Transformer Engine build's
(per-expert weights, norms fused into linears count the same); megatron's 64-element alignment
of each parameter in the distributed optimizer's buffers may then differ by < 64 elements per
parameter.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from parallel.megatron_compat import meta_rank


#: megatron-core 0.19.2's loggers that warn at every model build: GPTModel's deprecation in favour
#: of HybridModel, DDP computing its own parameter layout. A training run says each once per stage;
#: a plan builds dozens of ranks, and those lines were half of its output.
BUILD_WARNINGS = ("megatron.core.models.gpt.gpt_model", "megatron.core.distributed.distributed_data_parallel")


@contextlib.contextmanager
def _without_build_warnings():
    loggers = [logging.getLogger(name) for name in BUILD_WARNINGS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@dataclass
class MetaRank:
    """What one rank of pipeline rank ``pp_rank`` builds, on ``meta``."""

    pp_rank: int
    chunks: list  #: GLM5Model per virtual stage, in model order
    ddp: list  #: megatron DistributedDataParallel per chunk (its buffers: ``buffers`` dense,
    #: ``expert_parallel_buffers`` experts, each with ``data_parallel_group`` a
    #: ``meta_rank.SizedGroup``)
    names: dict  #: parameter -> its name in its chunk
    dp: int  #: ranks sharing the dense buffers (distributed optimizer): dp * cp
    expert_dp: int  #: ranks sharing the expert buffers: world / (ep * etp * pp)


def rank_position(par, layout, pp_rank: int):
    """megatron's parallel state as rank (tp 0, pp ``pp_rank``, ep 0, dp 0) of ``layout`` (for
    ``par``) sees it; restored on exit."""
    if not 0 <= pp_rank < par.pp:
        raise ValueError(f"pp_rank={pp_rank} is not a pipeline rank of parallel.pp={par.pp}")
    return meta_rank.rank_position(tp=par.tp, pp=par.pp, cp=par.cp, dp=layout.dp, ep=par.ep,
                                   expert_tp=par.expert_tp, expert_dp=layout.expert_dp,
                                   world_size=layout.world_size, vpp=par.vpp, pp_rank=pp_rank)


def transformer_config(rc):
    """megatron's config of ``rc`` for a meta build: no init kernels, host-style allocation
    (follows the ``meta`` device), per-expert weights as Transformer Engine holds them.

    FP8 and the layer-level speed features (dispatcher, fusions, EP / TP overlap) change no
    parameter and no buffer, but megatron's config checks them against the installed Transformer
    Engine / DeepEP; a plan is made on a machine without them, so the meta build leaves them at
    their defaults (the pipeline layout and the DDP overlap fields, which do shape the chunks and
    the gradient buckets, are kept), and so the recompute module ``moe_act`` (grouped GEMM only;
    activations are counted by :mod:`planner.activations`, not from this build)."""
    import dataclasses

    from model_providers.glm5.model.config import to_transformer_config
    from parallel.config import ParallelConfig
    from parallel.features import TRANSFORMER_FIELDS

    plain = ParallelConfig()
    par = dataclasses.replace(rc.parallel, **{f: getattr(plain, f) for f in TRANSFORMER_FIELDS})
    # moe_act recomputation needs megatron's grouped-GEMM experts, which a meta build replaces
    # with per-expert MLPs of the same parameters
    model = dataclasses.replace(rc.model, recompute_modules=[
        r for r in rc.model.recompute_modules if r != "moe_act"] or ["mla_up_proj"])
    tcfg = to_transformer_config(model, par, dataclasses.replace(rc.precision, fp8=None))
    tcfg.use_cpu_initialization, tcfg.perform_initialization = True, False
    tcfg.moe_grouped_gemm = False
    return tcfg


def build_rank(rc, layout, pp_rank: int, trainable: Optional[Sequence[str]] = ()) -> MetaRank:
    """Chunks and DDP wrappers of pipeline rank ``pp_rank`` of ``rc`` (one stage's resolved run
    config) at ``layout`` (``parallel.config.check_layout``), trainable as the stage trains:
    the DSA mode's set, narrowed by the stage's ``trainable`` patterns."""
    from pretrain.stage_build import build_stage

    with rank_position(rc.parallel, layout, pp_rank), torch.device("meta"), _without_build_warnings():
        built = build_stage(rc, "local", trainable, tcfg=transformer_config(rc), optimizer=False)
    names = {p: n for c in built.chunks for n, p in c.named_parameters()}
    return MetaRank(pp_rank, built.chunks, built.ddp, names, dp=layout.dp * rc.parallel.cp,
                    expert_dp=layout.expert_dp)

