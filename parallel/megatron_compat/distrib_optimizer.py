"""megatron-core's ``DistributedOptimizer`` around an inner torch optimizer that keeps a
per-parameter ``step`` tensor (torch's Adam/AdamW, and Muon Split, which keeps AdamW's state).

megatron steps torch's AdamW whenever neither Transformer Engine nor Apex is importable
(``distrib_optimizer.HAVE_APEX_OR_TE`` False) -- on GPUs as on CPUs -- but its checkpoint code is
written for their FusedAdam, which keeps the step in the param groups. Each patch below changes
one upstream method and is a no-op under FusedAdam (no ``step`` in the per-parameter state).
"""

from __future__ import annotations

import functools

import torch


def _placeholder_state_before_sharded_load() -> None:
    """``DistributedOptimizer.sharded_state_dict(is_loading=True)`` on a freshly built optimizer
    calls ``state_dict()``, which -- without TE/Apex -- asserts one common ``step`` among state
    tensors that do not exist yet. Give it placeholder state first (what Megatron-LM's own loader
    does); the load overwrites all of it. With TE/Apex megatron allocates the placeholders itself
    (``load_state_dict``), so nothing is done there: no extra optimizer step on a fresh model."""
    from megatron.core.optimizer import distrib_optimizer

    sharded_state_dict = distrib_optimizer.DistributedOptimizer.sharded_state_dict

    @functools.wraps(sharded_state_dict)
    def sharded_state_dict_with_state(self, model_sharded_state_dict=None, is_loading=False, *a, **k):
        if (is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and not self.is_stub_optimizer
                and not self.optimizer.state):
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, model_sharded_state_dict or {}, is_loading, *a, **k)

    distrib_optimizer.DistributedOptimizer.sharded_state_dict = sharded_state_dict_with_state


def _set_states_keeping_step() -> None:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every key of the
    parameter's optimizer state from the loaded tensors. ``load_state_dict`` has already
    restored ``step`` (from the param groups), and no loader carries a real one: the fully
    reshardable loader's tensors lack it (KeyError), the ``dp_reshardable`` loader's hold the
    step of the optimizer *before* the load (a placeholder), which would overwrite the restored
    step and run Adam's bias correction from the wrong step after every resume. Copy the other
    keys and keep the restored step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_keeping_step(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return set_states(self, model_param, tensors)
        tensors = {k: v for k, v in tensors.items() if k != "step"}
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_keeping_step


def _own_step_per_parameter_after_load() -> None:
    """``DistributedOptimizer.load_state_dict`` (without TE/Apex) restores the step as ONE tensor
    shared by every parameter's state; torch's AdamW increments each parameter's step in place,
    so after a resume the shared step advanced once per parameter per iteration and Adam's bias
    correction ran ahead. Give each parameter its own copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    load_state_dict = DistributedOptimizer.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps


def _dp_reshardable_load_without_grad() -> None:
    """``load_parameter_state_from_dp_reshardable`` (the loader of megatron's per-rank
    ``dp_reshardable`` optimizer format) copies into the main params without ``torch.no_grad``,
    unlike the other formats' loaders: the main params are leaves that require grad, so the
    in-place copy into their views raises ("a view of a leaf Variable that requires grad is being
    used in an in-place operation") and no checkpoint in that format could be resumed."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    load = DistributedOptimizer.load_parameter_state_from_dp_reshardable

    @functools.wraps(load)
    def load_dp_reshardable_without_grad(self, state_dict):
        with torch.no_grad():
            return load(self, state_dict)

    DistributedOptimizer.load_parameter_state_from_dp_reshardable = load_dp_reshardable_without_grad


def _dp_reshardable_padding_zeroed() -> None:
    """``sharded_param_state_dp_reshardable`` covers the gaps between parameters in each bucket
    with padding tensors made by ``torch.empty``: whatever memory held went into every
    checkpoint, so two saves of the same state differed (and a checkpoint's bytes leaked
    unrelated memory). The padding is zeroed here (fresh tensors, not training state)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    sharded = DistributedOptimizer.sharded_param_state_dp_reshardable

    @functools.wraps(sharded)
    def sharded_with_zero_padding(self, *args, **kwargs):
        state = sharded(self, *args, **kwargs)
        for gbuf_idx in range(len(self.gbuf_ranges)):
            for buckets in state[gbuf_idx].values():
                for bucket in buckets:
                    for piece in bucket:
                        padding = piece.get("padding")
                        if isinstance(padding, LocalNonpersistentObject) and padding.obj:
                            for v in piece.values():
                                if isinstance(v, ShardedTensor):
                                    v.data.zero_()
        return state

    DistributedOptimizer.sharded_param_state_dp_reshardable = sharded_with_zero_padding


#: what identified a saved parameter group up to megatron-core 0.16 (``param_group_identifier_keys``)
STRUCTURAL_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _param_groups_matched_by_structure() -> None:
    """megatron 0.19 identifies a saved parameter group by its schedule too (``max_lr``,
    ``min_lr``, ``start_wd``, ``end_wd``, ``optimizer``: ``param_group_identifier_keys``). A
    curriculum stage loads its predecessor's optimizer state under its own schedule, so no group
    matched ("Could not find parameter group with key ..."). The groups are matched on
    :data:`STRUCTURAL_GROUP_KEYS`, as 0.16 did; the stage's scheduler sets the schedule values
    from its first step, as before."""
    from megatron.core.optimizer import optimizer

    upstream = optimizer.MegatronOptimizer.__dict__["_filter_and_reorder_param_groups"].__func__
    if getattr(upstream, "_structural", False):
        return

    @functools.wraps(upstream)
    def filter_and_reorder_by_structure(current_groups, state_dict_groups):
        keys = optimizer.param_group_identifier_keys  # read by upstream at call time
        optimizer.param_group_identifier_keys = STRUCTURAL_GROUP_KEYS
        try:
            return upstream(current_groups, state_dict_groups)
        finally:
            optimizer.param_group_identifier_keys = keys

    filter_and_reorder_by_structure._structural = True
    optimizer.MegatronOptimizer._filter_and_reorder_param_groups = staticmethod(filter_and_reorder_by_structure)


def install() -> None:
    _param_groups_matched_by_structure()
    _dp_reshardable_padding_zeroed()
    _dp_reshardable_load_without_grad()
    _placeholder_state_before_sharded_load()
    _set_states_keeping_step()
    _own_step_per_parameter_after_load()
