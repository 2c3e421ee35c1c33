"""megatron-core's optimizer wrappers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``) as seen by an optimizer that takes the place of their inner torch
optimizer (Muon: ``pretrain.optim.build``).

megatron-core 0.19.2 chooses an optimizer per parameter group only on its emerging-optimizer path
(``ParamGroupOverride.optimizer``; its Muon groups go to ``LayerWiseDistributedOptimizer`` or the
non-distributed wrappers, never into a ``DistributedOptimizer``), and has no public way to put
another inner optimizer into a wrapper, nor to ask a wrapper which parameter it steps for which
model parameter or which part of a distributed buffer this rank owns: those are wrapper attributes
(``model_fp32_groups``, ``shard_fp32_groups``, ``float16_groups``..., ``buffers[].param_index_map``,
``_get_model_param_range_map``). They are read here only:

- :func:`main_params`: (model parameter, parameter the inner optimizer steps) pairs;
- :func:`is_distributed`, :func:`buffer_order`, :func:`owned_range`, :func:`data_parallel_group`,
  :func:`buffer_device`: the distributed optimizer's shards;
- :func:`replace_inner_optimizer`: swaps ``wrapper.optimizer`` keeping what megatron relies on.
"""

from __future__ import annotations

from parallel.megatron_compat.version import check_megatron_core


def wrappers(optimizer) -> list:
    """The wrappers of megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def main_params(wrapper) -> list:
    """(model parameter, parameter the inner optimizer steps) pairs of one megatron wrapper: the
    model parameter itself (fp32 training), its fp32 main copy (bf16/fp16), or this rank's fp32
    shard of it (distributed optimizer; only the parameters this rank owns part of)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    check_megatron_core(__file__)
    if isinstance(wrapper, DistributedOptimizer):
        groups = [(wrapper.model_fp32_groups, wrapper.shard_fp32_groups),
                  (wrapper.model_float16_groups, wrapper.shard_fp32_from_float16_groups)]
    elif isinstance(wrapper, Float16OptimizerWithFloat16Params):
        groups = [(wrapper.float16_groups, wrapper.fp32_from_float16_groups),
                  (wrapper.fp32_from_fp32_groups, wrapper.fp32_from_fp32_groups)]
    elif isinstance(wrapper, FP32Optimizer):
        groups = [([g["params"] for g in wrapper.optimizer.param_groups],) * 2]
    else:
        raise TypeError(f"no main parameters known for a {type(wrapper).__name__}")
    return [pair for models, mains in groups for gm, gs in zip(models, mains) for pair in zip(gm, gs)]


def is_distributed(wrapper) -> bool:
    """The wrapper is megatron's distributed optimizer: its inner optimizer steps shards."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(wrapper, DistributedOptimizer)


def buffer_order(wrapper) -> list:
    """The model parameters of a distributed optimizer's DDP buffers, in the buffers' order (the
    same on every data-parallel rank)."""
    return [p for buffer in wrapper.buffers for p in buffer.param_index_map]


def owned_range(wrapper, model_param) -> tuple[int, int]:
    """[start, end) of the flattened ``model_param`` that this rank's shard holds (a parameter
    :func:`main_params` pairs with a shard)."""
    r = wrapper._get_model_param_range_map(model_param)["param"]
    return r.start, r.end


def owned_ranges_of_every_rank(wrapper) -> list[dict]:
    """For each data-parallel rank (in the group's order), ``{model parameter: (start, end)}``: the
    part of the flattened parameter that rank's shard holds. megatron's own range computation
    (``DistributedOptimizer._build_model_gbuf_param_range_map``), applied to every rank's
    contiguous share of every bucket (megatron keeps only this rank's)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    check_megatron_core(__file__)
    size = wrapper.data_parallel_group.size()
    ranks: list[dict] = [{} for _ in range(size)]
    for buffer in wrapper.buffers:
        for bucket in buffer.buckets:
            numel = bucket.grad_data.numel()
            share = numel // size
            for r in range(size):
                world = Range(bucket.offset + r * share, bucket.offset + min(numel, (r + 1) * share))
                ranges = DistributedOptimizer._build_model_gbuf_param_range_map(
                    buffer.param_index_map, world, bucket.offset)
                ranks[r].update({p: (rr["param"].start, rr["param"].end) for p, rr in ranges.items()})
    return ranks


def data_parallel_group(wrapper):
    """The group whose ranks share a distributed optimizer's buffers."""
    return wrapper.data_parallel_group


def buffer_device(wrapper):
    """The device of a distributed optimizer's buffers: the parameters'
    (``torch.cuda.current_device()``)."""
    return wrapper.buffers[0].grad_data.device


def replace_inner_optimizer(wrapper, build):
    """Replace megatron's inner torch optimizer of ``wrapper`` by ``build(param_groups)``, which
    must step megatron's param groups themselves: the same group dicts in the same order, each
    with the same parameters in the same order (the wrapper indexes them:
    ``model_param_group_index_map``, the scheduler sets their LR, checkpoints save their state
    by position). A wrapper without an inner optimizer (no parameter on this rank) is left as it
    is (None is returned). Refused: groups megatron cannot tell apart when it loads a checkpoint
    (it matches groups by ``param_group_identifier_keys``), an inner optimizer that already has
    state, and a build that changed the groups."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    check_megatron_core(__file__)
    inner = wrapper.optimizer
    if inner is None:
        return None
    if inner.state:
        raise ValueError("the inner optimizer already has state: replacing it would drop it")
    groups = list(inner.param_groups)
    keys = [tuple(g.get(k) for k in param_group_identifier_keys) for g in groups]
    if len(set(keys)) != len(keys):
        raise ValueError(f"param groups megatron cannot tell apart on load: {keys} "
                         f"({', '.join(param_group_identifier_keys)})")
    params = [list(g["params"]) for g in groups]
    new = build(inner.param_groups)
    same = (len(new.param_groups) == len(groups)
            and all(a is b for a, b in zip(new.param_groups, groups))
            and all(len(g["params"]) == len(ps) and all(a is b for a, b in zip(g["params"], ps))
                    for g, ps in zip(new.param_groups, params)))
    if not same:
        raise ValueError(f"{type(new).__name__} must step megatron's param groups themselves (the "
                         "same group dicts and parameters, in order): the wrapper indexes them")
    wrapper.optimizer = new
    return new
