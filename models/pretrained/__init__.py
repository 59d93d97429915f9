"""Memory around a pretrained Hugging Face causal LM: the archs hf (no memory), hf_rmt and hf_armt.

`shape.py` and `checks.py` read a backbone's config.json without torch (the registry's config checks and FLOPs
load them); `loading.py`, `causal_lm.py`, `rmt.py` and `armt.py` import transformers (and peft for LoRA), the only
modules of models/ that do.
"""
