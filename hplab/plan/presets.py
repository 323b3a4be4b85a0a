"""What the planner plans for: the models (hplab's presets, GPT-3's and Megatron's), the
batch each was trained with, the GPUs and their links (`Cluster`), and what fraction of the
datasheet the software reaches (`Efficiency`). Sources: see `hplab.plan`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hplab.config import ModelConfig
from hplab.presets import HPLAB_PRESETS

GB = 1e9
GIB = 2**30


def paper_model(name: str, L: int, h: int, a: int, V: int) -> ModelConfig:
    """A model of the papers: sequences of 2048 tokens, and a forward pass that keeps dropout
    masks and the s×s attention matrices (no FlashAttention); GPT-2's BPE."""
    shape = dict(n_layer=L, n_embd=h, n_head=a, n_positions=2048, vocab_size=V)
    return ModelConfig(**shape, tokenizer="gpt2", dropout=True, flash_attention=False, name=name)


#: [GPT-3] Table 2.1 (context 2048, GPT-2 BPE); batch sizes are the paper's tokens ÷ 2048. Two
#: rows are inconsistent: 1.3B lists 24 heads of 128 for d_model 2048 (16 fit), 13B lists
#: d_model 5140 (5120 = 40 × 128 fits). We use what fits. Columns: name, L, h, heads, batch.
GPT3_SIZES = [
    ("gpt3-125m", 12, 768, 12, 256),
    ("gpt3-350m", 24, 1024, 16, 256),
    ("gpt3-760m", 24, 1536, 16, 256),
    ("gpt3-1.3b", 24, 2048, 16, 512),
    ("gpt3-2.7b", 32, 2560, 32, 512),
    ("gpt3-6.7b", 32, 4096, 32, 1024),
    ("gpt3-13b", 40, 5120, 40, 1024),
    ("gpt3-175b", 96, 12288, 96, 1536),
]
GPT3_PRESETS = {name: paper_model(name, L, h, a, 50257) for name, L, h, a, _ in GPT3_SIZES}

#: [PTD-P] Table 1 (vocabulary 51,200, sequence 2048), with the paper's global batch sizes.
#: Columns as the paper's: name, n_head, n_embd, n_layer, global batch.
MEGATRON_2021_SIZES = [
    ("megatron-1.7b", 24, 2304, 24, 512),
    ("megatron-3.6b", 32, 3072, 30, 512),
    ("megatron-7.5b", 32, 4096, 36, 512),
    ("megatron-18b", 48, 6144, 40, 1024),
    ("megatron-39b", 64, 8192, 48, 1536),
    ("megatron-76b", 80, 10240, 60, 1792),
    ("megatron-146b", 96, 12288, 80, 2304),
    ("megatron-310b", 128, 16384, 96, 2160),
    ("megatron-530b", 128, 20480, 105, 2520),
    ("megatron-1t", 160, 25600, 128, 3072),
]
MEGATRON_2021_PRESETS = {
    name: paper_model(name, L, h, a, 51200) for name, a, h, L, _ in MEGATRON_2021_SIZES
}

#: Llama 3 (Meta's released config.json files; vocabulary 128,256, sequence 8,192, 8 K/V heads,
#: RoPE θ 500,000, untied head). Columns: name, n_layer, n_embd, n_head, intermediate_size.
LLAMA3_SIZES = [
    ("llama3-8b", 32, 4096, 32, 14336),
    ("llama3-70b", 80, 8192, 64, 28672),
    ("llama3-405b", 126, 16384, 128, 53248),
]
LLAMA3_PRESETS = {
    name: ModelConfig(
        arch="llama",
        vocab_size=128256,
        n_positions=8192,
        n_embd=h,
        n_layer=L,
        n_head=a,
        n_kv_head=8,
        intermediate_size=inner,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        tokenizer="llama3",
        name=name,
    )  # fmt: skip
    for name, L, h, a, inner in LLAMA3_SIZES
}

#: The global batch, in sequences, the planner assumes for a preset when the command line gives
#: none (a batch is how a model is trained, not part of its description): the papers' own.
BATCH_SIZES = {row[0]: row[-1] for row in GPT3_SIZES + MEGATRON_2021_SIZES}
DEFAULT_BATCH_SIZE = 8  # hplab's presets, and any other model


def default_batch_size(model: ModelConfig) -> int:
    """The preset's global batch (`BATCH_SIZES`), else 8 sequences."""
    return BATCH_SIZES.get(model.name, DEFAULT_BATCH_SIZE)


