"""What the benchmarks run in the peers venv (`make peers`), where tandem is not installed:
these files import only the standard library and each other."""
