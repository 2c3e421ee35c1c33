"""One pipeline rank's model chunks and DDP buffers, built on the meta device without process groups.

The planner sizes a rank from the objects training builds, not from formulas: the project's
provider (``model_providers.glm5.model.provider.build_model_chunks``) builds the rank's chunks (every
virtual stage; embedding on the first, output layer and MTP on the last), the stage's trainable
set is applied (DSA mode, ``curriculum.stages[].trainable``), and megatron's own
``DistributedDataParallel`` (:func:`pretrain.stage.wrap_ddp`) lays out its gradient buffers,
with the distributed optimizer's padding. Every tensor is on ``meta``: nothing is allocated and
a 744B rank builds in well under a second.

megatron-core 0.16.1 sizes a layer from the process group it is handed (``group.size()``, under
``torch.distributed.is_initialized()``), so for the build megatron's ``parallel_state`` holds
stand-in groups that only know their size and this rank's index, ``torch.distributed`` gets a
stand-in default group when none exists, and ``torch.cuda.current_device()`` answers ``meta``
(megatron allocates buffers with an explicit device). Everything is put back on exit, so models
built later in the same process see the state they would have seen. Without CUDA the project's
CPU emulation (``parallel.megatron_compat.cpu_emulation``) is installed first, as for every
CPU run: megatron's constructors create CUDA streams.

The chunks use the local layer spec (no Transformer Engine: its layers allocate on the GPU even
under ``meta``) without grouped GEMM: the parameter set equals the Transformer Engine build's
(per-expert weights, norms fused into linears count the same); megatron's 64-element alignment
of each parameter in the distributed optimizer's buffers may then differ by < 64 elements per
parameter.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

_STATE_NAME = re.compile(r"^_[A-Z][A-Z0-9_]*$")  #: parallel_state's module-level state


class SizedGroup:
    """A process group as layer constructors see it: its size and this rank's index in it.
    ``rank`` can be moved to size a different member (the distributed optimizer's shards)."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = int(size), int(rank)

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"SizedGroup(size={self._size}, rank={self._rank})"


@dataclass
class MetaRank:
    """What one rank of pipeline rank ``pp_rank`` builds, on ``meta``."""

    pp_rank: int
    chunks: list  #: GLM5Model per virtual stage, in model order
    ddp: list  #: megatron DistributedDataParallel per chunk (its buffers: ``buffers`` dense,
    #: ``expert_parallel_buffers`` experts, each with ``data_parallel_group`` a SizedGroup)
    names: dict  #: parameter -> its name in its chunk
    dp: int  #: ranks sharing the dense buffers (distributed optimizer): dp * cp
    expert_dp: int  #: ranks sharing the expert buffers: world / (ep * etp * pp)


def _group_sizes(par, layout) -> dict:
    """parallel_state's group globals -> the size of this rank's group in the layout."""
    tp, pp, cp, ep, etp = par.tp, par.pp, par.cp, par.ep, par.expert_tp
    dp, edp = layout.dp, layout.expert_dp
    return {
        "_TENSOR_MODEL_PARALLEL_GROUP": tp,
        "_PIPELINE_MODEL_PARALLEL_GROUP": pp,
        "_MODEL_PARALLEL_GROUP": tp * pp,
        "_CONTEXT_PARALLEL_GROUP": cp,
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": tp * cp,
        "_DATA_PARALLEL_GROUP": dp,
        "_DATA_PARALLEL_GROUP_WITH_CP": dp * cp,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": dp * cp,
        "_TENSOR_AND_DATA_PARALLEL_GROUP": tp * dp,
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": tp * dp * cp,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": tp * dp * cp,
        "_EXPERT_MODEL_PARALLEL_GROUP": ep,
        "_EXPERT_TENSOR_PARALLEL_GROUP": etp,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ep * etp,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ep * etp * pp,
        "_EXPERT_DATA_PARALLEL_GROUP": edp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": edp,
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": 1,
    }


@contextlib.contextmanager
def rank_position(par, layout, pp_rank: int):
    """megatron's global parallel state as rank (tp 0, pp ``pp_rank``, ep 0, dp 0) of ``layout``
    sees it, with no process group; all of it (and ``torch.distributed``'s default group and
    ``torch.cuda.current_device``) is restored on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed.distributed_c10d import GroupMember

    from parallel.megatron_compat import cpu_emulation

    if not 0 <= pp_rank < par.pp:
        raise ValueError(f"pp_rank={pp_rank} is not a pipeline rank of parallel.pp={par.pp}")
    cpu_emulation.install()  # no-op with CUDA; CPU runs install it too
    saved = {k: v for k, v in vars(ps).items() if _STATE_NAME.match(k)}
    had_world = dist.is_initialized()
    current_device = torch.cuda.current_device
    try:
        for name, value in saved.items():
            groupish = name.endswith(("_GROUP", "_GROUPS", "_GLOO", "_RANKS", "_BUFFER"))
            if groupish and not isinstance(value, dict):
                setattr(ps, name, None)  # embedding groups stay None: untied, nothing to all-reduce
        for name, size in _group_sizes(par, layout).items():
            setattr(ps, name, SizedGroup(size, pp_rank if name == "_PIPELINE_MODEL_PARALLEL_GROUP" else 0))
        ps.set_tensor_model_parallel_world_size(par.tp)
        ps.set_tensor_model_parallel_rank(0)
        ps.set_pipeline_model_parallel_world_size(par.pp)
        ps.set_pipeline_model_parallel_rank(pp_rank)
        ps.set_virtual_pipeline_model_parallel_world_size(par.vpp if par.vpp and par.vpp > 1 else None)
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
        ps.set_expert_model_parallel_world_size(par.ep)
        ps.set_expert_model_parallel_rank(0)
        ps.set_expert_tensor_parallel_world_size(par.expert_tp)
        ps.set_expert_tensor_parallel_rank(0)
        ps._MPU_DATA_PARALLEL_WORLD_SIZE = layout.dp
        ps._MPU_DATA_PARALLEL_RANK = 0
        if not had_world:
            GroupMember.WORLD = SizedGroup(layout.world_size)
        torch.cuda.current_device = lambda: torch.device("meta")
        yield
    finally:
        torch.cuda.current_device = current_device
        if not had_world:
            GroupMember.WORLD = None
        for name in [k for k in vars(ps) if _STATE_NAME.match(k)]:
            if name not in saved:
                delattr(ps, name)
        for name, value in saved.items():
            setattr(ps, name, value)


def transformer_config(rc):
    """megatron's config of ``rc`` for a meta build: no init kernels, host-style allocation
    (follows the ``meta`` device), per-expert weights as Transformer Engine holds them."""
    from model_providers.glm5.model.config import to_transformer_config

    tcfg = to_transformer_config(rc.model, rc.parallel, rc.precision)
    tcfg.use_cpu_initialization, tcfg.perform_initialization = True, False
    tcfg.moe_grouped_gemm = False
    return tcfg


def build_rank(rc, layout, pp_rank: int, trainable: Optional[Sequence[str]] = ()) -> MetaRank:
    """Chunks and DDP wrappers of pipeline rank ``pp_rank`` of ``rc`` (one stage's resolved run
    config) at ``layout`` (``parallel.config.check_layout``), trainable as the stage trains:
    the DSA mode's set, narrowed by the stage's ``trainable`` patterns."""
    from model_providers.glm5.model.provider import build_model_chunks
    from pretrain.stage import restrict_trainable, wrap_ddp

    tcfg = transformer_config(rc)
    with rank_position(rc.parallel, layout, pp_rank), torch.device("meta"):
        chunks = build_model_chunks(rc.model, tcfg, "local")
        _mark_vocab_parallel(chunks)
        restrict_trainable(chunks, list(trainable or ()))
        names = {p: n for c in chunks for n, p in c.named_parameters()}
        ddp = wrap_ddp(tcfg, chunks, rc.parallel)
    return MetaRank(pp_rank, chunks, ddp, names, dp=layout.dp * rc.parallel.cp,
                    expert_dp=layout.expert_dp)


def _mark_vocab_parallel(chunks) -> None:
    """megatron marks a ``VocabParallelEmbedding`` weight TP-split (dim 0) in its init functions,
    which a meta build skips; mark it as they would."""
    from megatron.core.tensor_parallel.layers import (VocabParallelEmbedding,
                                                      set_tensor_model_parallel_attributes)

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, VocabParallelEmbedding):
                set_tensor_model_parallel_attributes(module.weight, is_parallel=True, dim=0, stride=1)
