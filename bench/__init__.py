"""Tollgate benchmarks: every figure is a ratio against a baseline run in the same session."""
