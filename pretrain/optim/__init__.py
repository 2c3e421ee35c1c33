"""Optimizer and LR schedule: megatron-core's optimizer wrappers with Adam or Muon (+ Muon Split)
and megatron's OptimizerParamScheduler."""

from pretrain.optim.schedule import build_scheduler, check_moments, check_schedule

__all__ = ["build_optimizer", "build_scheduler", "check_moments", "check_schedule"]


def __getattr__(name: str):
    """``build_optimizer`` on first use: config validation (``check_schedule``) runs before
    megatron-core is imported, so bad input is refused in seconds."""
    if name == "build_optimizer":
        from pretrain.optim.build import build_optimizer

        return build_optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
