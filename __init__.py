"""Read only when Python imports this checkout's own folder as `memlm`: the folder is named memlm and Python
started in the folder above it (`python script.py` or `python -c` there puts that folder first on sys.path).

Without this file the folder was an empty namespace package that hid the installed memlm: `from memlm import
load_pretrained` failed with "cannot import name 'load_pretrained' from 'memlm' (unknown location)" (issue 32).
With it, the package is the one this checkout holds (memlm/ inside it), the same code an editable install runs.
Inside the checkout, and from anywhere else, `import memlm` finds memlm/ itself and never reads this file.

Under any other name it does nothing: pytest imports the folder holding tests/ as a package named after the clone
("main"), or, where that name is no identifier (a clone in ci-check/), as a plain module "__init__" without a
__path__; the test suite errored at every test's setup there.
"""

if __name__ == "memlm":
    from pathlib import Path as _Path

    _PACKAGE = _Path(__file__).resolve().parent / "memlm"
    __file__ = str(_PACKAGE / "__init__.py")
    __path__[:] = [str(_PACKAGE)]  # noqa: F821 - a package's own search path: memlm.cli is memlm/cli.py
    exec(compile(_PACKAGE.joinpath("__init__.py").read_text(encoding="utf-8"), __file__, "exec"))
