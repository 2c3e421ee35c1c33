"""The planner: FLOPs, memory, activations, step time, CLI."""
