"""hplab's own model presets, torch-free: the sizes `hplab.models` builds (`--model NAME`) and the
planner counts (its GPU, cluster and GPT-3 presets are in hplab/plan/presets.py)."""

HPLAB_PRESETS = {
    # trains in seconds on a laptop CPU, on the small BPE shipped in data/hplab-bpe
    "tiny": dict(
        vocab_size=2048, n_positions=64, n_embd=64, n_layer=4, n_head=4, tokenizer="hplab-bpe"
    ),
    # the real GPT-2 sizes, on the genuine GPT-2 BPE shipped in data/gpt2-tokenizer
    "gpt2": dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, tokenizer="gpt2"
    ),
    "gpt2-medium": dict(
        vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16, tokenizer="gpt2"
    ),
    # a Llama-style decoder (hplab/models/llama.py): 4 query heads share 2 K/V heads, a SwiGLU
    # MLP of about 8/3·h, RoPE with Llama 3's θ; tied head, like Llama 3.2's small models
    "llama-tiny": dict(
        arch="llama",
        vocab_size=2048,
        n_positions=64,
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        intermediate_size=352,
        rope_theta=500000.0,
        tokenizer="hplab-bpe",
    ),  # fmt: skip
    "llama-125m": dict(  # for a GPU: about 125M parameters on GPT-2's vocabulary
        arch="llama",
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_kv_head=4,
        intermediate_size=2560,
        rope_theta=500000.0,
        tokenizer="gpt2",
    ),  # fmt: skip
}
