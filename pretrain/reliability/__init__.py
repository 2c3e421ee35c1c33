"""What keeps a long run alive: preemption and non-finite-step policy, one live run per run dir."""
