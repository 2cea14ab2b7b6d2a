"""Benchmarks of issue #7: scripts that print figures (`python -m benchmarks.<name> --help`), not tests."""
