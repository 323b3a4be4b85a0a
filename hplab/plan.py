"""The planner: how much memory a layout needs on each GPU, how long a step takes, and why.

What hplab measures in its runs (memory by kind, time, bytes sent) this file predicts with the
papers' formulas (`hplab.formulas`), so a learner can put the two side by side, then ask the
formulas about clusters no laptop has:

    python -m hplab.plan --model gpt2 --dp 8 --zero 1 --precision bf16 --gpu a100-80g
    python -m hplab.plan --model gpt3-175b --search --gpus 1024 --gpu a100-80g
    python -m hplab.plan --params 7.5e9 --dp 64 --zero 3 --precision bf16
    python -m hplab.plan ... --json          # the same numbers for a notebook

Memory per GPU = model states (parameters, gradients, optimizer state, fp32 master weights;
sharded by ZeRO over data parallel, split by tensor, pipeline and expert parallel) +
activations (per layer per microbatch of s/cp tokens × layers on a stage × microbatches the
schedule keeps in flight). Step time = compute of the busiest stage (FLOPs ÷ achievable FLOP/s,
plus memory-bound element-wise work) + tensor-, context- and expert-parallel traffic +
pipeline bubble and sends + the exposed data-parallel and ZeRO traffic. Collectives follow the
α-β model of ring algorithms; ranks are numbered as in `hplab.dist` (tensor parallel innermost,
then context, data (expert parallel within it), pipeline), which decides which groups stay
inside a node's fast links. Every efficiency assumption is a field of `Efficiency`, never
a hidden constant. No torch here: the module loads fast on machines without a GPU.

Sources: [ZeRO] Rajbhandari et al., SC 2020 (memory Sec. 3, 5; communication Sec. 7).
[PTD-P] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (FLOPs; bubble Sec. 2.2; pipeline sends Sec. 4.1; Table 1 TFLOP/s).
[SP] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022
(activations Sec. 4, Table 2). [Ring] Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009.
[ZB] Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024. [GPT-3] Brown et al., 2020.
Context parallel: Liu et al. 2023 (ring attention), Jacobs et al. 2023 (Ulysses). Experts:
Lepikhin et al. 2021 (GShard), Fedus et al. 2022 (Switch Transformers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass, fields, replace

from hplab.config import (  # plan.Layout, plan.RECOMPUTE & co.: the same objects
    RECOMPUTE,
    Layout,
    LayoutError,
    ModelConfig,
    validate,
)

# The formulas live in hplab.formulas; `plan.model_state_bytes` & co. are the same objects.
from hplab.formulas import (  # plan.model_state_bytes & co.
    CP_STYLES,  # noqa: F401
    HPLAB_PRESETS,  # noqa: F401
    PRECISION_BYTES,  # noqa: F401
    SCHEDULES,  # noqa: F401
    activation_bytes_per_layer,  # noqa: F401
    bubble_formula,  # noqa: F401
    bubble_ratio,  # noqa: F401
    collective_time_s,  # noqa: F401
    flops_per_step,  # noqa: F401
    gpt_num_params,  # noqa: F401
    in_flight_microbatches,  # noqa: F401
    model_state_bytes,  # noqa: F401
    moe_all_to_all_bytes,  # noqa: F401
    ring_attention_bytes,  # noqa: F401
    ulysses_bytes,  # noqa: F401
)

GB, GIB = 1e9, 2**30

# --- 1. The model, the cluster and the efficiency assumptions --------------------------------


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

#: The global batch, in sequences, the planner assumes for a preset when the command line gives
#: none (a batch is how a model is trained, not part of its description): the papers' own.
BATCH_SIZES = {row[0]: row[-1] for row in GPT3_SIZES + MEGATRON_2021_SIZES}
DEFAULT_BATCH_SIZE = 8  # hplab's presets, and any other model


def default_batch_size(model: ModelConfig) -> int:
    """The preset's global batch (`BATCH_SIZES`), else 8 sequences."""
    return BATCH_SIZES.get(model.name, DEFAULT_BATCH_SIZE)


def model_presets() -> dict[str, ModelConfig]:
    """hplab's own presets (`formulas.HPLAB_PRESETS`, as `hplab.models` builds them: no dropout,
    scaled-dot-product attention) plus the GPT-3 and Megatron sizes."""
    presets = {name: ModelConfig(**c, name=name) for name, c in HPLAB_PRESETS.items()}
    return {**presets, **GPT3_PRESETS, **MEGATRON_2021_PRESETS}


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


# --- 2. The layout: `config.Layout`, checked by `config.validate` ---------------------------


class PlanError(LayoutError):
    """What the planner cannot answer, though a run might: an unknown preset, a search without
    GPUs, a layout outside its model (interleaved chunks of unequal layers). One line."""


#: The layout's fields a plan reports, in the order of its JSON (the planner does not model
#: `cp_split`, pricing both splits alike, nor `bucket_mb`).
PLANNED_FIELDS = (
    "dp",
    "tp",
    "pp",
    "zero",
    "schedule",
    "virtual_stages",
    "microbatches",
    "batch_size",
    "precision",
    "recompute",
    "sequence_parallel",
    "offload",
    "cp",
    "cp_style",
    "ep",
)


