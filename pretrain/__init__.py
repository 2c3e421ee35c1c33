"""The run: ``python -m pretrain.train``.

- ``train.py`` (entry), ``curriculum.py`` (stages from the config), ``run_context.py`` (what
  every stage shares), ``stage.py`` (one stage: data, then its build), ``stage_build.py`` (model,
  DDP, optimizer: the one build path), ``stage_loop.py`` (the stage's step loop, saves,
  evaluation), ``step.py`` (one training step through megatron's schedules);
- ``config/``: schema, the command line, overrides, validation before compute, changes on resume;
- ``optim/``: Adam and Muon Split through megatron's optimizer, LR schedules;
- ``reporting/``: console, logs, metrics.jsonl / W&B, plots, memory per rank;
- ``reliability/``: preemption and non-finite steps, the run-dir lock.
Checkpoints are :mod:`checkpointing`; the offline planner is :mod:`planner`.
"""
