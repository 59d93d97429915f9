"""models/registry.py: the one place that knows which archs exist. Every entry builds, counts and validates through
it alone, a new entry needs no edit elsewhere in models/, and every registered arch is under the contract tests."""

import subprocess
import sys

import pytest
import torch

from memlm.models import ARCHITECTURES, ArchSpec, ConfigError, ModelConfig, build_model, map_memory
from memlm.models import registry as registry_module
from memlm.models.flops import flops_per_token, param_count
from support.models import registry_config as _tiny
from support.models import tiny_model_config


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_entry_builds_its_class_and_counts_its_parameters(name):
    spec = ARCHITECTURES[name]
    cfg = _tiny(spec)
    model = build_model(cfg)
    assert type(model) is spec.load("model")
    assert spec.load("decoder")(model) is not None  # memlm generate's incremental decoder
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert flops_per_token(cfg)["total"] > 0


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_an_entry_counts_its_layers_one_way(name):
    """memlm's own layers are counted by flops.py with the entry's layer_flops; a pretrained backbone's layers
    (memlm_layers False) by the entry's own flops and params."""
    spec = ARCHITECTURES[name]
    assert bool(spec.layer_flops) is spec.memlm_layers
    assert bool(spec.flops) is bool(spec.params) is (not spec.memlm_layers)
    assert spec.memlm_layers or not spec.extra_params  # params counts every parameter


def test_every_entry_validates_without_torch():
    """Config validation reads an entry's checks by name, torch-free; a pretrained backbone's FLOPs and parameters
    too (read from its config: models/pretrained/shape.py and counts.py; memlm's layers count theirs in their
    modules, with torch). A fresh process imports neither torch nor transformers or peft."""
    code = ("import sys\n"
            "from memlm.models import ARCHITECTURES, ModelConfig\n"
            "from memlm.models.flops import flops_per_token, param_count\n"
            "for spec in ARCHITECTURES.values():\n"
            "    cache = {'mem_len': 1 if spec.mem_len == 'positive' else 0}\n"
            "    cfg = ModelConfig(arch=spec.name, **{**cache, **dict(spec.test_settings)}).validate()\n"
            "    if not spec.memlm_layers:\n"
            "        assert flops_per_token(cfg)['total'] > 0 and param_count(cfg) > 0\n"
            "heavy = [m for m in ('torch', 'transformers', 'peft') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# Every key of memlm's own layers, with a value other than its default
MEMLM_LAYER_SETTINGS = dict(n_layer=3, n_head=4, d_model=48, d_head=12, d_inner=96, d_embed=16, cutoffs=[10],
                            div_val=2, pre_lnorm=True, untie_r=True, dropout=0.1, dropatt=0.1, clamp_len=4,
                            same_length=True, init_std=0.05, tie_weight=False, attention="eager", head_loss="full")


@pytest.mark.parametrize("name", sorted(name for name, spec in ARCHITECTURES.items() if not spec.memlm_layers))
@pytest.mark.parametrize("key", sorted(MEMLM_LAYER_SETTINGS))
def test_a_pretrained_backbone_refuses_memlm_layer_keys(name, key):
    """An arch whose layers are a pretrained backbone's would silently ignore memlm's layer keys (its widths, head
    and attention are its config's): each is refused in one line naming it (div_val by the shared checks: it needs
    cutoffs)."""
    with pytest.raises(ConfigError, match=f"^model.{key} ") as refused:
        _tiny(ARCHITECTURES[name], **{key: MEMLM_LAYER_SETTINGS[key]}).validate()
    assert "\n" not in str(refused.value)


def test_an_unknown_arch_lists_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        ModelConfig(arch="infini").validate()
    assert str(err.value).startswith("model.arch: unknown architecture 'infini'; valid: "
                                     + ", ".join(ARCHITECTURES))


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_mem_len_rules_and_foreign_options_are_refused_by_the_entry(name):
    spec = ARCHITECTURES[name]
    if spec.mem_len == "zero":
        with pytest.raises(ConfigError, match=f"model.mem_len must be 0 for arch '{name}'"):
            _tiny(spec, mem_len=4).validate()
    if spec.mem_len == "positive":
        with pytest.raises(ConfigError, match=f"model.mem_len must be >= 1 for arch '{name}'"):
            _tiny(spec, mem_len=0).validate()
    for other in ARCHITECTURES.values():
        for option in set(other.options) - set(spec.options):
            default = getattr(ModelConfig(), option)
            changed = (not default) if isinstance(default, bool) else (
                default + "_other" if isinstance(default, str) else
                default + [0.5] if isinstance(default, list) else
                {**default, "other": 1} if isinstance(default, dict) else default + 1)
            with pytest.raises(ConfigError, match=f"model.{option} only applies to arch .*'{other.name}'"):
                _tiny(spec, **{option: changed}).validate()


def test_a_new_entry_is_all_models_needs(monkeypatch):
    """An arch registered under a new name (here Transformer-XL's class and FLOPs again) builds, validates and is
    counted with no other edit in models/."""
    entry = ArchSpec("txl_again", "Transformer-XL under another name", model="memlm.models.txl:TransformerXL",
                     layer_flops="memlm.models.txl:layer_flops")
    monkeypatch.setitem(registry_module.ARCHITECTURES, entry.name, entry)
    cfg = tiny_model_config(arch="txl_again")
    model = build_model(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert flops_per_token(cfg) == flops_per_token(tiny_model_config(arch="txl"))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.tgt_len))
    out = model(tokens, model.init_memory(2), targets=tokens)
    assert out.nll.shape == (2, cfg.tgt_len)


def test_an_entry_owns_its_config_checks(monkeypatch):
    """validate() runs the checks the entry names (after the shared ones): here Transformer-XL under another name
    with the Compressive Transformer's."""
    entry = ArchSpec("txl_checked", "Transformer-XL under another name", model="memlm.models.txl:TransformerXL",
                     layer_flops="memlm.models.txl:layer_flops", checks="memlm.models.arch_checks:compressive")
    monkeypatch.setitem(registry_module.ARCHITECTURES, entry.name, entry)
    with pytest.raises(ConfigError, match="^model.compressed_len must be >= 1"):
        tiny_model_config(arch="txl_checked").validate()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_memory_state_has_the_common_interface(name):
    """detached(): the same kind of state, cut from the autograd graph (what the trainer carries); key_valid: the
    cached keys' validity (what analyses mask with)."""
    spec = ARCHITECTURES[name]
    cfg = _tiny(spec)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.tgt_len))
    memory = model(tokens, model.init_memory(2), targets=tokens).memory
    cut = memory.detached()
    assert type(cut) is type(memory)
    assert memory.key_valid.dtype == torch.bool and memory.key_valid.shape[0] == 2
    tensors = []
    map_memory(tensors.append, cut)
    assert tensors and not any(t.requires_grad for t in tensors)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_has_memory_is_what_the_model_does(name):
    """An entry's has_memory (not its cache rule: ARMT has no cache) says whether one segment changes the next one's
    output. Every weight is drawn at random, so no zero initialisation (ARMT's W_v) hides a memory path."""
    spec = ARCHITECTURES[name]
    cfg = _tiny(spec)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        before, segment = torch.randint(0, cfg.vocab_size, (2, 2, cfg.tgt_len)).unbind(1)
        after_one = model(before, model.init_memory(2)).memory
        fresh = model(segment, model.init_memory(2), return_logits=True).logits
        carried = model(segment, after_one, return_logits=True).logits
    assert (not torch.allclose(fresh, carried)) is spec.has_memory
