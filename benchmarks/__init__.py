"""Benchmarks (benchmarks/README.md): scripts that print figures (`python -m benchmarks.<name> --help`), not tests."""
