"""Hugging Face interop for hplab's decoders, by family: names, layouts and config.json.

    GPT-2   hplab/models/gpt.py     GPT2LMHeadModel     Conv1D weights transposed
    Llama   hplab/models/llama.py   LlamaForCausalLM    the same tensors under the same names
                                    (Qwen2ForCausalLM when q, k and v have biases)

A checkpoint hplab writes is a folder `from_pretrained` opens; `--init-from` reads any such
folder of these families whose vocabulary is a shipped tokenizer's.
"""

from __future__ import annotations

import torch

from hplab.config import ModelConfig
from hplab.models import gpt, llama
from hplab.presets import HPLAB_PRESETS


def shipped_tokenizers() -> dict[int, str]:
    """{vocabulary size: the tokenizer in data/ that has it}."""
    return {size["vocab_size"]: size["tokenizer"] for size in HPLAB_PRESETS.values()}


def config_from_hf(hf: dict) -> ModelConfig:
    """A config.json → ModelConfig: hplab's own (written by --save), or GPT-2's, Llama's or
    Qwen2's; ValueError, one sentence, for anything else."""
    if "hplab" in hf:  # written by hplab's --save: its own config, tokenizer included
        return ModelConfig(**hf["hplab"]["config"])
    kind = hf.get("model_type")
    if kind == "gpt2":
        return gpt.config_from_hf(hf)
    if kind in ("llama", "qwen2"):
        return llama.config_from_hf(hf, shipped_tokenizers())
    raise ValueError(f"says model_type {kind!r}: hplab reads gpt2, llama and qwen2 models")


def architecture(config: ModelConfig) -> str:
    """The transformers class that opens this model's folder."""
    if config.arch == "gpt2":
        return "GPT2LMHeadModel"
    return "Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"


def to_hf_config(config: ModelConfig):
    return (gpt if config.arch == "gpt2" else llama).to_hf_config(config)


def to_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
    """hplab → Hugging Face, without a tied head's second name (transformers ties it again)."""
    out = gpt.to_hf_state_dict(state) if config.arch == "gpt2" else dict(state)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
    """Hugging Face → hplab; a bare GPT2Model or LlamaModel (no head) gets its prefix."""
    prefix = "transformer." if config.arch == "gpt2" else "model."
    if not any(name.startswith(prefix) for name in state):
        state = {prefix + name: t for name, t in state.items()}
    if config.arch == "gpt2":
        return gpt.from_hf_state_dict(state)
    return llama.from_hf_state_dict(state, config)
