"""``build_optimizer``: megatron-core's optimizer (its param groups, mixed-precision and
distributed-optimizer wrappers, grad clipping, checkpoint formats) with Adam, or with Muon for
hidden matrices and Adam for the rest.

For Muon, megatron builds its usual wrappers with one extra param-group override for the Muon
matrices (their own max/min LR and weight decay, read by OptimizerParamScheduler); then each
wrapper's inner ``torch.optim.AdamW`` is replaced by a ``MuonAdamW`` over the very same groups,
told which of its parameters are which matrices (model params, fp32 main copies or distributed
shards). megatron-core's own Muon needs ``emerging-optimizers`` and refuses the distributed
optimizer; this path needs neither. What it reads of megatron's wrappers, and the replacement
itself, are ``parallel.megatron_compat.optimizer_wrappers``.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey

from parallel.megatron_compat import optimizer_wrappers
from pretrain.config.schema import OptimizerConfig
from pretrain.optim.matrices import muon_matrices
from pretrain.optim.muon_adamw import DPAssembly, MuonAdamW, MuonHyper, ShardPlacement

MUON_ATTR = "muon_matrix"  #: set on the model parameters Muon updates; megatron's ParamKey matches it


def megatron_config(opt: OptimizerConfig, precision_dtype: str, distributed: bool):
    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1,
        adam_beta2=opt.beta2,
        adam_eps=opt.eps,
        clip_grad=opt.clip_grad,
        bf16=precision_dtype == "bf16",
        params_dtype=torch.bfloat16 if precision_dtype == "bf16" else torch.float32,
        use_distributed_optimizer=distributed,
        **moment_dtypes(opt),
    )


MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  #: optimizer.exp_avg(_sq)_dtype values


def moment_dtypes(opt: OptimizerConfig) -> dict:
    """Adam's moments in bf16: megatron's precision-aware optimizer (TE's FusedAdam keeps them
    in that dtype, fp32 main params and grads unchanged)."""
    if opt.exp_avg_dtype == opt.exp_avg_sq_dtype == "fp32":
        return {}
    return dict(use_precision_aware_optimizer=True, exp_avg_dtype=MOMENT_DTYPES[opt.exp_avg_dtype],
                exp_avg_sq_dtype=MOMENT_DTYPES[opt.exp_avg_sq_dtype])


def build_optimizer(model_chunks, opt: OptimizerConfig, precision_dtype: str, distributed: bool):
    """megatron's (Chained) optimizer over the trainable parameters of ``model_chunks`` (DDP)."""
    cfg = megatron_config(opt, precision_dtype, distributed)
    if opt.name == "adam":
        return get_megatron_optimizer(cfg, model_chunks)
    specs = muon_matrices(model_chunks, opt.muon.split)
    for chunk in model_chunks:
        for p in chunk.parameters():
            setattr(p, MUON_ATTR, p in specs)
    optimizer = get_megatron_optimizer(cfg, model_chunks, config_overrides=_overrides(cfg, opt))
    m = opt.muon
    hyper = MuonHyper(momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
                      ns_dtype=m.ns_dtype, scale=m.scale)
    for wrapper in optimizer_wrappers.wrappers(optimizer):
        _adopt(wrapper, specs, hyper, opt)
    return optimizer


def _overrides(cfg, opt: OptimizerConfig) -> dict:
    """megatron's standard overrides (no weight decay on 1-D and bias parameters) plus the Muon
    groups' own schedule. ``is_decoupled_lr`` (one of the keys megatron matches groups by when it
    loads a checkpoint) marks them: their LR is decoupled from the main one, and without it a Muon
    group and Adam's default group would be indistinguishable on load."""
    m = opt.muon
    wd = opt.weight_decay if m.weight_decay is None else m.weight_decay
    overrides = get_standard_config_overrides(cfg)
    overrides[ParamKey(attr=MUON_ATTR)] = {
        "max_lr": opt.lr if m.lr is None else m.lr,
        "min_lr": opt.min_lr if m.min_lr is None else m.min_lr,
        "start_wd": wd,
        "end_wd": wd,
        "is_decoupled_lr": True,
        "muon": True,
    }
    return overrides


def _assembly(wrapper, specs: dict, main_of: dict) -> DPAssembly:
    """The DP assembly of the wrapper's Muon matrices: one after the other, in megatron's buffer
    order (the same on every DP rank); every rank's owned runs of them, and where each of this
    rank's shards sits."""
    offsets, numel = {}, 0
    for model_param in optimizer_wrappers.buffer_order(wrapper):
        if model_param in specs:
            offsets[model_param] = numel
            numel += model_param.numel()
    segments = [[(offsets[p] + start, end - start) for p, (start, end) in ranges.items() if p in offsets]
                for ranges in optimizer_wrappers.owned_ranges_of_every_rank(wrapper)]
    placements = {main: ShardPlacement(offsets[model_param], model_param.numel(),
                                       *optimizer_wrappers.owned_range(wrapper, model_param))
                  for model_param, main in main_of.items()}
    group = optimizer_wrappers.data_parallel_group(wrapper)
    return DPAssembly(group, group.rank(), segments, placements, optimizer_wrappers.buffer_device(wrapper))


def _adopt(wrapper, specs: dict, hyper: MuonHyper, opt: OptimizerConfig) -> None:
    """The wrapper's inner AdamW becomes a MuonAdamW over the same groups, told which of the
    parameters it steps are which Muon matrices."""

    def muon_adamw(param_groups):
        main_of = {model: main for model, main in optimizer_wrappers.main_params(wrapper)
                   if model in specs}
        distributed = optimizer_wrappers.is_distributed(wrapper)
        return MuonAdamW(
            param_groups,
            matrices={main: specs[model] for model, main in main_of.items()},
            hyper=hyper,
            assembly=_assembly(wrapper, specs, main_of) if distributed else None,
            lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay,
        )

    optimizer_wrappers.replace_inner_optimizer(wrapper, muon_adamw)
