"""memlm: training and evaluation of segment-recurrent memory language models.

One namespace for the repository's top-level folders: `memlm.models` (models/), `memlm.data_pipeline`
(data_pipeline/), `memlm.trainer` (trainer/), `memlm.cluster` (cluster/), `memlm.configs` (configs/, the YAML
presets), and this folder for the command line.
An install maps each folder there (pyproject.toml's package-dir), so their generic names never clash with another
project's. Run from a source checkout without installing (`PYTHONPATH=.`, as on the GPU machines), the folders
beside this one are found the same way. In a checkout (not in a wheel) `memlm.bench` is bench/ too: the benchmarks
and reproductions import each other through it, not through sys.path (bench/common.py).
"""

from pathlib import Path as _Path

_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "trainer" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's own search path


def __getattr__(name: str):
    """`from memlm import load_pretrained`: loaded on first use, so `import memlm` (and `memlm --help`) stays free of
    torch."""
    if name == "load_pretrained":
        from memlm.trainer.checkpoint.run_loader import load_pretrained  # keeps `import memlm` torch-free

        return load_pretrained
    raise AttributeError(f"module 'memlm' has no attribute {name!r}")
