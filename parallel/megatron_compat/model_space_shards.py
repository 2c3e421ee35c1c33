"""A distributed optimizer's state in model space, every rank saving and loading only its own
share: the format of a stage's final checkpoint where the next stage changes the model-parallel
layout.

megatron-core 0.19.2's ``DistributedOptimizer`` has two formats that load into another layout:

- ``fully_reshardable``: to save, every data-parallel rank all-gathers the whole optimizer state
  of its model shard into host memory (GLM-5 on 512 H200s: about 120 GiB per rank);
- ``fully_sharded_model_space``: each rank maps its flat shard onto the model parameters through
  ``ShardedTensor.flattened_range``, which ``ShardedTensor`` no longer accepts (0.16.1, 0.19.2)
  ("flattened_range is not supported").

This is the second one without flattened ranges. A rank's shard of a parameter is a contiguous
range of the parameter's local (tensor/expert-parallel) tensor in row-major order. It is cut into
boxes (:func:`boxes`: at most ``2 * ndim - 1``), each itself a contiguous range of that order, so
each box is a view of the shard and a plain ``ShardedTensor`` of the parameter's global tensor
with no sharding grid (``axis_fragmentations=None``). megatron 0.19.2 hands such uneven shards to
torch's distributed checkpoint, which stores any chunks and reads any region of them. The keys
are the ones ``fully_reshardable`` uses (``optimizer.state.<state>.<parameter key>``, ``fp32_param``
for the main parameter). A load asks for the boxes of the new layout's shards, and DCP reads
the overlaps. No gather, no exchange, no host copy besides the writer's staging. The boxes a
load returns are joined back into each parameter's flat shard (:func:`joined`) and handed to
megatron's own loader of this structure (``load_parameter_state_from_fs_model_space``, chosen by
``param_state_sharding_type``).

A parameter whose sharded state is built by a factory (the SwiGLU ``linear_fc1``: two halves,
``w`` and ``v``) is cut per piece the factory makes, each a contiguous part of the local tensor. A
factory whose pieces are not contiguous (megatron's legacy ``GroupedMLP``, transposed) is
refused by name: the project builds ``SequentialMLP`` (CPU) or ``TEGroupedMLP`` (GPU).
"""

from __future__ import annotations

import dataclasses

import torch

from parallel.megatron_compat.version import check_megatron_core

FORMAT = "model_space_shards"  #: this format's name in a checkpoint's common state
#: the ``param_state_sharding_type`` whose loader megatron-core 0.19.2 still has for this structure
MEGATRON_SHARDING_TYPE = "fully_sharded_model_space"
PREFIX = "optimizer.state"


def boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple, int, int]]:
    """Flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes ``(offset, box_shape,
    flat_lo, flat_hi)`` in order; each box is a contiguous range of the flat order."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (hi - lo,) if shape else (), lo, hi)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def in_row(r: int, a: int, b: int) -> list:
        return [((r, *off), (1, *sh), r * inner + fa, r * inner + fb) for off, sh, fa, fb in boxes(shape[1:], a, b)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner, r1 * inner))
    if c1:
        out += in_row(r1, 0, c1)
    return out


def _pieces(sharded, param: torch.nn.Parameter) -> list[tuple[object, int]]:
    """(ShardedTensor, flat offset in the local parameter) of what the model's sharded state
    writes for ``param``: the tensor itself, or each piece its factory builds."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(sharded, ShardedTensor):
        return [(sharded, 0)]
    probe = torch.empty(param.shape, dtype=param.dtype, device="meta")
    out = []
    for piece in nested_values(dataclasses.replace(sharded, data=probe).build()):
        if not piece.data.is_contiguous():
            raise NotImplementedError(
                f"{sharded.key}: its checkpoint factory builds a non-contiguous view of the parameter, "
                f"which the per-rank model-space optimizer format cannot cut into boxes")
        out.append((piece, piece.data.storage_offset()))
    return out


