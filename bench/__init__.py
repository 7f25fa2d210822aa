"""Benchmarks: each module prints a table; results go to docs/benchmarks.md."""
