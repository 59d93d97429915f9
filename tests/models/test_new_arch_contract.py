"""The measure of the arch contract (issue 36 item 1): a new arch is its module, one registry entry, its reference
test and its preset, and nothing else needs an edit to be built, validated, counted, decoded and held to the
contract and the memory protocol.

A throwaway arch is written to a temporary folder as those four files only: a Transformer-XL whose layers all read
one cache of the last M layer-0 inputs (its own memory state, forward, FLOPs and decoder), its registry entry
(registered by a pytest plugin, the test's seam for the line registry.py would hold), its reference test (with one
layer it is Transformer-XL), and its tiny preset. pytest then runs, with the repository as it is, the arch's
reference test and the tests that run every registered arch, selected to the new one: each of them must pick it
up and pass. The trainer's tests also run every registered arch, by its configs/tiny preset (support.training):
too slow to run here, and a preset outside configs/ is not theirs to find; the preset is loaded and validated.
Cost: one pytest process, about 20 s on 2 busy cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "shared_cache_xl"

MODULE = '''
"""Transformer-XL with one cache for every layer (a test's throwaway arch): each layer attends to the last M
layer-0 inputs (token embeddings after dropout) and the segment, instead of its own layer inputs.

Shape legend: B lanes, N segment length, M memory length, D model width."""

from dataclasses import dataclass

import torch
from torch import Tensor

from memlm.models.attention import causal_index, relative_encodings
from memlm.models.backbone import Backbone, LayerInputs
from memlm.models.mask_layout import causal_layout
from memlm.models.output import ModelOutput, cut, map_memory
from memlm.models.txl import TXLDecoder, last_rows, reset_valid, roll_valid
from memlm.models.txl import layer_flops as txl_layer_flops


@dataclass
class SharedCacheMemory:
    embed: Tensor  # [B, M, D] the last M layer-0 inputs
    valid: Tensor  # [B, M] bool

    @property
    def key_valid(self) -> Tensor:
        return self.valid

    def detached(self) -> "SharedCacheMemory":
        return map_memory(torch.Tensor.detach, self)


class SharedCacheXL(Backbone):
    def init_memory(self, batch_size, device="cpu", dtype=torch.float32):
        M, D = self.cfg.mem_len, self.cfg.d_model
        return SharedCacheMemory(torch.zeros(batch_size, M, D, device=device, dtype=dtype),
                                 torch.zeros(batch_size, M, dtype=torch.bool, device=device))

    def forward(self, tokens, memory, reset=None, targets=None, return_logits=False, tail_plan=None):
        cfg = self.cfg
        N, M = tokens.shape[1], cfg.mem_len
        valid = reset_valid(memory.valid, reset)
        h = self.embed_tokens(tokens)  # [B, N, D]
        cached = memory.embed.to(h.dtype)
        new_embed = cut(last_rows(cached, h, M))
        layout = causal_layout(N, M, valid, cfg.same_length)
        r = self.drop(relative_encodings(torch.arange(M + N, device=tokens.device), cfg.d_model, cfg.clamp_len,
                                         h.dtype))
        learned = self.learned.fetch()
        inputs = LayerInputs(r, causal_index(N, M, tokens.device), layout.allowed, self.kernel_mask(layout),
                             layout.offset, learned["bias_u"], learned["bias_v"], "causal")
        for l in range(cfg.n_layer):
            h = self.run_layer(l, h, cached, inputs)
        nll, logits = self.predict(h, targets, return_logits, tail_plan)
        return ModelOutput(nll=nll, logits=logits,
                           memory=SharedCacheMemory(new_embed, roll_valid(valid, N, M)))


def layer_flops(cfg, batch_size):
    """Transformer-XL's: every layer projects the keys and values of its M cached rows, here the same rows."""
    return txl_layer_flops(cfg, batch_size)


class SharedCacheDecoder(TXLDecoder):
    def cached_rows(self, memory, l):
        return memory.embed
'''

ENTRY = f'''
"""The one registry entry, registered when pytest loads this plugin (before it collects any test)."""

from memlm.models.registry import ARCHITECTURES, ArchSpec

ENTRY = ArchSpec("{NAME}", "Transformer-XL whose layers all read one cache of layer-0 inputs (a test's arch)",
                 model="{NAME}:SharedCacheXL", mem_len="positive", layer_flops="{NAME}:layer_flops",
                 decoder="{NAME}:SharedCacheDecoder")
ARCHITECTURES[ENTRY.name] = ENTRY
'''

REFERENCE_TEST = f'''
"""Reference: with one layer, the one cache of layer-0 inputs is Transformer-XL's own cache."""

from pathlib import Path

import torch

from memlm.models import ModelConfig, build_model
from memlm.trainer.config.run_config import load_config


def test_one_layer_is_transformer_xl():
    torch.manual_seed(0)
    cfg = dict(n_layer=1, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=50, tgt_len=8, mem_len=6)
    model = build_model(ModelConfig(arch="{NAME}", **cfg)).eval()
    txl = build_model(ModelConfig(arch="txl", **cfg)).eval()
    txl.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 50, (2, 24))
    memory, txl_memory = model.init_memory(2), txl.init_memory(2)
    with torch.no_grad():
        for s in range(3):
            reset = torch.tensor([s == 2, False])
            out = model(tokens[:, 8 * s : 8 * s + 8], memory, reset=reset, return_logits=True)
            want = txl(tokens[:, 8 * s : 8 * s + 8], txl_memory, reset=reset, return_logits=True)
            torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=1e-6)
            memory, txl_memory = out.memory, want.memory


def test_its_preset_loads():
    cfg = load_config(Path(__file__).with_name("configs") / "tiny" / "{NAME}.yaml")
    assert cfg.model.arch == "{NAME}"
    build_model(cfg.model)
'''

PRESET = f"""# A tiny CPU run of the test's throwaway arch.
inherit: tiny/txl
model:
  arch: {NAME}
"""

# The tests that run every registered arch, each of which must pick the new one up
GENERIC = ("tests/models/test_registry.py", "tests/models/test_contract.py", "tests/models/test_memory_protocol.py",
           "tests/models/test_flops_params.py", "tests/trainer/inference/test_generate.py")


@pytest.mark.slow  # a pytest process of its own
def test_a_new_arch_is_its_module_an_entry_a_reference_test_and_a_preset(tmp_path):
    files = {tmp_path / f"{NAME}.py": MODULE, tmp_path / f"register_{NAME}.py": ENTRY,
             tmp_path / f"test_{NAME}.py": REFERENCE_TEST, tmp_path / "configs" / "tiny" / f"{NAME}.yaml": PRESET}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", f"register_{NAME}", "-p", "no:cacheprovider", "-k", NAME,
         f"--junitxml={report}", "--rootdir", str(ROOT), str(tmp_path / f"test_{NAME}.py"), *GENERIC],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cases = ElementTree.parse(report).getroot().iter("testcase")
    ran: dict[str, int] = {}
    for case in cases:
        assert case.find("failure") is None and case.find("error") is None and case.find("skipped") is None
        # its module's name; the reference test, outside the checkout, has none in the report
        module = case.get("classname").rsplit(".", 1)[-1] or f"test_{NAME}"
        ran[module] = ran.get(module, 0) + 1
    # its own reference test, and every generic test file held the new arch to its checks
    assert ran.get(f"test_{NAME}") == 2, ran
    for path in GENERIC:
        assert ran.get(Path(path).stem, 0) >= 1, (path, ran)
    assert len(files) == 4  # the module, the registry entry, the reference test, the preset
    print(f"\nnew arch {NAME}: 4 files; tests run for it: {ran}")
