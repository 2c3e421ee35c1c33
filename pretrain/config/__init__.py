"""A run's configuration: the typed schema, command-line overrides, validation before compute, changes on resume."""
