"""memlm.bench: the benchmarks (benchmarks/) and the paper reproductions (reproduce/) of a checkout, importable as
memlm.bench.* wherever the checkout's memlm is (memlm/__init__.py maps the folders beside it; bench/common.py says
how a script runs). Never part of an installed wheel.
"""
