"""Muon Split."""