def _shard_tensors(sharded, param, state: dict, lo: int, hi: int) -> dict:
    """The ``ShardedTensor`` boxes of this rank's shard ``[lo, hi)`` of ``param``, per state key."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {k: [] for k in state}
    for piece, start in _pieces(sharded, param):
        a, b = max(lo, start), min(hi, start + piece.data.numel())
        if len(piece.replica_id) != 3:
            raise ValueError(f"{piece.key}: replica_id {piece.replica_id} is not (PP, TP, DP)")
        replica_id = (*piece.replica_id[:2], 0)  # the DP ranks hold disjoint shards
        p = piece.prepend_axis_num  # folded into the box (megatron's uneven shards do not prepend)
        for offset, shape, fa, fb in boxes(piece.local_shape, a - start, b - start):
            global_offset = (*piece.global_offset[:p], *(g + o for g, o in zip(piece.global_offset[p:], offset)))
            shape = (1,) * p + tuple(shape)
            for k, t in state.items():
                data = t[start + fa - lo:start + fb - lo].view(shape)
                out[k].append(ShardedTensor(f"{PREFIX}.{k}.{piece.key}", data, data.dtype, shape,
                                            piece.global_shape, global_offset, None, replica_id))
    return out


def _param_state(wrapper, model_sharded: dict, is_loading: bool) -> dict:
    """One ``DistributedOptimizer``'s sharded state in this format (its non-parameter state as
    megatron keeps it for its reshardable formats, plus ``param_state``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.optimizer import distrib_optimizer

    if is_loading:  # allocate the state the load copies into, as megatron's sharded_state_dict does
        if not distrib_optimizer.HAVE_APEX_OR_TE and not wrapper.optimizer.state:
            wrapper._init_optimizer_states_with_dummy_values()
        wrapper.load_state_dict(wrapper.state_dict())
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded)
    sharded_of = {sh.data: sh for sh in nested_values(tensors)}
    param_state, i = {}, 0
    for gbuf_range_maps in wrapper.gbuf_ranges:  # megatron's order (its fs_model_space loader's)
        for maps in gbuf_range_maps.values():
            for gbuf_range_map in maps:
                for param, ranges in gbuf_range_map["param_map"].items():
                    state = dict(wrapper._get_main_param_and_optimizer_states(param))
                    state["fp32_param"] = state.pop("param")
                    state.pop("step", None)  # restored from the param groups
                    rng = ranges["param"]
                    param_state[i] = _shard_tensors(sharded_of[param], param, state, rng.start, rng.end)
                    i += 1
    sd = wrapper.state_dict()
    sd["param_state"] = param_state
    sd["param_state_sharding_type"] = MEGATRON_SHARDING_TYPE
    return sd


def sharded_state_dict(optimizer, model_sharded: dict, is_loading: bool = False, metadata: dict | None = None):
    """megatron's (possibly chained) optimizer's sharded state dict, its distributed optimizers
    in this format (other wrappers keep their own model-space state dicts)."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    check_megatron_core(__file__)
    chained = getattr(optimizer, "chained_optimizers", None)
    wrappers = list(chained or [optimizer])
    if chained is not None and len(wrappers) > 1:
        optimizer._synchronize_steps()
    states = []
    for w in wrappers:
        if isinstance(w, DistributedOptimizer):
            states.append(_param_state(w, model_sharded, is_loading))
        else:
            states.append(w.sharded_state_dict(model_sharded, is_loading, metadata=metadata))
    if len(wrappers) == 1:
        return states[0]
    for i, sd in enumerate(states):  # as megatron's ChainedOptimizer names them
        add_prefix_for_sharding(sd, f"chained_{i}.")
    return dict(enumerate(states))


def joined(loaded_optimizer_state):
    """A loaded state dict of :func:`sharded_state_dict` as megatron's loader takes it: each
    parameter's boxes joined back into its flat shard (in place; returns it)."""
    states = loaded_optimizer_state
    if isinstance(states, dict) and "param_state_sharding_type" in states:
        parts = [states]
    else:  # a chained optimizer's: one per wrapper
        parts = list(states.values() if isinstance(states, dict) else states)
    for sd in parts:
        if not isinstance(sd, dict) or sd.get("param_state_sharding_type") != MEGATRON_SHARDING_TYPE:
            continue
        for i, state in sd["param_state"].items():
            sd["param_state"][i] = {k: torch.cat([t.reshape(-1) for t in ts]) for k, ts in state.items()}
    return states
