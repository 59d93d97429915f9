"""`model.attention: triton` in every kind of layout the archs build (Transformer-XL's causal one, LaMemo's look-ahead
with more memory than segment, RMT's blocks with a cache, the Compressive Transformer's two memories, ARMT's memory
tokens): loss and every gradient equal to the einsum path in fp32, the kernels interpreted on the CPU. In a fresh
process (tests/support/triton_in_models.py), because Triton chooses interpreter or compiler at its first import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# `-m 'not slow'` leaves these out: Triton kernels in every arch, 23 s on 2 busy cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _check(device: str, env: dict) -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra installs it)")
    # The checkout itself too: where memlm is not installed (the GPU machines run from a copy of the checkout)
    paths = [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "triton_in_models.py"), device], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("worst gradient") == 5, done.stdout


def test_triton_attention_in_the_models_equals_the_einsum_path():
    _check("cpu", {"TRITON_INTERPRET": "1"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a GPU (gpu_run.sh: equal)")
def test_gpu_triton_attention_in_the_models_equals_the_einsum_path():
    _check("cuda", {"TRITON_INTERPRET": "0"})
