"""Plan a run before launch: memory per rank position, FLOPs, step time and GPU-hours of every
curriculum stage on a named cluster (``python -m planner``), computed without process
groups or allocation."""
