"""Benchmarks: stand-alone scripts that start their own services and print tables; not part of the test suite."""
