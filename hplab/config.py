"""What a run is: the model, the layout, the optimizer settings, and the one place that says
whether they can run.

Three frozen dataclasses describe a run, and every part of hplab reads the same ones:

    ModelConfig     the decoder's shape: what `hplab.models` builds and the planner counts
    Layout          how the work is cut: dp × cp × tp × pp ranks (ep inside dp), ZeRO, the
                    pipeline schedule, precision, recompute; `parallelize`, train.py and the
                    planner all take it
    OptimConfig     AdamW and its learning-rate schedule

`validate(layout, model, world_size)` owns every rule: each refusal is one plain sentence
that names the numbers and says what to change, raised as a `LayoutError` before any process
starts. Some rules say what can run at all (whole heads per tensor-parallel rank, a batch that
splits into microbatches); others say what hplab's code composes today (`runs=True`, the
default); the planner asks only the first kind, so it can still price a layout hplab refuses.

The command lines (`hplab.train`, `hplab.plan`) derive their layout flags from the fields below
(`hplab.flags.add_flags`): a field `virtual_stages` is the flag `--virtual-stages`, and
`flags.flag()` is the one mapping from field names to flag names that error messages use.
No torch here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hplab.flags import COUNT, NONNEGATIVE, flag, option
from hplab.plan.formulas import (
    CP_SPLITS,
    CP_STYLES,
    PRECISION_BYTES,
    PREFETCH,
    SCHEDULES,
    gpt_num_params,
    llama_num_params,
)
from hplab.refusals import REFUSALS  # what does not compose yet, and why

RECOMPUTE = ("none", "selective", "full")  # (in the planner's order of preference)
PRECISIONS = tuple(PRECISION_BYTES)
ARCHS = ("gpt2", "llama")  # hplab/models/gpt.py, hplab/models/llama.py
BALANCES = ("batch", "sequence")  # what a load-balancing loss counts over (hplab/parallel/moe.py)


class LayoutError(ValueError):
    """A layout or model that cannot run; the message says why and what to change. `settings`
    names the fields behind a refused combination (a command line shows them as its flags)."""

    def __init__(self, reason: str, settings: tuple[str, ...] = ()):
        super().__init__(reason)
        self.settings = settings


# --- the three descriptions ------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape (GPT-2's names). `dropout` and `flash_attention` say what the forward
    pass saves for backward: the papers' models keep dropout masks and the s×s attention
    matrices; hplab's models have no dropout and use `scaled_dot_product_attention`, which keeps
    only the output and a log-sum-exp per row. `name`: the preset it came from (not compared)."""

    vocab_size: int = 2048
    n_positions: int = 64  # the longest sequence the model reads: its seq_len
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5
    tokenizer: str = "hplab-bpe"  # which shipped tokenizer produced the token ids
    n_experts: int = 0  # > 0: each block's MLP is a mixture of experts (hplab/parallel/moe.py)
    moe_top_k: int = 2  # experts per token
    moe_capacity_factor: float = 0.0  # 0: dropless
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss added to the loss
    moe_balance: str = "batch"  # count the balance over the batch, or per sequence (DeepSeek-V3)
    dropout: bool = False
    flash_attention: bool = True
    # the Llama family (arch "llama", hplab/models/llama.py); GPT-2 reads none of these
    arch: str = "gpt2"  # gpt2 or llama
    n_kv_head: int = 0  # grouped-query attention's K/V heads (0: as many as n_head)
    intermediate_size: int = 0  # the MLP's width (0: GPT-2's 4·n_embd)
    rope_theta: float = 10000.0  # RoPE's base θ
    tie_word_embeddings: bool = True  # the LM head is the token embedding (GPT-2 always)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    name: str = field(default="", compare=False)

    def __post_init__(self):
        check_model(self)

    @property
    def seq_len(self) -> int:
        return self.n_positions

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or 4 * self.n_embd

    def num_params(self) -> int:
        """Ψ = V·h + S·h + L·(12h² + 13h) + 2h for GPT-2, tied embedding once (experts:
        gpt_num_params); a Llama's: llama_num_params."""
        if self.arch == "llama":
            h = self.n_embd
            kv = self.n_embd * self.kv_heads // self.n_head
            return llama_num_params(
                self.n_layer, h, self.vocab_size, kv, self.mlp_width,
                self.tie_word_embeddings, self.qkv_bias,
            )  # fmt: skip
        return gpt_num_params(
            self.n_layer, self.n_embd, self.vocab_size, self.n_positions, self.n_experts
        )


