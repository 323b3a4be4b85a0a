"""A compact GPT-2, in one file, whose parameters are named exactly like Hugging Face's.

Why not `transformers.GPT2LMHeadModel`? Every strategy in hplab cuts this model somewhere (data
parallel replicates it, ZeRO shards its parameters, tensor parallel splits each `Linear`, pipeline
parallel the list of blocks), and a learner should see all the pieces being cut on one screen.

Shape of the network (GPT-2, Radford et al. 2019):

    tokens ─ wte + wpe ─┬─ Block × n_layer ─ ln_f ─ lm_head (tied to wte) ─ logits
                        └ Block: x + attn(ln_1(x)), then x + mlp(ln_2(x))

Names match `GPT2LMHeadModel` (`transformer.h.0.attn.c_attn.weight`, ...), so weights convert
both ways with `to_hf_state_dict` / `from_hf_state_dict`, transposing the four projections per
block: Hugging Face's `Conv1D` weight is `[in, out]`, an `nn.Linear`'s `[out, in]`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hplab.config import ModelConfig
from hplab.models import tp_styles
from hplab.parallel import tp
from hplab.parallel.moe import MoE
from hplab.presets import HPLAB_PRESETS

#: hplab's GPT-2 is described by the one model description the planner reads too.
GPTConfig = ModelConfig

#: tiny, gpt2, gpt2-medium: sizes from `hplab.plan.formulas.HPLAB_PRESETS`, shared with the planner.
PRESETS: dict[str, GPTConfig] = {
    name: GPTConfig(**size, name=name) for name, size in HPLAB_PRESETS.items()
}


def config_from_preset(
    name: str | GPTConfig, n_layer=None, n_embd=None, n_head=None, seq_len=None, n_kv_head=None
) -> GPTConfig:
    """A preset (or a GPTConfig) with the overrides `--n-layer --n-embd --n-head --seq-len`
    (and `--n-kv-head`, Llama's)."""
    if isinstance(name, str) and name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    sizes = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq_len)
    overrides = {k: v for k, v in {**sizes, "n_kv_head": n_kv_head}.items() if v is not None}
    return replace(PRESETS[name] if isinstance(name, str) else name, **overrides)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each token attends to itself and the tokens before it: [B, heads, T, d] → same shape."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def unfused_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same, as the papers' models compute it (`flash_attention=False`): the s×s scores,
    masked, softmaxed and kept for backward, a·s² numbers per sequence and layer that a fused
    kernel never keeps and that selective recompute computes again."""
    T = q.shape[-2]
    future = torch.full((T, T), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + future  # (+ keeps no mask)
    return torch.softmax(scores, dim=-1) @ v


def attention_core(attention: nn.Module, q, k, v) -> torch.Tensor:
    """`attention.attend(q, k, v)`, run again in backward instead of keeping what it saved when
    `attention.recompute_core` is on (selective recompute)."""
    if attention.recompute_core and torch.is_grad_enabled():
        return checkpoint(attention.attend, q, k, v, use_reentrant=False)
    return attention.attend(q, k, v)


class CausalSelfAttention(nn.Module):
    """Multi-head attention. `c_attn` projects to Q, K and V at once: its output is
    [q for all heads | k for all heads | v for all heads], each block n_embd wide.
    `recompute_core` (selective recompute, Korthikanti et al.): attention's core, from Q, K, V
    to the weighted sum of values, runs again in backward instead of keeping what it saved (the
    s×s scores of an unfused attention; a fused one's output and log-sum-exp); Q, K, V themselves
    are kept by the projection anyway. Cheap FLOPs for memory that grows with s²."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attend = causal_attention if config.flash_attention else unfused_causal_attention
        # (context parallel swaps in ring attention or Ulysses)
        self.recompute_core = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        B, T, _ = q.shape  # of the projections: under sequence parallel c_attn gathers all of T
        # [B, T, heads·d] -> [B, heads, T, d]; `-1` lets the same code run on a shard of heads
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = attention_core(self, q, k, v)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's "gelu_new"


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = (
            MoE(
                config.n_embd,
                config.n_experts,
                config.moe_top_k,
                lambda: MLP(config),
                config.moe_capacity_factor,
                config.moe_aux_coef,
                balance=config.moe_balance,
            )
            if config.n_experts
            else MLP(config)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Recomputing:
    """`model.recomputing` is True inside (re-entered when a split backward recomputes twice)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.model.recomputing = True

    def __exit__(self, *exc):
        self.model.recomputing = False


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over every token: logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Decoder(nn.Module):
    """What hplab's decoders share (GPT here, Llama in `llama.py`): the forward in three parts,
    so a pipeline can run them on different ranks (`embed`, `run_block` over `blocks`, `head`),
    the loss, and what backward computes again. `recompute = "full"` (or True) makes each block
    keep only its input for backward and recompute the rest (activation checkpointing): less
    activation memory for one more forward per block; `"selective"` recomputes only
    attention's core (each attention module's `recompute_core`)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.loss_fn = cross_entropy  # tensor parallel swaps in a vocab-parallel version
        self._recompute = "none"
        self.recomputing = False

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def check_length(self, T: int) -> None:
        if T > self.config.n_positions:
            raise ValueError(
                f"sequence of {T} tokens is longer than n_positions={self.config.n_positions}"
            )

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, mode: str | bool) -> None:
        """ "none" (or False), "selective", "full" (or True): what backward computes again."""
        mode = {False: "none", True: "full"}.get(mode, mode)
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"recompute {mode!r}: choose none, selective or full")
        self._recompute = mode
        for attention in self.attentions():
            attention.recompute_core = mode == "selective"

    def attentions(self) -> list[nn.Module]:
        """Each block's attention (context parallel swaps its `attend`; selective recompute
        runs it again in backward)."""
        return [m for m in self.blocks.modules() if hasattr(m, "recompute_core")]

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=False, context_fn=self._recompute_contexts)
        return block(x)

    def _recompute_contexts(self):
        """Around a block's forward, and around each later run of it in backward: `recomputing`
        is True during those, so observers (hplab.observe.observers) count each forward once."""
        return contextlib.nullcontext(), Recomputing(self)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = self.run_block(block, x)
        logits = self.head(x)
        aux = self.aux_loss(self.blocks)
        return logits, None if targets is None else self.loss_fn(logits, targets) + aux

    @staticmethod
    def aux_loss(blocks) -> torch.Tensor | float:
        """The auxiliary losses of these blocks' last forward (a mixture of experts' balance and
        z-loss, `hplab.parallel.moe`), summed; 0 for dense blocks."""
        return sum(b.mlp.aux_loss for b in blocks if isinstance(b.mlp, MoE))


