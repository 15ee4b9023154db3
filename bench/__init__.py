"""Benchmarks of the gateway: load generator, scenarios A-D, report (python -m bench)."""
