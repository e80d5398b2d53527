"""Benchmark harness for pallas_flex (not part of the installed package).

Run from the repository root: `PYTHONPATH=$PWD python3 -m benchmarks.run --help`.
"""
