"""What a stage trains, built one way for everyone: the megatron transformer config, this rank's
model chunks with the stage's trainable set, megatron DDP around them, the optimizer and the LR
schedule (:func:`build_stage`). The run (``pretrain.stage``), the planner's meta-device build
(``planner.meta_build``: the same call under ``torch.device("meta")``, without the optimizer), and
the benchmarks call it, so what the planner sizes is what trains
(``tests/unit/planner/test_plan_build.py`` compares the two, parameter by parameter and buffer by
buffer). Builds of the model alone (config validation's shapes, the HF tool) use the provider's
``build_model_chunks``, which this calls."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from model_providers.glm5.model import provider
from model_providers.glm5.model.config import to_transformer_config


@dataclass
class StageBuild:
    tcfg: object  #: megatron's MLATransformerConfig
    chunks: list  #: this rank's model chunks (one per virtual pipeline stage)
    ddp: list  #: megatron DistributedDataParallel around each chunk
    optimizer: object = None  #: megatron's (distributed) optimizer; None when not built
    scheduler: object = None  #: the LR schedule over the stage's steps; None when not built


def build_stage(rc, backend: str = "local", trainable: Sequence[str] = (), steps: Optional[int] = None,
                load_weights: Optional[Callable[[list], None]] = None, tcfg=None,
                optimizer: bool = True) -> StageBuild:
    """Build ``rc`` (one stage's resolved run config) for this rank: ``trainable`` narrows the DSA
    mode's trainable set (regexes over parameter names), ``load_weights(chunks)`` runs before DDP
    and the optimizer copy the parameters, ``steps`` is the schedule's length. ``tcfg``: another
    transformer config (the planner's meta build turns off initialisation and grouped GEMM);
    ``optimizer=False`` stops after DDP."""
    from pretrain.optim import build_optimizer, build_scheduler

    tcfg = tcfg or to_transformer_config(rc.model, rc.parallel, rc.precision)
    chunks = provider.build_model_chunks(rc.model, tcfg, backend)
    restrict_trainable(chunks, list(trainable or ()))
    if load_weights is not None:
        load_weights(chunks)
    ddp = wrap_ddp(tcfg, chunks, rc.parallel)
    if not optimizer:
        return StageBuild(tcfg, chunks, ddp)
    opt = build_optimizer(ddp, rc.optimizer, rc.precision.dtype, rc.parallel.distributed_optimizer)
    return StageBuild(tcfg, chunks, ddp, opt, build_scheduler(opt, rc.optimizer, rc.scheduler, steps))


def restrict_trainable(model_chunks, patterns: list[str]) -> None:
    """Freeze every parameter whose name matches none of ``patterns`` (on top of what the DSA
    mode already froze). Call before DDP wrapping so frozen ones get no grad buffers."""
    if not patterns:
        return
    compiled = [re.compile(p) for p in patterns]
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not any(c.search(name) for c in compiled):
                param.requires_grad = False


def wrap_ddp(tcfg, chunks, par) -> list:
    """megatron DDP around each model chunk as every stage trains it: fp32 gradient buffers, the
    distributed optimizer's padded param buffers when ``par.distributed_optimizer`` (the planner
    sizes these same wrappers on the meta device: ``planner.meta_build``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from parallel.features import ddp_kwargs

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=par.distributed_optimizer, **ddp_kwargs(par))
    return [DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)]
