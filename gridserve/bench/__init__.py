"""Benchmarks: `gridserve bench ...`."""