class GPT(Decoder):
    """GPT-2 language model. `forward(idx, targets)` returns `(logits, loss)` (loss None without
    targets); `recompute` as `Decoder` says."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.transformer = nn.ModuleDict(
            dict(  # what HF calls `transformer`
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.n_positions, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one tensor, two uses
        self.position_ids = torch.arange  # context parallel: the true positions of its tokens
        self.reset_parameters()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def embedding_part(self) -> nn.ModuleList:  # what `embed` uses (a pipeline's first stage)
        return nn.ModuleList([self.transformer.wte, self.transformer.wpe])

    def head_part(self) -> nn.ModuleList:  # what `head` uses (a pipeline's last stage)
        return nn.ModuleList([self.transformer.ln_f, self.lm_head])

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit layer norms, and the
        projections that write into the residual stream scaled by 1/sqrt(2·n_layer)."""
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.config.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            else:  # layer-norm scales (ln_1, ln_2, ln_f) 1, every bias 0
                p.fill_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0)

    # The forward pass in three parts, so a pipeline can run them on different ranks.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        self.check_length(T)
        positions = self.position_ids(T, device=idx.device)
        return self.transformer.wte(idx) + self.transformer.wpe(positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(x))


def build_model(config: GPTConfig, seed: int = 0) -> Decoder:
    """The same initial weights for a given seed on every rank and in every layout: weights
    are drawn on the CPU from a generator seeded only by `seed`, then moved to the device.
    `config.arch` picks the model: GPT-2 here, or `llama.LlamaLM`."""
    with torch.random.fork_rng(devices=[]):  # the caller's CPU generator is left as it was
        torch.manual_seed(seed)
        if config.arch == "llama":
            from hplab.models.llama import LlamaLM  # (it builds on this module)

            return LlamaLM(config)
        return GPT(config)


# --- Hugging Face interop ------------------------------------------------------------------
_CONV1D_SUFFIXES = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hplab → `GPT2LMHeadModel`: same names (the tied `lm_head.weight` too), Conv1D transposed."""
    return {
        name: (t.t().contiguous() if name.endswith(_CONV1D_SUFFIXES) else t)
        for name, t in state_dict.items()
    }


def from_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`GPT2LMHeadModel` state dict → hplab's (the transposes undo themselves; masks dropped)."""
    out = to_hf_state_dict(
        {
            name: t
            for name, t in state_dict.items()
            if not name.endswith((".attn.bias", ".attn.masked_bias"))
        }
    )
    if "transformer.wte.weight" in out:  # tied: the head is the embedding
        out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out


