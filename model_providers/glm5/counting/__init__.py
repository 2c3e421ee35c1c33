"""Counting a GLM-5 config without building it: parameters and training FLOPs per token."""
