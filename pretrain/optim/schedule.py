"""LR schedule (megatron-core's OptimizerParamScheduler) and the optimizer/schedule config checks
(these without importing megatron-core: validation runs before it is imported)."""

from __future__ import annotations

import math

from pretrain.config.schema import OptimizerConfig, SchedulerConfig
from pretrain.optim.newton_schulz import NS_DTYPES, SCALES

_STYLES = ("cosine", "wsd", "linear", "constant")
_OPTIMIZERS = ("adam", "muon")


def non_finite(values: dict) -> list[str]:
    """A problem for each NaN / inf among ``values`` (field name -> value; None is skipped): a
    range check on such a value would blame its neighbour (``min_lr <= nan`` is false)."""
    return [f"{name}={v} must be a finite number" for name, v in values.items()
            if v is not None and not math.isfinite(v)]


def check_muon(opt: OptimizerConfig) -> list[str]:
    """Problems with optimizer.muon (only looked at when optimizer.name=muon)."""
    from pretrain.optim.matrices import SPLITS  # megatron-core: imported for Muon runs only

    m = opt.muon
    p = []
    if m.split not in SPLITS:
        p.append(f"optimizer.muon.split={m.split!r} must be one of {', '.join(SPLITS)}")
    if m.ns_dtype not in NS_DTYPES:
        p.append(f"optimizer.muon.ns_dtype={m.ns_dtype!r} must be one of {', '.join(NS_DTYPES)}")
    if m.scale not in SCALES:
        p.append(f"optimizer.muon.scale={m.scale!r} must be one of {', '.join(SCALES)}")
    if not 0 <= m.momentum < 1:
        p.append(f"optimizer.muon.momentum={m.momentum} must be in [0, 1)")
    if not 1 <= m.ns_steps < 100:
        p.append(f"optimizer.muon.ns_steps={m.ns_steps} must be in [1, 99]")
    own = non_finite({"optimizer.muon.lr": m.lr, "optimizer.muon.min_lr": m.min_lr})
    p += own
    lr = opt.lr if m.lr is None else m.lr
    min_lr = opt.min_lr if m.min_lr is None else m.min_lr
    if not own and math.isfinite(lr) and math.isfinite(min_lr) and not 0 <= min_lr <= lr:
        p.append(f"optimizer.muon.min_lr={min_lr} must be in [0, optimizer.muon.lr={lr}]")
    if m.weight_decay is not None and m.weight_decay < 0:
        p.append(f"optimizer.muon.weight_decay={m.weight_decay} must be >= 0")
    return p


def check_schedule(sched: SchedulerConfig, opt: OptimizerConfig, steps: int) -> list[str]:
    """Problems with the optimizer / schedule config (empty when fine)."""
    p = []
    if opt.name not in _OPTIMIZERS:
        p.append(f"optimizer.name={opt.name!r} must be one of {', '.join(_OPTIMIZERS)}")
    elif opt.name == "muon":
        p += check_muon(opt)
    if sched.style not in _STYLES:
        p.append(f"scheduler.style={sched.style!r} must be one of {', '.join(_STYLES)}")
    lrs = non_finite({"optimizer.lr": opt.lr, "optimizer.min_lr": opt.min_lr,
                      "scheduler.init_lr": sched.init_lr})
    p += lrs
    if not lrs and not 0 <= opt.min_lr <= opt.lr:
        p.append(f"optimizer.min_lr={opt.min_lr} must be in [0, optimizer.lr={opt.lr}]")
    if sched.warmup_steps < 0:
        p.append(f"scheduler.warmup_steps={sched.warmup_steps} must be >= 0")
    decay = sched.decay_steps or steps
    if steps > 0 and decay <= sched.warmup_steps:  # megatron asserts it for every style
        p.append(
            f"scheduler.decay_steps={decay} must exceed scheduler.warmup_steps={sched.warmup_steps}"
        )
    return p


def build_scheduler(optimizer, opt: OptimizerConfig, sched: SchedulerConfig, steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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


def check_moments(opt: OptimizerConfig, distributed: bool) -> list[str]:
    """megatron-core 0.19.2's conditions on the moments' dtypes (the same as 0.16.1's)."""
    p = [f"optimizer.{name}={getattr(opt, name)!r} must be fp32 or bf16"
         for name in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(opt, name) not in ("fp32", "bf16")]
    if p or opt.exp_avg_dtype == opt.exp_avg_sq_dtype == "fp32":
        return p
    if opt.name != "adam":
        p.append(f"optimizer.exp_avg_dtype={opt.exp_avg_dtype} / exp_avg_sq_dtype={opt.exp_avg_sq_dtype} "
                 f"(megatron's precision-aware optimizer) needs optimizer.name=adam, got {opt.name}")
    if not distributed:
        p.append(f"optimizer.exp_avg_dtype={opt.exp_avg_dtype} / exp_avg_sq_dtype={opt.exp_avg_sq_dtype} "
                 "(megatron's precision-aware optimizer) needs parallel.distributed_optimizer=true")
    return p