def to_hf_config(config: GPTConfig):
    """A `transformers.GPT2Config` for this model, without dropout (imports transformers only
    when called). bos/eos must lie inside the vocabulary (transformers 5): the last id."""
    from transformers import GPT2Config

    eos = config.vocab_size - 1
    names = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon")
    shape = {k: getattr(config, k) for k in names}  # GPT2Config's names
    return GPT2Config(
        **shape,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )


def config_from_hf(hf: dict) -> GPTConfig:
    """The inverse of `to_hf_config`: GPT-2's config.json → GPTConfig (keys left out: the gpt2
    preset's; the shipped tokenizer of `vocab_size` ids). ValueError where HF's GPT-2 differs."""
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"says model_type {hf.get('model_type')!r}: not a GPT-2 model ('gpt2')")
    if "hplab" in hf:  # written by hplab's --save: its own config, tokenizer included
        return GPTConfig(**hf["hplab"]["config"])
    shape = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon")
    config = replace(PRESETS["gpt2"], **{k: hf[k] for k in shape if k in hf})
    same_math = dict(
        activation_function=("gelu_new", "gelu_pytorch_tanh"),
        n_inner=(None, 4 * config.n_embd),
        scale_attn_weights=(True,),
        tie_word_embeddings=(True,),
        scale_attn_by_inverse_layer_idx=(False,),
    )  # (cross-attention: unused without encoder)
    for key, same in same_math.items():
        if hf.get(key, same[0]) not in same:
            raise ValueError(f"has {key} {hf[key]!r}: hplab's GPT-2 has {same[0]!r}")
    tokenizers = {size["vocab_size"]: size["tokenizer"] for size in HPLAB_PRESETS.values()}
    if config.vocab_size not in tokenizers:
        raise ValueError(
            f"has vocab_size {config.vocab_size}, the vocabulary of no shipped "
            f"tokenizer ({', '.join(f'{t}: {v}' for v, t in tokenizers.items())} ids)"
        )
    return replace(config, tokenizer=tokenizers[config.vocab_size])


# --- tensor parallel: where to cut (`tp.parallelize` takes a plan; compose passes this one) ----
# Module names (fnmatch patterns; "" is the model itself) → styles (hplab/parallel/tp.py).


def vocab_parallel_loss(model, comm, sequence_parallel=False):
    """hplab's GPT computes its loss with `model.loss_fn`: make it the vocab-parallel one."""
    model.loss_fn = functools.partial(
        tp.vocab_parallel_cross_entropy, comm=comm, vocab_size=model.config.vocab_size
    )
    return model


def needs_sdpa(model, comm, sequence_parallel=False):
    """HF GPT-2 handed s/T ids would size an explicit causal mask by them while attention sees
    all s tokens: only "sdpa" (PyTorch's attention, causal, no mask) is right."""
    if sequence_parallel and (attention := model.config._attn_implementation) != "sdpa":
        raise tp.TensorParallelError(
            "sequence parallel needs the model built with "
            f"attn_implementation='sdpa' (not {attention!r})"
        )
    return model


_BLOCKS = {  # c_attn: this rank's heads' rows of Q, of K and of V
    "transformer.h.*.attn.c_attn": functools.partial(tp.ColumnParallelLinear, fused=3),
    "transformer.h.*.attn.c_proj": tp.RowParallelLinear,
    "transformer.h.*.mlp.c_fc": tp.ColumnParallelLinear,
    "transformer.h.*.mlp.c_proj": tp.RowParallelLinear,
}
TP_PLAN = {  # for tp.parallelize: this file's GPT; the order matters: wte before its tied head
    "transformer.wte": tp.VocabParallelEmbedding,
    "lm_head": tp.ColumnParallelLinear,  # its weight is wte's piece: this rank's V/T logits
    "transformer.wpe": tp.SequenceParallelPositions,
    **_BLOCKS,
    "transformer.h.*.attn": tp_styles.divide("n_head"),  # this rank's heads
    "": vocab_parallel_loss,
}


HF_TP_PLAN = {  # for tp.parallelize: HF's GPT2LMHeadModel, handed s/T ids under sequence parallel
    "": needs_sdpa,
    "transformer.wte": functools.partial(tp.VocabParallelEmbedding, given_slice=True),
    "lm_head": tp.ColumnParallelLinear,
    "transformer.wpe": functools.partial(tp.SequenceParallelPositions, given_slice=True),
    **_BLOCKS,  # HF cuts c_attn's output into q, k, v of width split_size:
    "transformer.h.*.attn": tp_styles.divide("num_heads", "embed_dim", "split_size"),
}
