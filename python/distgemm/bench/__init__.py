"""Benchmark suites: `python -m distgemm.bench`."""