def model_presets() -> dict[str, ModelConfig]:
    """hplab's own presets (`formulas.HPLAB_PRESETS`, as `hplab.models` builds them: no dropout,
    scaled-dot-product attention) plus the GPT-3, Megatron and Llama 3 sizes."""
    presets = {name: ModelConfig(**c, name=name) for name, c in HPLAB_PRESETS.items()}
    return {**presets, **GPT3_PRESETS, **MEGATRON_2021_PRESETS, **LLAMA3_PRESETS}


@dataclass(frozen=True)
class GPU:
    """Datasheet numbers. `peak_tflops` is dense (no sparsity) per precision; links are per
    GPU and per direction: NVLink inside a node, the GPU's own network card between nodes."""

    name: str
    memory_bytes: float
    peak_tflops: dict
    hbm_gbps: float
    nvlink_gbps: float
    network_gbps: float
    pcie_gbps: float


GPU_PRESETS = {
    g.name: g
    for g in [
        # A100 SXM: 312 TFLOP/s bf16/fp16 tensor cores, 19.5 fp32; NVLink3 600 GB/s both ways;
        # one HDR InfiniBand card (200 Gb/s = 25 GB/s) per GPU as in DGX A100.
        GPU("a100-40g", 40 * GIB, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 1555, 300, 25, 32),
        GPU("a100-80g", 80 * GIB, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 2039, 300, 25, 32),
        # H100 / H200 SXM: 989 TFLOP/s bf16 dense, 67 fp32; NVLink4 900 GB/s both ways;
        # NDR 400 Gb/s.
        GPU("h100-80g", 80 * GIB, {"bf16": 989, "fp16": 989, "fp32": 67}, 3350, 450, 50, 64),
        GPU("h200", 141e9, {"bf16": 989, "fp16": 989, "fp32": 67}, 4800, 450, 50, 64),
    ]
}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    intra_node_gbps: float | None = None  # per GPU per direction; default: the GPU's NVLink
    inter_node_gbps: float | None = None  # per GPU per direction; default: its network card
    intra_latency_s: float = 5e-6  # α of one ring step inside a node
    inter_latency_s: float = 15e-6  # α of one ring step across nodes


@dataclass(frozen=True)
class Efficiency:
    """What fraction of the datasheet the software reaches: assumptions, not measurements.
    The two compute numbers were set once, for every model and layout, so that the planner
    reproduces [PTD-P] Table 1 (tests/test_plan.py)."""

    gemm: float = 0.62  # fraction of peak FLOP/s the transformer's matrix multiplies reach
    elementwise_passes: float = 6.0  # norms, GeLU, softmax, residuals: HBM passes over acts
    comm: float = 0.8  # fraction of link bandwidth a collective reaches (NCCL bus bandwidth)
    dp_overlap: float = 0.0  # fraction of data-parallel (and ZeRO) traffic hidden by compute
    tp_overlap: float = 0.0  # same for tensor-parallel collectives (Megatron 2021: none)
    cp_overlap: float = 0.0  # same for the ring's sends (posted before each block's compute)
    usable_memory: float = 0.9  # of HBM (the rest: CUDA context, fragmentation, buffers)
    cpu_adam_params_per_s: float = 1e9  # optimizer updates per second on the host (--offload)

    def __post_init__(self):
        for name, value in vars(self).items():
            if problem := efficiency_problem(name, value):
                flag = "--eff-" + name.replace("_", "-")
                raise ValueError(f"Efficiency.{name} ({flag}) {problem}")


# What each assumption can physically be: (lowest, highest, whether the lowest is allowed). A
# fraction of the datasheet is above 0 and at most 1 (an MFU of 304% is no plan); a share of
# traffic hidden is from 0 (none) to 1 (all); a count of passes or of updates per second is a
# positive, finite number.
EFFICIENCY_RANGES = {
    "gemm": (0.0, 1.0, False),
    "elementwise_passes": (0.0, math.inf, True),
    "comm": (0.0, 1.0, False),
    "dp_overlap": (0.0, 1.0, True),
    "tp_overlap": (0.0, 1.0, True),
    "cp_overlap": (0.0, 1.0, True),
    "usable_memory": (0.0, 1.0, False),
    "cpu_adam_params_per_s": (0.0, math.inf, False),
}


def efficiency_problem(name: str, value: float) -> str | None:
    """What is wrong with `value` for the assumption `name` ("must be ..., got ..."), or None."""
    low, high, low_allowed = EFFICIENCY_RANGES[name]
    above_low = value >= low if low_allowed else value > low
    if above_low and value <= high and math.isfinite(value):  # (NaN fails every comparison)
        return None
    if not math.isfinite(high):
        wanted = f"a finite number {'from' if low_allowed else 'above'} {low:g}"
    elif low_allowed:
        wanted = f"from {low:g} to {high:g}"
    else:
        wanted = f"above {low:g} and at most {high:g}"
    return f"must be {wanted}, got {value:g}"
