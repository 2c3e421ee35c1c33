"""megatron-core's global parallel state as one rank of a layout sees it, without process groups:
what a meta-device build of that rank (the planner's, ``planner.meta_build``) needs.

megatron-core 0.19.2 sizes a layer from the process group it is handed (``group.size()``, under
``torch.distributed.is_initialized()``), and reads those groups from ``parallel_state``'s private
module globals. :func:`rank_position` fills those globals with stand-in groups that only know their
size and this rank's index (:class:`SizedGroup`), gives ``torch.distributed`` a stand-in default
group when none exists, and makes ``torch.cuda.current_device()`` answer ``meta`` (megatron
allocates buffers with an explicit device). Everything is put back on exit, so models built later
in the same process see the state they would have seen. Without CUDA the project's CPU emulation
(``cpu_emulation``) is installed first, as for every CPU run: megatron's constructors create CUDA
streams.

(0.16.1 needed the embedding's TP attributes set here too: its init functions, which a meta build
skips, set them. 0.19's ``VocabParallelEmbedding`` sets them itself when initialisation is off.)
"""

from __future__ import annotations

import contextlib
import re
from typing import Optional

import torch

from parallel.megatron_compat.version import check_megatron_core

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


def _group_sizes(tp: int, pp: int, cp: int, dp: int, ep: int, expert_tp: int,
                 expert_dp: int) -> dict:
    """parallel_state's group globals (megatron-core 0.19.2's names) -> the size of this rank's
    group: ``dp`` the data-parallel size without CP, ``expert_dp`` the expert data-parallel size."""
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
        "_EXPERT_TENSOR_PARALLEL_GROUP": expert_tp,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ep * expert_tp,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ep * expert_tp * pp,
        "_EXPERT_DATA_PARALLEL_GROUP": expert_dp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": expert_dp,
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": 1,
        # 0.19's weight-rematerialising "GTP" axis, size 1 here: its data-parallel groups are the
        # plain ones (what initialize_model_parallel builds with gtp_remat_size=1)
        "_GTP_WEIGHT_REMAT_GROUP": 1,
        "_EXPERT_GTP_WEIGHT_REMAT_GROUP": 1,
        "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": dp,
        "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": dp * cp,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": dp * cp,
        "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": expert_dp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": expert_dp,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": ep * expert_tp * pp,
    }


@contextlib.contextmanager
def rank_position(*, tp: int, pp: int, cp: int, dp: int, ep: int, expert_tp: int, expert_dp: int,
                  world_size: int, vpp: Optional[int] = None, pp_rank: int = 0):
    """megatron's global parallel state as rank (tp 0, pp ``pp_rank``, ep 0, dp 0) of a layout
    with these sizes sees it, with no process group; all of it (and ``torch.distributed``'s
    default group and ``torch.cuda.current_device``) is restored on exit. ``vpp``: virtual
    pipeline stages per rank (None or 1: none)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed.distributed_c10d import GroupMember

    from parallel.megatron_compat import cpu_emulation

    check_megatron_core(__file__)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is not a pipeline rank of pp={pp}")
    cpu_emulation.install()  # no-op with CUDA; CPU runs install it too
    saved = {k: v for k, v in vars(ps).items() if _STATE_NAME.match(k)}
    had_world = dist.is_initialized()
    current_device = torch.cuda.current_device
    try:
        for name, value in saved.items():
            groupish = name.endswith(("_GROUP", "_GROUPS", "_GLOO", "_RANKS", "_BUFFER"))
            if groupish and not isinstance(value, dict):
                setattr(ps, name, None)  # embedding groups stay None: untied, nothing to all-reduce
        sizes = _group_sizes(tp, pp, cp, dp, ep, expert_tp, expert_dp)
        for name, size in sizes.items():
            setattr(ps, name, SizedGroup(size, pp_rank if name == "_PIPELINE_MODEL_PARALLEL_GROUP" else 0))
        ps.set_tensor_model_parallel_world_size(tp)
        ps.set_tensor_model_parallel_rank(0)
        ps.set_pipeline_model_parallel_world_size(pp)
        ps.set_pipeline_model_parallel_rank(pp_rank)
        ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp and vpp > 1 else None)
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
        ps.set_expert_model_parallel_world_size(ep)
        ps.set_expert_model_parallel_rank(0)
        ps.set_expert_tensor_parallel_world_size(expert_tp)
        ps.set_expert_tensor_parallel_rank(0)
        ps._MPU_DATA_PARALLEL_WORLD_SIZE = dp
        ps._MPU_DATA_PARALLEL_RANK = 0
        if not had_world:
            GroupMember.WORLD = SizedGroup(world_size)
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
