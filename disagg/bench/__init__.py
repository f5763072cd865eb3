"""Benchmarks: each prints figures measured side by side in one run. `python -m disagg.bench --help`."""
