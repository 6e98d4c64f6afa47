"""Benchmark harness: gdsload against its baselines in one run (see harness.py, runners.py)."""
