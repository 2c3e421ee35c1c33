"""Optimizer and LR schedule: megatron-core's optimizer wrappers and OptimizerParamScheduler."""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from pretrain.config import OptimizerConfig, SchedulerConfig

_STYLES = ("cosine", "wsd", "linear", "constant")


def check_schedule(sched: SchedulerConfig, opt: OptimizerConfig, steps: int) -> list[str]:
    """Problems with the optimizer / schedule config (empty when fine)."""
    p = []
    if opt.name != "adam":
        p.append(f"optimizer.name={opt.name!r}: only 'adam' exists")
    if sched.style not in _STYLES:
        p.append(f"scheduler.style={sched.style!r} must be one of {', '.join(_STYLES)}")
    if not 0 <= opt.min_lr <= opt.lr:
        p.append(f"optimizer.min_lr={opt.min_lr} must be in [0, optimizer.lr={opt.lr}]")
    if sched.warmup_steps < 0:
        p.append(f"scheduler.warmup_steps={sched.warmup_steps} must be >= 0")
    decay = sched.decay_steps or steps
    if sched.style != "constant" and steps > 0 and decay <= sched.warmup_steps:
        p.append(
            f"scheduler.decay_steps={decay} must exceed scheduler.warmup_steps={sched.warmup_steps}"
        )
    return p


def build_optimizer(model_chunks, opt: OptimizerConfig, precision_dtype: str, distributed: bool):
    cfg = MegatronOptimizerConfig(
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
    )
    return get_megatron_optimizer(cfg, model_chunks)


def build_scheduler(optimizer, opt: OptimizerConfig, sched: SchedulerConfig, steps: int):
    decay = sched.decay_steps or max(steps, sched.warmup_steps + 1)
    style = sched.style
    wsd_decay = None
    if style == "wsd":
        wsd_decay = sched.wsd_decay_steps or max(1, decay // 5)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=sched.init_lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=sched.warmup_steps,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        wsd_decay_steps=wsd_decay,
        lr_wsd_decay_style=sched.wsd_decay_style if style == "wsd" else None,
    )
