"""Run ``pretrain.train`` with NaN losses at chosen steps, injected from outside the pipeline.

    python -m tests.support.nan_injection --nan-at-steps=2,5,6 [hydra overrides]

The training code has no fault hook: this launcher wraps ``pretrain.step.train_step`` and, during
the chosen steps, ``pretrain.step.lm_loss_func`` so that the per-token losses it receives are NaN.
The NaN then takes the real path: LM loss -> backward -> non-finite gradients -> skipped step and
the reload policy. The step number is taken from the data position (``consumed_samples`` /
global batch + 1), which keeps counting through skipped steps, reloads and resumes, so it is
right for one-stage runs (``curriculum=none``), the only kind the tests launch with it.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import runpy
import sys

import torch

FLAG = "--nan-at-steps="


def command(nan_steps: list[int], overrides: list[str]) -> list[str]:
    """The argv of a one-process run with these steps' losses NaN."""
    return [sys.executable, "-m", __name__, FLAG + ",".join(map(str, nan_steps)), *overrides]


def install(nan_steps: set[int]) -> None:
    from pretrain import step as one_step

    train_step, lm_loss_func = one_step.train_step, one_step.lm_loss_func

    def nan_loss(loss_mask, output_tensor):
        return lm_loss_func(loss_mask, output_tensor * torch.nan)

    def step_with_faults(ddp_chunks, optimizer, scheduler, dataset, consumed_samples, trainer_cfg,
                         *args, **kwargs):
        step = consumed_samples // trainer_cfg.global_batch_size + 1
        one_step.lm_loss_func = nan_loss if step in nan_steps else lm_loss_func
        try:
            return train_step(ddp_chunks, optimizer, scheduler, dataset, consumed_samples,
                              trainer_cfg, *args, **kwargs)
        finally:
            one_step.lm_loss_func = lm_loss_func

    one_step.train_step = step_with_faults


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].startswith(FLAG):
        raise SystemExit(f"usage: python -m {__name__} {FLAG}<step>[,<step>...] [hydra overrides]")
    steps = {int(s) for s in sys.argv[1][len(FLAG):].split(",")}
    del sys.argv[1]  # the rest is Hydra's
    install(steps)
    runpy.run_module("pretrain.train", run_name="__main__")


if __name__ == "__main__":
    main()
