"""The benchmarks: each `python bench/benchmarks/bench_NAME.py` writes bench/results/NAME_*.json (bench/README.md)."""
