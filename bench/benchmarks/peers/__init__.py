"""Adapters for the peer benchmark (bench/benchmarks/bench_peers.py): one `Runner` per model, all under one
training step.

Imported only from the benchmark environment (.bench-venv), where the peer libraries are installed; memlm itself
comes from the repository through sys.path.
"""

from .common import PRECISIONS, Runner, Shape, autocast, make_batches
from .hf_transfoxl import HFTransfoXL
from .labml_txl import LabmlTXL
from .lucidrains_rmt import LucidrainsRMT, LucidrainsRMTXL
from .memlm_models import MemlmLaMemo, MemlmRMT, MemlmRMTXL, MemlmTXL

# Table order: each memlm model followed by its peers.
RUNNERS: dict[str, type[Runner]] = {
    r.key: r
    for r in (MemlmTXL, HFTransfoXL, LabmlTXL, MemlmRMT, LucidrainsRMT, MemlmRMTXL, LucidrainsRMTXL, MemlmLaMemo)
}

__all__ = ["PRECISIONS", "RUNNERS", "Runner", "Shape", "autocast", "make_batches"]