def check_layout(model: ModelConfig, lay: Layout) -> None:
    """Raise LayoutError, one line, unless the layout can run at all (`config.validate`, not
    only what hplab composes today) and the planner models it."""
    validate(lay, model, runs=False)
    chunks = lay.pp * lay.virtual_stages
    if lay.schedule == "interleaved" and lay.pp > 1 and model.n_layer % chunks:
        raise PlanError(
            f"interleaved schedule needs n_layer={model.n_layer} divisible by "
            f"pp×virtual_stages={chunks}"
        )


# --- 3. Memory: parameters per stage [ZeRO], activations per GPU [SP] ------------------------


def params_per_stage(model: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> dict:
    """Parameters one GPU holds on the first and on the last pipeline stage (dense), and of
    experts on either (`experts`). Tensor parallel ([PTD-P] Sec. 2.3) splits QKV, the attention
    projection, both MLP matrices, the column-parallel biases (12h² + 7h per block) and the
    embedding's vocabulary; layer norms, row-parallel biases (6h per block) and position
    embeddings stay whole. Pipeline parallel splits the blocks (the busiest stage holds
    ceil(L/pp)); the first stage also holds the embeddings, the last the final layer norm and a
    copy of the tied LM head (as Megatron ties them). A mixture of experts swaps each MLP for a
    router h·E (whole) and E experts, each split by tp as the MLP and E/ep of them per GPU."""
    h, V, S, E = model.n_embd, model.vocab_size, model.seq_len, model.n_experts
    mlp = (8 * h * h + 4 * h) / tp + h  # h → 4h column-, 4h → h row-parallel
    blocks = math.ceil(model.n_layer / pp)
    experts = blocks * mlp * E / ep
    block = (4 * h * h + 3 * h) / tp + 5 * h + (h * E if E else mlp)  # dense
    embed = V * h / tp + S * h
    head = 2 * h + (V * h / tp if pp > 1 else 0)  # tied: no second copy on one stage
    first = blocks * block + embed + (head if pp == 1 else 0)  # one stage holds all of it
    last = blocks * block + (embed if pp == 1 else 0) + head
    return {
        "first": first,
        "last": last,
        "experts": experts,
        "blocks_per_stage": blocks,
        "block": block + experts / blocks,
    }  # what ZeRO-3 gathers


def activation_memory(model: ModelConfig, lay: Layout) -> dict:
    """Activation bytes per GPU on the first and last pipeline stage, and for one microbatch.
    Beyond the blocks ([SP] Sec. 4.3), the first stage keeps the embedding dropout mask (sbh
    bytes, /t with sequence parallel) per microbatch in flight; the last keeps the final layer
    norm's and the LM head's inputs (2·sbh elements, /t with sequence parallel) and the fp32
    logits of the cross-entropy (4·s·b·V/t bytes) for its one microbatch in flight. A block that
    full recompute runs backward holds its activations again (`recompute_working_bytes`).
    Context parallel: a rank holds s/cp tokens; ring attention (or Ulysses) keeps a log-sum-exp
    per row, as FlashAttention, and hplab's its output head-major beside the projection's copy
    of it: b·(s/cp)·h more per layer (K/V blocks in flight not counted)."""
    s, b, h, t = model.seq_len // lay.cp, lay.micro_batch_size, model.n_embd, lay.tp
    act = PRECISION_BYTES[lay.precision][4]
    kw = dict(
        s=s,
        b=b,
        h=h,
        a=model.n_head,
        t=t,
        sequence_parallel=lay.sequence_parallel,
        act_bytes=act,
        dropout=model.dropout,
        flash_attention=model.flash_attention or lay.cp > 1,
        moe_top_k=model.moe_top_k if model.n_experts else 0,
    )
    head_major = s * b * h * act / t if lay.cp > 1 else 0.0
    per_layer = activation_bytes_per_layer(recompute=lay.recompute, **kw) + head_major * (
        lay.recompute != "full"
    )
    unrecomputed = activation_bytes_per_layer(recompute="none", **kw) + head_major  # all of it
    sp_div = t if lay.sequence_parallel else 1
    layers = math.ceil(model.n_layer / lay.pp)
    embed_extra = (s * b * h / sp_div) if model.dropout else 0
    head_extra = 2 * s * b * h * act / sp_div + 4 * s * b * model.vocab_size / t
    k = in_flight_microbatches(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages)
    one = lay.pp == 1  # one stage holds the embedding and the head
    first = k * (per_layer * layers + embed_extra + (head_extra if one else 0))
    last_k = lay.microbatches if lay.schedule == "gpipe" and not one else 1  # in flight there
    last = last_k * (per_layer * layers + (embed_extra if one else 0) + head_extra)
    return {
        "per_layer_bytes": per_layer,
        "first_stage_bytes": first,
        "last_stage_bytes": last,
        "in_flight_microbatches": k,
        "unrecomputed_layer_bytes": unrecomputed,
        "recompute_working_bytes": unrecomputed if lay.recompute == "full" else 0.0,
        "per_microbatch_model_bytes": per_layer * model.n_layer + embed_extra + head_extra,
    }


def group_link(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> tuple:
    """Bandwidth β, latency α and whether it crosses nodes, for a process group of `size`
    ranks spaced `stride` apart [Ring]. Ranks fill nodes in order; a group inside one node
    talks over NVLink. Otherwise each ring crosses nodes; NCCL runs one ring per network card,
    so the k members sharing a node bring k cards: β = min(NVLink, k × card)."""
    g, gpu = cluster.gpus_per_node, cluster.gpu
    intra = (cluster.intra_node_gbps or gpu.nvlink_gbps) * GB
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    if size <= per_node:
        return intra * eff.comm, cluster.intra_latency_s, False
    inter = (cluster.inter_node_gbps or gpu.network_gbps) * GB
    return min(intra, per_node * inter) * eff.comm, cluster.inter_latency_s, True


# --- 4. One plan: memory and time of a layout on a cluster -----------------------------------


def plan(
    model: ModelConfig,
    lay: Layout,
    cluster: Cluster | None = None,
    eff: Efficiency | None = None,
    padded: bool = False,
) -> dict:
    """Memory per GPU, step time and throughput of `lay` on `cluster`. Returns a flat dict
    (the JSON the command line prints); all sizes in bytes, times in seconds."""
    cluster, eff = cluster or Cluster(GPU_PRESETS["a100-80g"]), eff or Efficiency()
    check_layout(model, lay)
    dp, cp, tp, pp, ep, m, b = (
        lay.dp,
        lay.cp,
        lay.tp,
        lay.pp,
        lay.ep,
        lay.microbatches,
        lay.micro_batch_size,
    )
    v = lay.virtual_stages if (lay.schedule == "interleaved" and pp > 1) else 1
    p_bytes, g_bytes, *_, act_bytes = PRECISION_BYTES[lay.precision]
    redo = 2 if lay.recompute == "full" else 1  # full recompute runs each forward twice
    tokens = b * model.seq_len / cp  # per GPU and microbatch

    # --- memory of the worse of the first and the last stage; ZeRO shards over dp, and the
    # experts' states over their dp/ep replicas; replicated over cp (as hplab keeps them) --------
    stage_params = params_per_stage(model, tp, pp, ep)
    experts = stage_params["experts"]
    sharding = (lay.zero, lay.precision, lay.offload, padded)
    expert_states = model_state_bytes(experts, dp // ep, *sharding)
    states = {
        where: {
            k: v + expert_states[k]
            for k, v in model_state_bytes(stage_params[where], dp, *sharding).items()
        }
        for where in ("first", "last")
    }
    acts = activation_memory(model, lay)
    # ZeRO-3 gathers whole blocks: the one in use and the next one, prefetched
    zero3_buffer = 2 * stage_params["block"] * p_bytes if lay.zero == 3 and dp > 1 else 0.0
    totals = {
        where: states[where]["total_bytes"]
        + acts[f"{where}_stage_bytes"]
        + acts["recompute_working_bytes"]
        + zero3_buffer
        for where in ("first", "last")
    }
    worst = max(totals, key=totals.get)
    memory, usable = totals[worst], cluster.gpu.memory_bytes * eff.usable_memory

    # --- compute of the busiest stage, per microbatch ------------------------------------------
    peak = cluster.gpu.peak_tflops[lay.precision] * 1e12
    flops = flops_per_step(model, lay.batch_size, lay.recompute)
    layers = stage_params["blocks_per_stage"]
    head_hw = 3 * flops["head_fwd_flops"]  # LM head forward + backward, per sequence
    block_hw = (flops["hardware_flops"] / lay.batch_size - head_hw) / model.n_layer
    gemm_s = b * (layers * block_hw + head_hw / pp) / (tp * cp) / (peak * eff.gemm)
    passes = eff.elementwise_passes * (4 / 3 if lay.recompute == "full" else 1)
    elementwise_s = passes * layers * acts["unrecomputed_layer_bytes"] / (cluster.gpu.hbm_gbps * GB)
    compute_mb = gemm_s + elementwise_s

    # --- tensor parallel: 2 collectives forward, 2 backward, 2 more if the forward is redone;
    # sequence parallel: all-gather + reduce-scatter, same bytes, twice the latency -------------
    tp_bw, tp_alpha, tp_cross = group_link(cluster, tp, 1, eff)
    tp_msg = tokens * model.n_embd * act_bytes
    op, times = ("all_gather", 2) if lay.sequence_parallel else ("all_reduce", 1)
    tp_mb = (
        (2 + 2 * redo)
        * layers
        * times
        * collective_time_s(op, tp_msg, tp, tp_bw, tp_alpha)
        * (1 - eff.tp_overlap)
    )

    # --- context parallel, per layer: (cp−1)·redo + 2cp−1 ring sends, or 2·redo + 2 all-to-alls
    cp_bw, cp_alpha, cp_cross = group_link(cluster, cp, tp, eff)
    ring = lay.cp_style == "ring"
    sent = (ring_attention_bytes if ring else ulysses_bytes)(
        b, model.seq_len, model.n_embd / tp, cp, act_bytes
    )
    cp_bytes = layers * (redo * sent["forward"] + sent["backward"]) * (cp > 1)
    messages = layers * ((cp - 1) * redo + 2 * cp - 1 if ring else 2 * redo + 2)
    cp_mb = collective_time_s(
        "send" if ring else "all_to_all", cp_bytes, cp, cp_bw, cp_alpha, messages
    ) * (1 - eff.cp_overlap)

    # --- expert parallel, per layer, T·k slots per rank (a forward moves half the formula's slots)
    ep_bw, ep_alpha, ep_cross = group_link(cluster, ep, tp * cp, eff)
    a2a = [
        moe_all_to_all_bytes(slots, slots, model.n_embd, model.n_experts, act_bytes)
        for slots in (tokens * model.moe_top_k, tokens * model.moe_top_k / 2)
    ]
    ep_bytes = layers * (a2a[0] + (redo - 1) * a2a[1]) * (ep > 1)
    ep_mb = collective_time_s("all_to_all", ep_bytes, ep, ep_bw, ep_alpha, layers * (3 * redo + 2))

    # --- pipeline: bubble and point-to-point sends ([PTD-P] Sec. 4.1 scatter/gather: each of
    # the tp ranks sends 1/tp of the activation, then they all-gather over NVLink) --------------
    work_mb = compute_mb + tp_mb + cp_mb + ep_mb
    bubble = bubble_formula(lay.schedule, pp, m, v)  # idle / compute, idle / step
    pp_bw, pp_alpha, pp_cross = group_link(cluster, pp, dp * cp * tp, eff)
    p2p_s = 2 * (m * v + pp - 1) * (pp_alpha + tp_msg / tp / pp_bw) if pp > 1 else 0.0

    # --- data parallel / ZeRO traffic, per step ([ZeRO] Sec. 7): dense gradients over dp, the
    # experts' over their dp/ep replicas; then hplab averages what each rank steps over cp ------
    dp_bw, dp_alpha, dp_cross = group_link(cluster, dp, tp * cp, eff)
    local = max(stage_params["first"], stage_params["last"])
    groups = [
        (local, dp, dp_bw, dp_alpha),
        (experts, dp // ep, *group_link(cluster, dp // ep, tp * cp * ep, eff)[:2]),
    ]
    ar, rs, ag = (
        sum(collective_time_s(op, psi * nbytes, n, bw, alpha) for psi, n, bw, alpha in groups)
        for op, nbytes in (
            ("all_reduce", g_bytes),
            ("reduce_scatter", g_bytes),
            ("all_gather", p_bytes),
        )
    )
    shard = local / dp + experts / (dp // ep) if lay.zero else local + experts  # what it steps
    dp_s = (
        ar,  # DDP: one all-reduce of the gradients
        rs + ag,  # ZeRO-1: reduce-scatter + all-gather, the same volume
        m * rs + ag,  # ZeRO-2 keeps no full gradient: reduce-scatter every microbatch
        # ZeRO-3, every microbatch: gather for forward, (recompute,) backward; scatter grads
        m * ((1 + redo) * ag + rs),
    )[lay.zero] + collective_time_s("all_reduce", shard * g_bytes, cp, cp_bw, cp_alpha)
    dp_exposed = dp_s * (1 - eff.dp_overlap)
    # --offload: gradients down and parameters up over PCIe, Adam on the host
    offload_s = (
        (
            shard * (g_bytes + p_bytes) / (cluster.gpu.pcie_gbps * GB)
            + shard / eff.cpu_adam_params_per_s
        )
        if lay.offload
        else 0.0
    )

    step = m * work_mb + bubble["relative"] * m * work_mb + p2p_s + dp_exposed + offload_s
    tflops = flops["hardware_flops"] / (step * lay.gpus) / 1e12
    model_tflops = flops["model_flops"] / (step * lay.gpus) / 1e12
    return {
        "model": model.name,
        "params": model.num_params(),
        "layout": lay.short(),
        **{k: getattr(lay, k) for k in PLANNED_FIELDS},
        "n_experts": model.n_experts,
        "moe_top_k": model.moe_top_k,
        "micro_batch_size": b,
        "gpus": lay.gpus,
        "gpu": cluster.gpu.name,
        "gpus_per_node": cluster.gpus_per_node,
        "expert_params_per_gpu": experts,
        **{
            k: states[worst][k]
            for k in ("params_bytes", "grads_bytes", "optim_bytes", "master_bytes")
        },
        "cpu_offload_bytes": states[worst]["cpu_bytes"],
        "model_state_bytes_per_gpu": states[worst]["total_bytes"],
        "activation_bytes_per_gpu": acts[f"{worst}_stage_bytes"],
        "activation_bytes_per_microbatch": acts["per_microbatch_model_bytes"],
        "activation_bytes_per_layer": acts["per_layer_bytes"],
        **{k: acts[k] for k in ("in_flight_microbatches", "recompute_working_bytes")},
        "zero3_gather_bytes": zero3_buffer,
        "memory_bytes_per_gpu": memory,
        "worst_stage": worst,
        "usable_bytes_per_gpu": usable,
        "fits": memory <= usable,
        "step_time_s": step,
        **{
            k: m * v
            for k, v in dict(  # per microbatch × m
                compute_s=compute_mb,
                gemm_s=gemm_s,
                elementwise_s=elementwise_s,
                tp_comm_s=tp_mb,
                cp_comm_s=cp_mb,
                ep_comm_s=ep_mb,
                cp_bytes_per_step=cp_bytes,
                ep_all_to_all_bytes_per_step=ep_bytes,
            ).items()
        },
        "bubble_s": bubble["relative"] * m * work_mb,
        "bubble_ratio": bubble["relative"],
        "bubble_fraction": bubble["of_step"],  # of the pipeline
        "pp_comm_s": p2p_s,
        "dp_comm_s": dp_s,
        "dp_comm_exposed_s": dp_exposed,
        "offload_s": offload_s,
        "tp_crosses_nodes": tp_cross,
        "cp_crosses_nodes": cp_cross,
        "ep_crosses_nodes": ep_cross,
        "dp_crosses_nodes": dp_cross,
        "pp_crosses_nodes": pp_cross,
        "model_flops_per_step": flops["model_flops"],
        "hardware_flops_per_step": flops["hardware_flops"],
        "tokens_per_s": lay.batch_size * model.seq_len / step,
        "tflops_per_gpu": tflops,
        "model_tflops_per_gpu": model_tflops,
        "mfu": model_tflops * 1e12 / peak,
        "hfu": tflops * 1e12 / peak,
    }


# --- 5. Search: every feasible layout, ranked, and why the winner wins -----------------------


def candidate_layouts(
    model: ModelConfig,
    gpus: int,
    batch_size: int,
    precision: str = "bf16",
    fixed: dict | None = None,
    allow_offload: bool = False,
):
    """Every layout of `gpus` GPUs that can run: dp·tp·pp = gpus (cp = ep = 1: the search
    splits neither sequences nor experts; plan() takes them), whole heads per tensor-
    parallel rank, a global batch that splits into whole microbatches of 1, 2, 4 or 8, and each
    ZeRO stage, recompute mode, sequence parallel and pipeline schedule (interleaved with 2 to 8
    chunks). `fixed` pins fields of Layout to a value or a tuple of allowed values (e.g.
    {"tp": 8, "schedule": ("1f1b", "gpipe")})."""
    fixed = {
        k: v if isinstance(v, (tuple, list, set, frozenset)) else (v,)
        for k, v in (fixed or {}).items()
    }
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, pp, b in itertools.product(divisors, divisors, (1, 2, 4, 8)):
        dp = gpus // (tp * pp)
        if gpus % (tp * pp) or model.n_head % tp or pp > model.n_layer or batch_size % (dp * b):
            continue
        m = batch_size // dp // b
        scheds = (
            [("1f1b", 1)]
            + [("gpipe", 1), ("zb-h1", 1)] * (pp > 1)
            + [
                ("interleaved", v)
                for v in (2, 3, 4, 6, 8)
                if pp > 1 and model.n_layer % (pp * v) == 0 and m % pp == 0
            ]
        )
        for (schedule, v), zero, rc, sp, off in itertools.product(
            scheds,
            (0, 1, 2, 3)[: 4 if dp > 1 else 1],
            RECOMPUTE,
            (False, True)[: 1 + (tp > 1)],
            (False, True)[: 1 + allow_offload],
        ):
            lay = Layout(
                dp=dp,
                tp=tp,
                pp=pp,
                zero=zero,
                schedule=schedule,
                virtual_stages=v,
                microbatches=m,
                batch_size=batch_size,
                precision=precision,
                recompute=rc,
                sequence_parallel=sp,
                offload=off,
            )
            if all(getattr(lay, k) in allowed for k, allowed in fixed.items()):
                yield lay


def search(
    model: ModelConfig,
    gpus: int,
    cluster: Cluster | None = None,
    eff: Efficiency | None = None,
    batch_size: int | None = None,
    precision: str = "bf16",
    fixed: dict | None = None,
    allow_offload: bool = False,
    tie: float = 0.02,
    comfortable_memory: float = 0.8,
) -> dict:
    """Plan every candidate layout; rank the ones that fit by step time. The planner is good
    to a few percent (tests/test_plan.py), so layouts within `tie` of the fastest count as
    equally fast. Among those the simplest wins, preferring one that leaves headroom (memory
    at most `comfortable_memory` of what is usable): fewer model-parallel ranks (the model stays
    whole on more GPUs), less ZeRO sharding, no recompute, no sequence parallel, no offload,
    the plain 1F1B schedule, bigger microbatches."""
    cluster, eff = cluster or Cluster(GPU_PRESETS["a100-80g"]), eff or Efficiency()
    batch_size = batch_size or default_batch_size(model)
    plans = [
        plan(model, lay, cluster, eff)
        for lay in candidate_layouts(model, gpus, batch_size, precision, fixed, allow_offload)
    ]
    if not plans:
        raise PlanError(
            f"no layout of {gpus} GPUs splits a batch of {batch_size} sequences and "
            f"{model.n_head} heads evenly: change --gpus or --batch-size"
        )
    feasible = sorted((p for p in plans if p["fits"]), key=lambda p: p["step_time_s"])
    winner = None
    if feasible:
        fastest = feasible[0]["step_time_s"]
        ties = [p for p in feasible if p["step_time_s"] <= fastest * (1 + tie)]
        roomy = [
            p
            for p in ties
            if p["memory_bytes_per_gpu"] <= comfortable_memory * p["usable_bytes_per_gpu"]
        ]
        winner = min(
            roomy or ties,
            key=lambda p: (
                p["tp"] * p["pp"],
                p["zero"],
                RECOMPUTE.index(p["recompute"]),
                p["sequence_parallel"],
                p["offload"],
                p["schedule"] != "1f1b",
                p["virtual_stages"],
                -p["micro_batch_size"],
            ),
        )
        feasible.sort(key=lambda p: p is not winner)  # the winner first, the rest by time
    return {
        "model": model.name,
        "params": model.num_params(),
        "gpus": gpus,
        "gpu": cluster.gpu.name,
        "gpus_per_node": cluster.gpus_per_node,
        "batch_size": batch_size,
        "precision": precision,
        "evaluated": len(plans),
        "feasible": len(feasible),
        "winner": winner,
        "ranking": feasible,
        "explanation": explain(winner, plans, gpus, batch_size),
        "_all": plans,
    }


HEADLINE = (
    "model_state_bytes_per_gpu",
    "activation_bytes_per_gpu",
    "memory_bytes_per_gpu",
    "step_time_s",
    "tflops_per_gpu",
    "mfu",
    "layout",
)
TIME_PARTS = {
    "compute_s": "compute",
    "tp_comm_s": "tensor-parallel comm",
    "cp_comm_s": "context-parallel comm",
    "ep_comm_s": "expert all-to-all",
    "bubble_s": "pipeline bubble",
    "pp_comm_s": "pipeline sends",
    "dp_comm_exposed_s": "data-parallel/ZeRO comm",
    "offload_s": "offload",
}
KNOBS = {
    "zero": "ZeRO stage",
    "tp": "tensor parallel",
    "pp": "pipeline parallel",
    "recompute": "recompute",
    "sequence_parallel": "sequence parallel",
    "schedule": "schedule",
    "micro_batch_size": "micro-batch size",
}
FAMILIES = {
    "plain DDP": lambda p: p["tp"] == p["pp"] == 1 and p["zero"] == 0,
    "ZeRO only (no TP/PP)": lambda p: p["tp"] == p["pp"] == 1 and p["zero"] > 0,
    "TP + DP (no PP)": lambda p: p["tp"] > 1 and p["pp"] == 1,
    "PP + DP (no TP)": lambda p: p["pp"] > 1 and p["tp"] == 1,
    "PP + TP + DP": lambda p: p["pp"] > 1 and p["tp"] > 1,
}


def _why_slower(alt: dict, best: dict) -> str:
    if not alt["fits"]:
        return (
            f"does not fit: {alt['memory_bytes_per_gpu'] / GB:.0f} GB > "
            f"{alt['usable_bytes_per_gpu'] / GB:.0f} GB usable"
        )
    delta = alt["step_time_s"] - best["step_time_s"]
    if delta <= best["step_time_s"] * 0.005:
        return f"as fast ({alt['memory_bytes_per_gpu'] / GB:.0f} GB)"
    grew = max(TIME_PARTS, key=lambda k: alt[k] - best[k])
    return (
        f"+{delta / best['step_time_s']:.0%} ({TIME_PARTS[grew]} +{alt[grew] - best[grew]:.2g} s)"
    )


def _best(plans: list[dict]) -> dict | None:
    """The fastest that fits, else the one closest to fitting."""
    fits = [p for p in plans if p["fits"]]
    return (
        min(fits, key=lambda p: p["step_time_s"])
        if fits
        else min(plans, key=lambda p: p["memory_bytes_per_gpu"], default=None)
    )


def explain(winner: dict | None, plans: list[dict], gpus: int, batch_size: int) -> list[str]:
    """Why the winner wins, from the numbers: where its step time goes, then for each family
    and each knob the best layout with another setting and what makes it slower (or not fit).
    Without a winner: what the smallest layout would need."""
    w = winner or _best(plans)
    mem, usable = w["memory_bytes_per_gpu"] / GB, w["usable_bytes_per_gpu"] / GB
    if winner is None:
        return [
            f"no layout fits: the smallest needs {mem:.1f} GB per GPU ({w['layout']}) but "
            f"only {usable:.1f} GB are usable; add GPUs, use a bigger GPU, or --offload"
        ]
    links = [
        f"{g} group {'crosses nodes' if w[f'{g}_crosses_nodes'] else 'stays in a node'}"
        for g in ("tp", "dp", "pp")
        if w[g] > 1
    ]
    lines = [
        f"winner: {w['layout']}: {w['step_time_s']:.3g} s/step, {w['tflops_per_gpu']:.0f} "
        f"TFLOP/s per GPU, MFU {w['mfu']:.0%}, {mem:.1f} GB of {usable:.0f} GB usable",
        "  step = "
        + ", ".join(f"{name} {w[k]:.3g} s" for k, name in TIME_PARTS.items() if w[k] > 0),
    ]
    lines += ["  " + "; ".join(links)] * bool(links) + ["best of each family:"]
    for name, member in FAMILIES.items():
        best = _best([p for p in plans if member(p)])
        if best is not None:
            tag = "winner" if best["layout"] == w["layout"] else _why_slower(best, w)
            lines.append(f"  {name:22s} {best['layout']:44s} {tag}")
        elif name == "plain DDP":
            states = model_state_bytes(w["params"], gpus, 0, w["precision"])["total_bytes"]
            lines.append(
                f"  {name:22s} dp={gpus} cannot split the batch of {batch_size}; "
                f"its model states alone would need {states / GB:.0f} GB per GPU"
            )
    lines.append("changing one choice of the winner (the rest kept where possible):")
    for knob, name in KNOBS.items():
        alts = [
            f"{val}: {_why_slower(_best(_neighbours(w, plans, knob, val)), w)}"
            for val in sorted({p[knob] for p in plans})
            if val != w[knob]
        ]
        lines += [f"  {name} = {w[knob]}: " + "; ".join(alts)] * bool(alts)
    return lines


def _neighbours(w: dict, plans: list[dict], knob: str, value) -> list[dict]:
    """Plans with `knob` = value that keep the most of the winner's other choices (dp and the
    number of microbatches follow from tp, pp and the micro-batch size)."""
    keys = [k for k in (*KNOBS, "virtual_stages", "offload") if k != knob]
    changed = {id(p): sum(p[k] != w[k] for k in keys) for p in plans if p[knob] == value}
    fewest = min(changed.values(), default=0)
    return [p for p in plans if changed.get(id(p)) == fewest]


# --- 6. Reports for humans, and the command line ---------------------------------------------


def _rows(pairs, width: int = 34) -> list[str]:
    """One table row per (label, bytes): GB, or TB from 1e12 on."""
    return [
        f"  {label:<{width}s}" + (f"{x / GB:9.3f} GB" if x < 1e12 else f"{x / 1e12:9.3f} TB")
        for label, x in pairs
    ]


def format_plan(p: dict) -> str:
    moe = f", {p['n_experts']} experts, top-{p['moe_top_k']}" * bool(p["n_experts"])
    out = [
        f"{p['model']} (Ψ = {p['params'] / 1e9:.3g} B{moe}) on {p['gpus']} × {p['gpu']} "
        f"({p['gpus_per_node']} per node): {p['layout']}, {p['precision']}",
        "memory per GPU" + f" (worst: {p['worst_stage']} pipeline stage)" * (p["pp"] > 1),
    ]
    rows = {
        "params_bytes": "parameters",
        "grads_bytes": "gradients",
        "optim_bytes": "optimizer state",
        "master_bytes": "fp32 master weights",
        "activation_bytes_per_gpu": f"activations ({p['in_flight_microbatches']:g} mb in flight)",
        "recompute_working_bytes": "recompute working block",
        "zero3_gather_bytes": "ZeRO-3 gathered blocks",
        "memory_bytes_per_gpu": "total",
        "usable_bytes_per_gpu": f"usable ({p['gpu']})",
    }  # (params, acts, totals: never 0)
    out += _rows((label, p[k]) for k, label in rows.items() if p[k])
    out[-1] += "  fits" if p["fits"] else "  DOES NOT FIT"
    out += _rows([("offloaded to host", p["cpu_offload_bytes"])] * bool(p["cpu_offload_bytes"]))
    out.append(f"time per step: {p['step_time_s']:.4g} s")
    out += [
        f"  {label:<34s}{p[key]:10.4g} s  {p[key] / p['step_time_s']:6.1%}"
        for key, label in TIME_PARTS.items()
        if p[key]
    ]  # (compute: never 0)
    if p["dp_comm_s"] and p["dp_comm_exposed_s"] < p["dp_comm_s"]:
        out.append(
            f"  (data-parallel traffic {p['dp_comm_s']:.3g} s, of which hidden "
            f"{p['dp_comm_s'] - p['dp_comm_exposed_s']:.3g} s)"
        )
    out += [
        f"  ({key[:2]} group: each GPU sends {p[key] / GB:.4g} GB per step)"
        for key in ("cp_bytes_per_step", "ep_all_to_all_bytes_per_step")
        if p[key]
    ]
    out.append(
        f"throughput: {p['tokens_per_s']:.4g} tokens/s, {p['tflops_per_gpu']:.1f} TFLOP/s "
        f"per GPU (with recompute), {p['model_tflops_per_gpu']:.1f} model TFLOP/s, "
        f"MFU {p['mfu']:.1%}"
    )
    return "\n".join(out)


def format_search(res: dict, top: int = 10) -> str:
    out = [
        f"{res['model']} (Ψ = {res['params'] / 1e9:.3g} B) on {res['gpus']} × {res['gpu']} "
        f"({res['gpus_per_node']} per node), global batch {res['batch_size']}, "
        f"{res['precision']}: {res['feasible']} of {res['evaluated']} layouts fit "
        "(within 2% of the fastest counts as a tie; the simplest of those is ranked first)"
    ]
    if res["ranking"]:
        out.append(f"{'#':>3} {'layout':44s} {'GB/GPU':>7} {'s/step':>8} {'TFLOP/s':>8} {'MFU':>5}")
        out += [
            f"{i:>3} {p['layout']:44s} {p['memory_bytes_per_gpu'] / GB:7.1f} "
            f"{p['step_time_s']:8.3g} {p['tflops_per_gpu']:8.1f} {p['mfu']:5.1%}"
            for i, p in enumerate(res["ranking"][:top], 1)
        ]
    return "\n".join(out + res["explanation"])


def _positive(kind):
    """An argparse type: a number above 0 (a count: at least 1), else one line and exit 2."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hplab.plan", description=__doc__.split("\n\n")[0])
    ap.error = lambda message: ap.exit(2, f"hplab.plan: error: {message}\n")  # one line, exit 2
    n, real, on = dict(type=_positive(int)), dict(type=_positive(float)), dict(action="store_true")
    preset = dict(action=argparse.BooleanOptionalAction, default=None)
    for title, flags in {
        "model (as hplab/train.py)": {
            "--model": dict(
                default="gpt2",
                help="preset: hplab's tiny/gpt2/gpt2-medium, "
                "gpt3-125m ... gpt3-175b, megatron-1.7b ... megatron-1t",
            ),
            "--n-layer": n,
            "--n-embd": n,
            "--n-head": n,
            "--seq-len": dict(n, dest="n_positions", metavar="SEQ_LEN"),
            "--vocab-size": n,
            "--moe-experts": dict(n, dest="n_experts", help="a mixture of this many experts"),
            "--moe-top-k": dict(n, dest="moe_top_k", help="experts per token (default 2)"),
            "--dropout": dict(preset, help="count dropout masks (default: as the preset)"),
            "--flash-attention": dict(
                preset, help="attention keeps no s×s matrices (default: as the preset)"
            ),
            "--params": dict(
                real,
                help="only the model-state memory of this many "
                "parameters (with --dp, --zero, --precision)",
            ),
        },
        "layout (as hplab/train.py)": {
            "--dp": n,
            "--tp": dict(n, default=1),
            "--pp": dict(n, default=1),
            "--cp": dict(n, default=1),
            "--cp-style": dict(default="ring", choices=CP_STYLES),
            "--ep": dict(n, default=1, help="expert parallel, among the --dp ranks"),
            "--zero": dict(type=int, default=0, choices=(0, 1, 2, 3)),
            "--schedule": dict(default="1f1b", choices=SCHEDULES),
            "--virtual-stages": dict(n, default=1),
            "--microbatches": n,
            "--batch-size": dict(n, help="global, in sequences"),
            "--precision": dict(
                choices=tuple(PRECISION_BYTES),
                help="default: fp32 for hplab's presets, bf16 for the others",
            ),
            "--recompute": dict(on, help="full activation recompute"),
            "--selective-recompute": dict(on, help="recompute only the attention scores [SP]"),
            "--sequence-parallel": on,
            "--offload": dict(on, help="optimizer state on the host"),
            "--padded": dict(
                on, help="ZeRO shards padded to a multiple of dp, as hplab allocates them"
            ),
        },
        "cluster": {
            "--gpu": dict(default="a100-80g", choices=tuple(GPU_PRESETS)),
            "--gpus": dict(n, help="total GPUs (required with --search)"),
            "--gpus-per-node": dict(n, default=8),
            "--intra-bw": dict(real, help="GB/s per GPU inside a node (default NVLink)"),
            "--inter-bw": dict(real, help="GB/s per GPU between nodes (default its NIC)"),
        },
        "efficiency assumptions": {
            "--eff-" + f.name.replace("_", "-"): dict(  # overlaps may be 0
                type=_positive(float) if f.default else float,
                default=f.default,
                dest="eff_" + f.name,
            )
            for f in fields(Efficiency)
        },
        "output": {
            "--search": dict(on, help="rank every layout of --gpus GPUs"),
            "--top": dict(n, default=10),
            "--json": on,
        },
    }.items():
        group = ap.add_argument_group(title)
        for flag, kwargs in flags.items():
            group.add_argument(flag, **kwargs)
    return ap


def _run(args) -> tuple[dict, str]:
    """The result of the command line (its JSON) and the report for humans."""
    if args.params is not None:  # model states of a bare parameter count
        dp, precision = args.dp or 1, args.precision or "bf16"
        st = model_state_bytes(
            args.params / (args.tp * args.pp), dp, args.zero, precision, args.offload, args.padded
        )
        res = {
            "params": args.params,
            "dp": dp,
            "tp": args.tp,
            "pp": args.pp,
            "zero": args.zero,
            "precision": precision,
            **st,
            "cpu_offload_bytes": st["cpu_bytes"],
            "model_state_bytes_per_gpu": st["total_bytes"],
        }
        rows = _rows(
            [(k[:-6].replace("cpu", "on host"), x) for k, x in st.items() if x or k != "cpu_bytes"],
            8,
        )
        return res, "\n".join(
            [
                f"model states of Ψ = {args.params:.4g} parameters, {precision}, "
                f"ZeRO-{args.zero} over dp={dp} (per GPU) [ZeRO Sec. 5]",
                *rows,
            ]
        )
    presets = model_presets()
    if args.model not in presets:
        raise PlanError(f"unknown model preset {args.model!r}: choose one of {', '.join(presets)}")
    model = replace(
        presets[args.model],
        **{
            k: v
            for k, v in vars(args).items()
            if v is not None and k in ModelConfig.__dataclass_fields__
        },
    )
    precision = args.precision or (
        "bf16" if args.model.startswith(("gpt3-", "megatron-")) else "fp32"
    )
    cluster = Cluster(GPU_PRESETS[args.gpu], args.gpus_per_node, args.intra_bw, args.inter_bw)
    eff = Efficiency(**{f.name: getattr(args, "eff_" + f.name) for f in fields(Efficiency)})
    batch = args.batch_size or default_batch_size(model)
    if args.search:
        if not args.gpus:
            raise PlanError("--search needs --gpus N")
        res = search(model, args.gpus, cluster, eff, batch, precision, allow_offload=args.offload)
        del res["_all"]
        text = format_search(res, args.top)
        res["ranking"] = res["ranking"][: args.top]
        # the headline numbers of the winner, at top level for notebooks
        return {**res, **{k: res["winner"][k] for k in HEADLINE if res["winner"]}}, text
    tp, pp, cp = args.tp, args.pp, args.cp
    dp = args.dp or (args.gpus // (cp * tp * pp) if args.gpus else 1)
    if args.gpus and dp * cp * tp * pp != args.gpus:
        raise PlanError(f"dp×cp×tp×pp = {dp}×{cp}×{tp}×{pp} ≠ --gpus {args.gpus}")
    recompute = "full" if args.recompute else ("selective" if args.selective_recompute else "none")
    m = args.microbatches or (max(1, batch // dp) if pp > 1 else 1)
    lay = Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        zero=args.zero,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        microbatches=m,
        batch_size=batch,
        precision=precision,
        recompute=recompute,
        sequence_parallel=args.sequence_parallel,
        offload=args.offload,
        cp=cp,
        cp_style=args.cp_style,
        ep=args.ep,
    )
    res = plan(model, lay, cluster, eff, args.padded)
    return res, format_plan(res)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        res, text = _run(args)
    except LayoutError as e:  # (PlanError too)
        parser.error(str(e))  # one line, exit code 2, like a bad flag
    print(json.dumps(res, indent=2, default=str, ensure_ascii=False) if args.json else text)
    return 0


if __name__ == "__main__":
    main()