@dataclass(frozen=True)
class Layout:
    """How one run's work is cut over its ranks (`dp × cp × tp × pp` of them; ep inside dp)."""

    dp: int = option(1, "data-parallel size", type=COUNT)
    tp: int = option(1, "tensor-parallel size", type=COUNT)
    pp: int = option(1, "pipeline-parallel stages", type=COUNT)
    zero: int = option(0, "ZeRO stage over the data-parallel group", type=int, choices=(0, 1, 2, 3))
    schedule: str = option("1f1b", "pipeline schedule", choices=SCHEDULES)
    virtual_stages: int = option(
        1, "model chunks per pipeline rank (interleaved schedule)", type=COUNT
    )
    microbatches: int = option(
        1, "microbatches per step (gradient accumulation, pipeline fill)", type=COUNT
    )
    sequence_parallel: bool = option(
        False, "with --tp: split layer norms and dropout along the sequence"
    )
    ep: int = option(1, "expert-parallel size, out of the --dp ranks", type=COUNT)
    cp: int = option(1, "context-parallel size: ranks sharing each sequence", type=COUNT)
    cp_style: str = option(
        "ring",
        "context-parallel attention: K/V around a ring, or Ulysses' all-to-all",
        choices=CP_STYLES,
    )
    cp_split: str = option(
        "zigzag",
        "the sequence's cut over --cp: zig-zag evens the causal mask's work",
        choices=CP_SPLITS,
    )
    bucket_mb: float = option(25.0, "data-parallel gradient bucket size in MiB", type=NONNEGATIVE)

    batch_size: int | None = option(
        None, "global batch, in sequences (None: not fixed; parallelize needs none)", type=COUNT
    )
    precision: str = option("fp32", "parameters and activations", choices=PRECISIONS)
    recompute: str = option(
        "none",
        "recompute activations in backward: full (a bare --recompute) keeps only each block's "
        "input; selective recomputes attention's core (scores, softmax, weighted sum)",
        nargs="?",
        const="full",
        choices=RECOMPUTE,
    )
    offload: bool = option(False, "keep optimizer state and step on the CPU (with --zero)")
    prefetch: str = option(
        "both",
        "ZeRO-3: in which passes the next block's all-gather runs while this block computes "
        "(none: each block waits for its own)",
        choices=PREFETCH,
    )
    receives_ahead: int = option(
        1,
        "pipeline: post each receive this many computations before it is needed, so that its "
        "message crosses the link while the rank computes, as Megatron-LM and "
        "torch.distributed.pipelining do (0: just before it is needed)",
        type=int,
        choices=(0, 1, 2),
    )

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def micro_batch_size(self) -> int | None:
        return self.batch_size and self.batch_size // (self.dp * self.microbatches)

    def short(self) -> str:
        """`dp2 tp2 pp2 zero1 1f1b b2×m4 rc-full`: the planner's name for a layout."""
        chunks = f"×{self.virtual_stages}" * (self.virtual_stages > 1)
        bits = [
            f"dp{self.dp} tp{self.tp} pp{self.pp} zero{self.zero}",
            (f"cp{self.cp}" + "-ulysses" * (self.cp_style == "ulysses")) * (self.cp > 1),
            f"ep{self.ep}" * (self.ep > 1),
            (self.schedule + chunks) * (self.pp > 1),
            f"b{self.micro_batch_size}×m{self.microbatches}",
            f"rc-{self.recompute}" * (self.recompute != "none"),
            "sp" * self.sequence_parallel,
            "offload" * self.offload,
            f"prefetch-{self.prefetch}" * (self.prefetch != "both"),
        ]
        return " ".join(bit for bit in bits if bit)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW's settings and the learning-rate schedule (`formulas.learning_rate`)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # clip the gradients to this global L2 norm (0: off)
    no_decay_bias_norm: bool = False  # no weight decay on biases, layer norms, embeddings
    warmup_steps: int = 0
    lr_decay: str = "constant"
    decay_steps: int = 0
    min_lr: float = 0.0


