"""Benchmarks: scripts that print tables of medians and ratios (``python -m loadtests.bench.<name>``)."""
