"""Configuration: schema, overrides, layouts, curricula, validation before compute, one-line errors."""
