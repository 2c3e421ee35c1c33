"""The run: ``python -m pretrain.train``.

- ``train.py`` (entry), ``curriculum.py`` (stages from the config), ``stage.py`` (one stage's
  build and budget), ``loop.py`` (steps through megatron's schedules);
- ``config/``: schema, the command line, overrides, validation before compute, changes on resume;
- ``optim/``: Adam and Muon Split through megatron's optimizer, LR schedules;
- ``reporting/``: console, logs, metrics.jsonl / W&B, plots, memory per rank;
- ``reliability/``: preemption and non-finite steps, the run-dir lock.
Checkpoints are :mod:`checkpointing`; the offline planner is :mod:`planner`.
"""
