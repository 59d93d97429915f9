"""The shipped YAML presets, installed as the package `memlm.configs` so an installed memlm finds them too.

A preset's name is its path here without `.yaml`: `tiny/txl`, `paper/wt103/lamemo`, `sweeps/tiny_grid`.
paper/<dataset>/ holds the papers' settings (`<arch>[_<variant>]`), tiny/ the CPU presets (`<arch>`), reproduce/
the bench/reproduce scripts' configs (named after the script), sweeps/ the sweep spaces (named after their
`name:`). `memlm config --list` lists them; memlm.trainer.config.presets finds them. This file only makes the
folder a regular package: importlib.resources then gives its real path, which `inherit:` needs.
"""
