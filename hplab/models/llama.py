"""A compact Llama, in one file, whose parameters are named exactly like Hugging Face's.

The decoder people train today (Llama 2 and 3, Qwen2, Mistral) differs from GPT-2 in five
places, each a line or two here:

    RMSNorm        x / rms(x) · g: no mean to subtract, no bias (Zhang & Sennrich 2019)
    RoPE           no learned positions: query and key channels turn, pair by pair, by an angle
                   position · θ^(−2i/d) (Su et al. 2021); attention then sees relative positions
    SwiGLU         the MLP is down(silu(gate(x)) · up(x)) (Shazeer 2020), width `intermediate_size`
    GQA            n_kv_head K/V heads, each shared by n_head / n_kv_head query heads (Ainslie et
                   al. 2023): the K/V cache, and what tensor and context parallel move, shrink
    no biases      (Qwen2 keeps q, k and v biases: `qkv_bias`); the LM head tied or not

Shape of the network:

    tokens ─ embed_tokens ─┬─ LlamaDecoderLayer × n_layer ─ norm ─ lm_head ─ logits
                           └ layer: x + self_attn(input_layernorm(x)),
                                    then x + mlp(post_attention_layernorm(x))

Names match `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...) and every weight
is stored as Hugging Face stores it ([out, in] `nn.Linear`s), so state dicts convert by name
alone. `LlamaLM` runs the same forward in three parts as hplab's GPT (`embed`, `run_block`,
`head`), with the same `recompute` modes, so the training loop treats both alike.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hplab.config import ModelConfig
from hplab.models.gpt import Decoder, attention_core, vocab_parallel_loss
from hplab.parallel import tp
from hplab.parallel.moe import MoE


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (−x2, x1) on the two halves of the last dimension: the 90° turn of each pair
    (x[i], x[i + d/2]) that RoPE mixes in (Hugging Face's channel order)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos and sin of position · θ^(−2i/d) for each pair of a head's d channels. `position_ids`
    gives the true positions of the tokens a rank holds (context parallel swaps it)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)
        self.position_ids = torch.arange

    def forward(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.position_ids(T, device=device).float()
        angles = torch.outer(positions, self.inv_freq.to(device))  # [T, d/2]
        angles = torch.cat((angles, angles), dim=-1)  # [T, d]: both halves of each pair
        return angles.cos(), angles.sin()


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention where query head j reads K/V head j // (n_head / n_kv_head): SDPA's
    `enable_gqa` does what Hugging Face's `repeat_kv` does, without copying K and V."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] turned by each token's angles (in fp32, rounded back to x's dtype)."""
    turned = x.float() * cos + rotate_half(x.float()) * sin
    return turned.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention: q_proj makes n_head query heads, k_proj and v_proj n_kv_head
    K/V heads; query head j reads K/V head j // (n_head / n_kv_head). Queries and keys turn by
    RoPE before the scores. Under tensor parallel a rank holds a slice of whole heads of each
    projection; the views count heads from the widths. `recompute_core`: as hplab's GPT."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        h = config.n_embd
        d = config.n_embd // config.n_head
        self.head_dim = d
        self.rotary = [rotary]
        self.q_proj = nn.Linear(h, config.n_head * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_head * d, h, bias=False)
        self.attend = grouped_causal_attention  # (context parallel would swap it)
        self.recompute_core = False

    @property
    def n_head(self) -> int:  # the query heads this rank holds (all, or its tensor-parallel share)
        return self.q_proj.weight.shape[0] // self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        B, T, _ = q.shape  # (under sequence parallel the projections gather all of T)
        # [B, T, heads·d] -> [B, heads, T, d]; `-1` lets the same code run on a shard of heads
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = self.rotary[0](T, x.device)  # (a list: the shared module is not a child)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attention_core(self, q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)); gate and up widen to `intermediate_size`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.n_embd
        inner = config.mlp_width
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.up_proj = nn.Linear(h, inner, bias=False)
        self.down_proj = nn.Linear(inner, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        eps = config.layer_norm_epsilon
        c = config
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=eps)
        self.mlp = (  # Mixtral's: each expert a SwiGLU MLP (moe.py's router and balance)
            MoE(c.n_embd, c.n_experts, c.moe_top_k, lambda: LlamaMLP(c), c.moe_capacity_factor,
                c.moe_aux_coef, balance=c.moe_balance)
            if c.n_experts
            else LlamaMLP(config)
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(Decoder):
    """A Llama-style language model. `forward(idx, targets)` returns `(logits, loss)`;
    `recompute` as hplab's GPT."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        rotary = RotaryEmbedding(config.n_embd // config.n_head, config.rope_theta)
        self.model = nn.ModuleDict(  # what HF calls `model`
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
                layers=nn.ModuleList(
                    LlamaDecoderLayer(config, rotary) for _ in range(config.n_layer)
                ),
                norm=nn.RMSNorm(config.n_embd, eps=config.layer_norm_epsilon),
                rotary_emb=rotary,
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def embedding_part(self) -> nn.ModuleList:  # what `embed` uses (a pipeline's first stage)
        return nn.ModuleList([self.model.embed_tokens])

    def head_part(self) -> nn.ModuleList:  # what `head` uses (a pipeline's last stage)
        return nn.ModuleList([self.model.norm, self.lm_head])

    @property
    def rotary(self) -> RotaryEmbedding:
        return self.model.rotary_emb

    @property
    def position_ids(self):
        """The positions RoPE turns this rank's tokens by (context parallel: their true ones)."""
        return self.rotary.position_ids

    @position_ids.setter
    def position_ids(self, fn) -> None:
        self.rotary.position_ids = fn

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) weights (the residual writers o_proj and down_proj scaled by
        1/sqrt(2·n_layer), as GPT-2), zero biases, unit RMSNorm gains."""
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.config.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        self.check_length(idx.shape[1])
        return self.model.embed_tokens(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))


# --- tensor parallel: where to cut (compose passes it to tp.parallelize) ------------------------
def kv_heads(attention, comm, sequence_parallel=False):
    """k_proj and v_proj cut into whole K/V heads. With fewer K/V heads than ranks, each is held
    alike by the consecutive ranks whose query heads read it (`Split.replicas`): rank r keeps
    head r // (T / n_kv_head), and its gradient, a partial sum over its own query heads, is
    summed over those ranks in backward by the hook tp.parallelize sets on it."""
    replicas = max(1, comm.size // (attention.k_proj.out_features // attention.head_dim))
    for name in ("k_proj", "v_proj"):
        cut = tp.ColumnParallelLinear(
            getattr(attention, name), comm, sequence_parallel, 1, replicas
        )
        setattr(attention, name, cut)
    return attention


def vocab_head(linear, comm, sequence_parallel=False):
    """The LM head, column parallel by vocabulary: tied, it is already the embedding's padded
    piece; untied, its rows are padded to a multiple of T as the embedding's are (the loss masks
    the padding), so a vocabulary that does not split still cuts."""
    tp.cut(linear.weight, tp.Split(0, full_size=linear.out_features), comm)  # (no-op if tied)
    return tp.ColumnParallelLinear(linear, comm, sequence_parallel)


TP_PLAN = {  # for tp.parallelize, by LlamaForCausalLM's names: whole query and K/V heads
    "model.embed_tokens": tp.VocabParallelEmbedding,
    "lm_head": vocab_head,
    "model.layers.*.self_attn.q_proj": tp.ColumnParallelLinear,
    "model.layers.*.self_attn": kv_heads,
    "model.layers.*.self_attn.o_proj": tp.RowParallelLinear,
    **{f"model.layers.*.mlp.{x}_proj": tp.ColumnParallelLinear for x in ("gate", "up")},
    "model.layers.*.mlp.down_proj": tp.RowParallelLinear,
    "": vocab_parallel_loss,
}
#: The attention, embedding and head only (Mixtral's, whose experts are 3-D parameters that stay
#: whole on every rank: their input is whole there after o_proj's all-reduce).
ATTENTION_TP_PLAN = {name: style for name, style in TP_PLAN.items() if ".mlp." not in name}


# --- Hugging Face interop ------------------------------------------------------------------
def from_hf_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict:
    """`LlamaForCausalLM` / `Qwen2ForCausalLM` → hplab: the same names and layouts; a tied
    model's head is its embedding."""
    out = {k: t for k, t in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def to_hf_config(config: ModelConfig):
    """A `LlamaConfig` for this model (a `Qwen2Config` when q, k and v have biases: Llama's
    `attention_bias` would add one to o_proj too). Imports transformers only when called."""
    import transformers

    eos = config.vocab_size - 1
    kind = transformers.Qwen2Config if config.qkv_bias else transformers.LlamaConfig
    return kind(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.mlp_width,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.n_positions,
        rms_norm_eps=config.layer_norm_epsilon,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        hidden_act="silu",
        bos_token_id=eos,
        eos_token_id=eos,
    )


def config_from_hf(hf: dict, tokenizers: dict[int, str]) -> ModelConfig:
    """A Llama or Qwen2 config.json → ModelConfig; ValueError, one sentence, where the model's
    math is not hplab's Llama (another activation, RoPE scaling, a sliding window, biases on
    o_proj or the MLP) or its vocabulary is no shipped tokenizer's (`tokenizers`: size → name)."""
    kind = hf.get("model_type")  # (transformers 5's)
    rope = hf.get("rope_parameters") or {}
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    for key in (*shape, "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"says model_type {kind!r} but lacks {key}, which every {kind} has")
    same_math = dict(
        hidden_act=("silu",),
        rope_scaling=(None,),
        rope_type=("default",),
        attention_bias=(False,),
        mlp_bias=(False,),
        use_sliding_window=(False,),
        head_dim=(None, hf["hidden_size"] // hf["num_attention_heads"]),
    )
    for key, same in same_math.items():
        value = rope.get(key, hf.get(key, same[0]))
        if value not in same:
            raise ValueError(f"has {key} {value!r}: hplab's Llama has {same[0]!r}")
    if hf["vocab_size"] not in tokenizers:
        raise ValueError(
            f"has vocab_size {hf['vocab_size']}, the vocabulary of no shipped tokenizer "
            f"({', '.join(f'{t}: {v}' for v, t in tokenizers.items())} ids)"
        )
    return ModelConfig(
        arch="llama",
        vocab_size=hf["vocab_size"],
        n_positions=hf.get("max_position_embeddings", 2048),
        n_embd=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        layer_norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2",
        tokenizer=tokenizers[hf["vocab_size"]],
    )
