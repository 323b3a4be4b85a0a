"""Models the strategies cut up: `gpt`, hplab's compact GPT-2, and `llama`, a compact Llama,
each with Hugging Face's names (`hf` converts configs and weights). `build_model` builds either
from a ModelConfig (`arch`)."""

from hplab.models.gpt import GPT, PRESETS, GPTConfig, build_model, config_from_preset

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "config_from_preset"]
