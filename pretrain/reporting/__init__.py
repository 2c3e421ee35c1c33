"""What a run reports: console lines, logs, metrics.jsonl and W&B, plots, memory per rank."""
