"""Optimizer and LR schedule: megatron-core's optimizer wrappers with Adam or Muon (+ Muon Split)
and megatron's OptimizerParamScheduler."""

from pretrain.optim.build import build_optimizer
from pretrain.optim.schedule import build_scheduler, check_schedule

__all__ = ["build_optimizer", "build_scheduler", "check_schedule"]
