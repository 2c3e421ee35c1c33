"""A run's console, metrics file, faults policy and run lock."""
