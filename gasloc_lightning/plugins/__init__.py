"""Plugins a strategy holds: the per-rank checkpoint format."""