def from_values(cls, values: dict, **changes):
    """A `cls` from a mapping (e.g. vars of the flags): its fields there, defaults otherwise."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **changes)


# --- the rules: each one once, each refusal one sentence ------------------------------------


def check_model(model: ModelConfig) -> None:
    """Sizes of at least 1, whole heads, and a top-k within the experts."""
    for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if getattr(model, name) < 1:
            raise LayoutError(f"{name} must be at least 1, got {getattr(model, name)}")
    h = model.n_embd
    a = model.n_head
    E = model.n_experts
    if h % a:
        raise LayoutError(
            f"n_embd={h} is not divisible by n_head={a}: pick a hidden size that "
            "is a multiple of the number of heads"
        )
    if E:
        check_top_k(E, model.moe_top_k)
        check_balance(model.moe_balance)
    if model.arch not in ARCHS:
        raise LayoutError(f"arch must be one of {', '.join(ARCHS)}, got {model.arch!r}")
    if model.arch == "llama":
        check_llama(model)
    elif model.n_kv_head not in (0, model.n_head):
        raise LayoutError(
            "--n-kv-head: GPT-2 has as many K/V heads as heads; grouped-query attention is "
            "the Llama models' (--model llama-tiny)"
        )


def check_llama(model: ModelConfig) -> None:
    """Whole groups of query heads per K/V head, and RoPE's channel pairs."""
    a = model.n_head
    kv = model.kv_heads
    if not 1 <= kv <= a or a % kv:
        raise LayoutError(
            f"--n-kv-head {kv} must divide --n-head ({a}): each K/V head serves a whole group "
            "of query heads"
        )
    if (model.n_embd // a) % 2:
        raise LayoutError(
            f"head width n_embd / n_head = {model.n_embd // a} must be even: RoPE turns "
            "channels in pairs"
        )


def check_balance(balance: str) -> str:
    """What the load-balancing loss counts tokens over (hplab/parallel/moe.py)."""
    if balance not in BALANCES:
        raise LayoutError(f"--moe-balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    return balance


def check_top_k(n_experts: int, top_k: int) -> None:
    """Each token goes to k of the E experts."""
    if not 1 <= top_k <= n_experts:
        raise LayoutError(
            f"--moe-top-k {top_k} must be between 1 and the number of experts, {n_experts}"
        )


def check_mesh(layout: Layout, world_size: int | None = None) -> None:
    """dp × cp × tp × pp ranks, exactly the processes there are (when `world_size` is known)."""
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    sizes |= {"cp": layout.cp} if layout.cp != 1 else {}
    if world_size is not None and layout.world_size != world_size:
        raise LayoutError(
            f"layout {' × '.join(f'{k}={v}' for k, v in sizes.items())} = {layout.world_size} "
            f"processes, but there are {world_size}: make {' × '.join(map(flag, sizes))} "
            "equal the number of processes (--nproc_per_node, or --nproc)"
        )


def check_batch(layout: Layout) -> None:
    """The global batch (when it is fixed) splits over dp, each rank's share into whole
    microbatches."""
    B = layout.batch_size
    dp = layout.dp
    m = layout.microbatches
    if B is None:
        return
    if B % dp:
        raise LayoutError(
            f"--batch-size {B} does not split over dp={dp} ranks: use a multiple of {dp}"
        )
    if B // dp % m:
        raise LayoutError(
            f"each data-parallel rank gets {B // dp} sequences, which do not split "
            f"into --microbatches {m}: make batch-size / dp a multiple of the "
            "microbatch count"
        )


def check_tensor_parallel(
    n_head: int, n_embd: int, tp: int, seq_len: int | None = None, cp: int = 1, kv_heads=None
):
    """Whole attention heads and hidden columns per rank, and whole K/V heads (or one shared by
    neighbouring ranks); with sequence parallel (`seq_len` given), whole tokens per rank: of
    each context-parallel rank's seq_len/cp."""
    ranks = f"{tp} tensor-parallel ranks"
    use = "use a tensor-parallel size that divides"
    if n_head % tp:
        raise LayoutError(f"{n_head} attention heads do not split over {ranks}: {use} {n_head}")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise LayoutError(
            f"--tp {tp} and {kv_heads} K/V heads: one must divide the other (each rank holds "
            "whole K/V heads, or shares one with its neighbours)",
            ("tp",),
        )
    if n_embd % tp:
        raise LayoutError(f"a hidden size of {n_embd} does not split over {ranks}: {use} {n_embd}")
    if seq_len and seq_len % (tp * cp):
        cp_text = (f" × {cp} context-parallel", f"{tp * cp} (tp × cp)") if cp > 1 else ("", tp)
        raise LayoutError(
            f"sequence parallel cuts the {seq_len}-token sequence over {ranks}{cp_text[0]}: "
            f"make the sequence length a multiple of {cp_text[1]}"
        )


def check_context_parallel(seq_len: int, n_head: int, cp: int, style: str, split: str):
    """Whole chunks of the sequence per rank (zig-zag: 2·cp of them); Ulysses: whole heads."""
    chunks = 2 * cp if split == "zigzag" else cp
    if style not in CP_STYLES or split not in CP_SPLITS:
        raise LayoutError(
            f"context parallel: choose a style of {CP_STYLES} and a split of "
            f"{CP_SPLITS}, not {style!r} and {split!r}"
        )
    if seq_len % chunks:
        raise LayoutError(
            f"the {split} split cuts the {seq_len}-token sequence into {chunks} "
            f"chunks for {cp} context-parallel ranks: make the sequence length a "
            f"multiple of {chunks}"
        )
    if style == "ulysses" and n_head % cp:
        raise LayoutError(
            f"Ulysses shares out the attention heads (of each tensor-parallel "
            f"rank: {n_head}) over {cp} context-parallel ranks: use a cp size "
            f"that divides {n_head}, or --cp-style ring"
        )


def check_pipeline(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1):
    """A known schedule over at least 2 stages; interleaved: 2+ chunks per rank and the
    microbatches in whole groups of pp."""
    v = virtual_stages
    m = microbatches
    interleaved = schedule == "interleaved"
    for wrong, message in [
        (
            schedule not in SCHEDULES,
            f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}",
        ),
        (pp < 2, f"a pipeline needs at least 2 stages, got --pp {pp}"),
        (m < 1, f"--microbatches must be at least 1, got {m}"),
        (v < 1, f"--virtual-stages must be at least 1, got {v}"),
        (
            not interleaved and v != 1,
            f"--virtual-stages {v} needs --schedule interleaved (the "
            f"{schedule} schedule runs one chunk per rank)",
        ),
        (
            interleaved and v < 2,
            "the interleaved schedule needs --virtual-stages of at least 2 "
            "(with 1 chunk per rank it is plain 1f1b)",
        ),
        (
            interleaved and m % pp,
            f"the interleaved schedule runs microbatches in groups of "
            f"p={pp}, but --microbatches is {m}: use a multiple of {pp}",
        ),
    ]:
        if wrong:
            raise LayoutError(message)


def check_pipeline_depth(n_layer: int, chunks: int) -> None:
    """Every model chunk (pp × virtual stages of them) needs at least one layer."""
    if chunks > n_layer:
        raise LayoutError(
            f"{chunks} pipeline chunks (--pp × --virtual-stages) but the model has "
            f"only {n_layer} layers: use at most {n_layer} chunks or more layers "
            "(--n-layer)"
        )


def check_experts(n_experts: int | None, ep: int, dp: int) -> None:
    """Expert parallel shares out each layer's experts (a whole number on each of ep ranks)
    among ep of the dp ranks (`n_experts` None: the model is not known yet, only the dp part)."""
    experts = "" if n_experts is None else f" --moe-experts ({n_experts}) and"
    if ep > 1 and n_experts == 0:
        raise LayoutError(
            f"--ep {ep} shares out a mixture of experts, and this model has none: give "
            "--moe-experts E (a multiple of --ep) or leave --ep out"
        )
    if ep > 1 and (dp % ep or n_experts is not None and (not n_experts or n_experts % ep)):
        raise LayoutError(
            f"--ep {ep} must divide{experts} --dp ({dp}): expert parallel shares out each "
            "layer's experts among dp ranks"
        )


def check_sizes_and_choices(layout: Layout) -> None:
    """Each count at least 1 and each choice one the flags offer (for layouts made in code)."""
    for f in dataclasses.fields(Layout):
        value = getattr(layout, f.name)
        if f.metadata.get("type") is COUNT and value is not None and value < 1:
            raise LayoutError(f"{flag(f.name)} must be at least 1, got {value}")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            choices = ", ".join(map(str, f.metadata["choices"]))
            raise LayoutError(f"{flag(f.name)} must be one of {choices}, got {value!r}")
    if not layout.bucket_mb >= 0:
        raise LayoutError(f"--bucket-mb must be at least 0, got {layout.bucket_mb}")


def validate(layout: Layout, model: ModelConfig, world_size: int | None = None, runs=True):
    """Raise LayoutError, one sentence, unless `layout` can train `model` on `world_size`
    processes; `runs`: also unless hplab's strategies compose it (the planner passes False)."""
    check_sizes_and_choices(layout)
    check_model(model)
    check_mesh(layout, world_size)
    check_batch(layout)
    if runs:
        for refused, settings, reason in REFUSALS:  # (hplab/refusals.py)
            if refused(layout, model):
                raise LayoutError(f"not supported: {reason}", settings)
    check_experts(model.n_experts, layout.ep, layout.dp)
    if layout.tp > 1:
        seq_len = model.n_positions if layout.sequence_parallel else None
        c = layout
        check_tensor_parallel(model.n_head, model.n_embd, c.tp, seq_len, c.cp, model.kv_heads)
    if layout.cp > 1:  # (Ulysses shares each tensor-parallel rank's heads)
        heads = model.n_head // layout.tp
        c = layout
        check_context_parallel(model.n_positions, heads, c.cp, c.cp_style, c.cp_split)
    if layout.pp > 1:
        check_pipeline(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
        check_pipeline_depth(model.n_layer, layout.pp * layout.virtual_stages)
