"""memlm.cluster: Ray. Sweeps (`memlm sweep`: sweep*.py, each trial the same training run as `memlm train`) and
memory extrapolation (`memlm extrapolate`: extrapolate*.py, one Ray task per run and memory length), on a local Ray
bound to loopback (ray_runtime.py) or an existing cluster. The only package that imports ray, and only inside
functions, so training never needs it (docs/design.md §1).
"""
