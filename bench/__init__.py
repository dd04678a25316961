"""Benchmarks and fuzzers that drive real isthmus processes (``python -m bench.<name>``)."""
