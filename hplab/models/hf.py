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
    Qwen2's, with sizes hplab can build (`checked`); ValueError, one sentence, for anything
    else."""
    if not isinstance(hf, dict):
        raise ValueError("is not a JSON object {...}")
    if "hplab" in hf:  # written by hplab's --save: its own config, tokenizer included
        try:
            return checked(ModelConfig(**hf["hplab"]["config"]))
        except (TypeError, KeyError) as err:
            raise ValueError(f"has an 'hplab' entry without a usable config ({err})") from None
    kind = hf.get("model_type")
    try:
        if kind == "gpt2":
            return checked(gpt.config_from_hf(hf))
        if kind in ("llama", "qwen2"):
            return checked(llama.config_from_hf(hf, shipped_tokenizers()))
    except (TypeError, KeyError) as err:
        raise ValueError(f"cannot be read as a {kind} config ({err})") from None
    raise ValueError(f"says model_type {kind!r}: hplab reads gpt2, llama and qwen2 models")


#: the largest size of each kind hplab builds (from an untrusted config.json: no model of a
#: million layers, which would take for ever to build)
SIZE_LIMITS = dict(vocab_size=2**20, n_positions=2**20, n_embd=2**16, n_layer=1024, n_head=1024)
SIZE_LIMITS |= dict(n_kv_head=1024, intermediate_size=2**18, n_experts=1024, moe_top_k=1024)


def checked(config: ModelConfig) -> ModelConfig:
    """`config`, if its sizes are whole numbers hplab can build and its constants are finite
    and positive; else ValueError naming the first that is not."""
    for name, limit in SIZE_LIMITS.items():
        value = getattr(config, name)
        low = int(name not in ("n_kv_head", "n_experts", "intermediate_size"))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= limit:
            raise ValueError(f"has {name} {value!r}: a whole number from {low} to {limit:,}")
    for name in ("layer_norm_epsilon", "rope_theta"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e30:
            raise ValueError(f"has {name} {value!r}: a positive, finite number")
    return config


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
