"""Models the strategies cut up. `gpt` is hplab's compact GPT-2 (HF-compatible names)."""

from hplab.models.gpt import GPT, PRESETS, GPTConfig, build_model, config_from_preset

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "config_from_preset"]
