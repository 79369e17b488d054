"""Benchmarks behind `tandem bench`."""
