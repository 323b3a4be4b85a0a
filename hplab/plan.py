"""The planner: how much memory a layout needs on each GPU, how long a step takes, and why.

Everything hplab measures in its runs (memory by kind, time, communicated bytes) this file
predicts with formulas from the papers, so a learner can put the two side by side and then ask
the formulas about clusters no laptop has:

    python -m hplab.plan --model gpt2 --dp 8 --zero 1 --precision bf16 --gpu a100-80g
    python -m hplab.plan --model gpt3-175b --search --gpus 1024 --gpu a100-80g
    python -m hplab.plan --params 7.5e9 --dp 64 --zero 3 --precision bf16
    python -m hplab.plan ... --json          # the same numbers for a notebook

The model in one paragraph. Memory per GPU = model states (parameters, gradients, optimizer
state, fp32 master weights; sharded by ZeRO over data parallel, split by tensor and pipeline
parallel) + activations (per layer per microbatch, times the layers on a stage, times the
microbatches a pipeline schedule keeps in flight). Step time = the compute of the busiest stage
(FLOPs ÷ achievable FLOP/s, plus memory-bound element-wise work) + tensor-parallel collectives
(not overlapped) + pipeline bubble and point-to-point sends + the exposed part of the
data-parallel gradient (and ZeRO parameter) traffic. Collectives follow the α-β cost model of
ring algorithms; the GPU ranks are numbered as in `hplab.dist` (tensor parallel innermost, then
data, then pipeline), which decides which groups stay inside a node's fast links.

Sources, cited again where used:
  [ZeRO]   Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
           Models", SC 2020 (model-state memory, Sec. 3 and 5; communication volume, Sec. 7).
  [PTD-P]  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
           Using Megatron-LM", SC 2021 (FLOPs, Eq. 3 and Appendix; bubble, Sec. 2.2;
           scatter/gather of pipeline sends, Sec. 4.1; Table 1 of achieved TFLOP/s).
  [SP]     Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
           2022 (activation bytes per layer, Sec. 4, Table 2; MFU vs HFU, Sec. 6).
  [Ring]   Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
           in MPICH", 2005; Patarasuk & Yuan 2009 (bandwidth-optimal ring all-reduce).
  [ZB]     Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (ZB-H1 schedule).
  [Flash]  Dao et al., "FlashAttention", NeurIPS 2022 (attention keeps O and logsumexp only).
  [GPT-3]  Brown et al., "Language Models are Few-Shot Learners", 2020 (Table 2.1 sizes).

Every efficiency assumption is a field of `Efficiency`; nothing is a hidden constant. This
module imports no torch (it must load fast and run on machines without a GPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass, replace

# The formulas themselves live in hplab.formulas (one home, shared with pp, viz, lab, comm);
# the planner composes them. Imported by name so `plan.model_state_bytes` & co. keep working.
from hplab.formulas import (HPLAB_PRESETS, PRECISION_BYTES, SCHEDULES,  # noqa: F401
                            activation_bytes_per_layer, bubble_ratio, collective_time_s,
                            flops_per_step, gpt_num_params, in_flight_microbatches,
                            model_state_bytes)

#: Lab 07's exercise and checker call the *ratio* (p−1)/m "bubble_fraction" (idle / compute);
#: elsewhere a bubble fraction is of the step. Kept under that name for them.
bubble_fraction = bubble_ratio

GB = 1e9
GIB = 2**30

# ---------------------------------------------------------------------------------------------
# 1. The model: a GPT-2-shaped decoder
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory and time. `dropout` and `flash_attention` change what the
    forward pass saves for backward: the papers' models use dropout and store the s×s attention
    matrices; hplab's own GPT has no dropout and uses `scaled_dot_product_attention`, which
    (like FlashAttention) keeps only the output and a log-sum-exp per row."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    vocab_size: int
    dropout: bool = True
    flash_attention: bool = False
    default_batch_size: int = 8  # global batch in sequences, when the command line gives none

    def num_params(self) -> int:
        """Ψ of GPT-2: V·h + S·h + L·(12h² + 13h) + 2h (`formulas.gpt_num_params`)."""
        return gpt_num_params(self.n_layer, self.n_embd, self.vocab_size, self.seq_len)


#: [GPT-3] Table 2.1 (context 2048, GPT-2 BPE). Batch sizes are the paper's tokens ÷ 2048.
#: The table is inconsistent in two rows: 1.3B lists 24 heads of 128 for d_model 2048 (16 heads
#: fit), and 13B lists d_model 5140 (5120 = 40 heads × 128 fits). We use what fits.
#: Columns: name, n_layer, n_embd, n_head, global batch.
GPT3_PRESETS = {name: ModelShape(name, L, h, a, 2048, 50257, default_batch_size=batch)
                for name, L, h, a, batch in [
    ("gpt3-125m", 12, 768, 12, 256), ("gpt3-350m", 24, 1024, 16, 256),
    ("gpt3-760m", 24, 1536, 16, 256), ("gpt3-1.3b", 24, 2048, 16, 512),
    ("gpt3-2.7b", 32, 2560, 32, 512), ("gpt3-6.7b", 32, 4096, 32, 1024),
    ("gpt3-13b", 40, 5120, 40, 1024), ("gpt3-175b", 96, 12288, 96, 1536)]}

#: [PTD-P] Table 1 (vocabulary 51,200, sequence 2048), with the paper's global batch sizes.
#: Columns as the paper's: name, n_head, n_embd, n_layer, global batch.
MEGATRON_2021_PRESETS = {name: ModelShape(name, L, h, a, 2048, 51200, default_batch_size=batch)
                         for name, a, h, L, batch in [
    ("megatron-1.7b", 24, 2304, 24, 512), ("megatron-3.6b", 32, 3072, 30, 512),
    ("megatron-7.5b", 32, 4096, 36, 512), ("megatron-18b", 48, 6144, 40, 1024),
    ("megatron-39b", 64, 8192, 48, 1536), ("megatron-76b", 80, 10240, 60, 1792),
    ("megatron-146b", 96, 12288, 80, 2304), ("megatron-310b", 128, 16384, 96, 2160),
    ("megatron-530b", 128, 20480, 105, 2520), ("megatron-1t", 160, 25600, 128, 3072)]}


def model_presets() -> dict[str, ModelShape]:
    """hplab's own presets (`formulas.HPLAB_PRESETS`, as `hplab.models.gpt` builds them) plus
    the GPT-3 and Megatron-2021 sizes above. hplab's GPT has no dropout and computes attention
    with `scaled_dot_product_attention`, which saves no s×s matrices."""
    presets = {name: ModelShape(name, c["n_layer"], c["n_embd"], c["n_head"], c["n_positions"],
                                c["vocab_size"], dropout=False, flash_attention=True)
               for name, c in HPLAB_PRESETS.items()}
    return {**presets, **GPT3_PRESETS, **MEGATRON_2021_PRESETS}


# ---------------------------------------------------------------------------------------------
# 2. The cluster and the efficiency assumptions
# ---------------------------------------------------------------------------------------------


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


GPU_PRESETS = {g.name: g for g in [
    # A100 SXM: 312 TFLOP/s bf16/fp16 tensor cores, 19.5 fp32; NVLink3 600 GB/s both ways;
    # one HDR InfiniBand card (200 Gb/s = 25 GB/s) per GPU as in DGX A100.
    GPU("a100-40g", 40 * GIB, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 1555, 300, 25, 32),
    GPU("a100-80g", 80 * GIB, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 2039, 300, 25, 32),
    # H100 / H200 SXM: 989 TFLOP/s bf16 dense, 67 fp32; NVLink4 900 GB/s both ways; NDR 400 Gb/s.
    GPU("h100-80g", 80 * GIB, {"bf16": 989, "fp16": 989, "fp32": 67}, 3350, 450, 50, 64),
    GPU("h200", 141e9, {"bf16": 989, "fp16": 989, "fp32": 67}, 4800, 450, 50, 64),
]}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    intra_node_gbps: float | None = None  # per GPU per direction; default: the GPU's NVLink
    inter_node_gbps: float | None = None  # per GPU per direction; default: its network card
    intra_latency_s: float = 5e-6  # α of one ring step inside a node
    inter_latency_s: float = 15e-6  # α of one ring step across nodes

    @property
    def intra_bw(self) -> float:
        return (self.intra_node_gbps or self.gpu.nvlink_gbps) * GB

    @property
    def inter_bw(self) -> float:
        return (self.inter_node_gbps or self.gpu.network_gbps) * GB


@dataclass(frozen=True)
class Efficiency:
    """What fraction of the datasheet the software reaches. These are assumptions, not
    measurements: change them and watch the ranking move. The two compute numbers were set
    once so that the planner reproduces [PTD-P] Table 1 (see tests/test_plan.py); they are the
    same for every model and layout.

    gemm: fraction of peak FLOP/s that the transformer's matrix multiplies reach.
    elementwise_passes: memory-bound work (layer norm, GeLU, softmax, dropout, residual adds)
        is modelled as reading/writing the layer's saved activations this many times over HBM.
    comm: fraction of the link bandwidth a collective reaches (NCCL bus bandwidth / link).
    dp_overlap: fraction of data-parallel (and ZeRO) traffic hidden behind compute.
    tp_overlap: same for tensor-parallel collectives (Megatron 2021: none).
    usable_memory: fraction of HBM a plan may fill (the rest: CUDA context, fragmentation,
        communication buffers).
    cpu_adam_params_per_s: optimizer updates per second on the host, for --offload.
    """

    gemm: float = 0.62
    elementwise_passes: float = 6.0
    comm: float = 0.8
    dp_overlap: float = 0.0
    tp_overlap: float = 0.0
    usable_memory: float = 0.9
    cpu_adam_params_per_s: float = 1e9


# ---------------------------------------------------------------------------------------------
# 3. The layout
# ---------------------------------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


class PlanError(ValueError):
    """A layout that cannot run; the message says why in one line."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    microbatches: int = 1  # per data-parallel rank and step
    batch_size: int = 8  # global, in sequences
    precision: str = "fp32"
    recompute: str = "none"
    sequence_parallel: bool = False
    offload: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // (self.dp * self.microbatches)

    def short(self) -> str:
        bits = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"zero{self.zero}"]
        if self.pp > 1:
            bits.append(self.schedule + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        bits.append(f"b{self.micro_batch_size}×m{self.microbatches}")
        if self.recompute != "none":
            bits.append(f"rc-{self.recompute}")
        if self.sequence_parallel:
            bits.append("sp")
        if self.offload:
            bits.append("offload")
        return " ".join(bits)


def check_layout(model: ModelShape, lay: Layout) -> None:
    """Raise PlanError with one clear line if the layout cannot run."""
    for obj, names in ((model, ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size")),
                       (lay, ("dp", "tp", "pp", "microbatches", "virtual_stages", "batch_size"))):
        for name in names:
            if getattr(obj, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be at least 1, "
                                f"got {getattr(obj, name)}")
    if lay.zero not in (0, 1, 2, 3):
        raise PlanError(f"--zero must be 0, 1, 2 or 3, got {lay.zero}")
    if lay.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {lay.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if lay.precision not in PRECISION_BYTES:
        raise PlanError(f"unknown precision {lay.precision!r}: choose fp32, bf16 or fp16")
    if model.n_embd % model.n_head:
        raise PlanError(f"n_embd={model.n_embd} is not divisible by n_head={model.n_head}")
    if model.n_head % lay.tp:
        raise PlanError(f"n_head={model.n_head} is not divisible by tp={lay.tp}: "
                        "tensor parallel gives each rank whole attention heads")
    chunks = lay.pp * (lay.virtual_stages if lay.schedule == "interleaved" else 1)
    if lay.pp > 1 and model.n_layer < chunks:
        raise PlanError(f"n_layer={model.n_layer} is fewer than pp×virtual stages={chunks}")
    if lay.schedule == "interleaved" and lay.pp > 1 and model.n_layer % chunks:
        raise PlanError(f"interleaved schedule needs n_layer={model.n_layer} divisible by "
                        f"pp×virtual_stages={chunks}")
    if lay.batch_size % (lay.dp * lay.microbatches):
        raise PlanError(f"global batch {lay.batch_size} is not divisible by dp×microbatches="
                        f"{lay.dp}×{lay.microbatches}")
    if lay.sequence_parallel and lay.tp > 1 and model.seq_len % lay.tp:
        raise PlanError(f"sequence parallel needs seq_len={model.seq_len} divisible by tp={lay.tp}")


# ---------------------------------------------------------------------------------------------
# 4. Memory: parameters per stage [ZeRO], activations per GPU [SP] (formulas: hplab.formulas)
# ---------------------------------------------------------------------------------------------


def params_per_stage(model: ModelShape, tp: int = 1, pp: int = 1) -> dict:
    """Parameters one GPU holds on the first and on the last pipeline stage.

    Tensor parallel ([PTD-P] Sec. 2.3) splits QKV, the attention projection, both MLP matrices
    and the column-parallel biases (12h² + 7h per block) and the vocabulary of the embedding;
    layer norms, row-parallel biases (6h per block) and position embeddings stay replicated.
    Pipeline parallel splits the blocks; the first stage also holds the embeddings, the last
    the final layer norm and a copy of the tied LM head (Megatron's way of tying across
    stages). With uneven splits the busiest stage holds ceil(L/pp) blocks.
    """
    h, V, S = model.n_embd, model.vocab_size, model.seq_len
    block = (12 * h * h + 7 * h) / tp + 6 * h
    blocks = math.ceil(model.n_layer / pp)
    embed = V * h / tp + S * h
    head = 2 * h + (V * h / tp if pp > 1 else 0)  # tied: no second copy on one stage
    if pp == 1:
        first = last = blocks * block + embed + head
    else:
        first, last = blocks * block + embed, blocks * block + head
    return {"first": first, "last": last, "block": block, "blocks_per_stage": blocks}


def activation_memory(model: ModelShape, lay: Layout) -> dict:
    """Activation bytes per GPU on the first and last pipeline stage, and for one microbatch.

    Beyond the blocks ([SP] Sec. 4.3): the first stage keeps the embedding dropout mask (sbh
    bytes, /t with sequence parallel) for each microbatch in flight; the last stage keeps the
    final layer norm's and the LM head's inputs (2·sbh elements, /t with sequence parallel) and
    the fp32 logits the cross-entropy needs, 4·s·b·V/t bytes, for its one microbatch in flight.
    Full recompute also needs, while a block runs backward, that block's activations again:
    `recompute_working_bytes`.
    """
    s, b, h, a, t = model.seq_len, lay.micro_batch_size, model.n_embd, model.n_head, lay.tp
    act = PRECISION_BYTES[lay.precision][4]
    kw = dict(s=s, b=b, h=h, a=a, t=t, sequence_parallel=lay.sequence_parallel, act_bytes=act,
              dropout=model.dropout, flash_attention=model.flash_attention)
    per_layer = activation_bytes_per_layer(recompute=lay.recompute, **kw)
    sp_div = t if lay.sequence_parallel else 1
    layers = math.ceil(model.n_layer / lay.pp)
    embed_extra = (s * b * h / sp_div) if model.dropout else 0
    head_extra = 2 * s * b * h * act / sp_div + 4 * s * b * model.vocab_size / t
    working = 0.0
    if lay.recompute == "full":
        working = activation_bytes_per_layer(recompute="none", **kw)
    k = in_flight_microbatches(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages)
    one_mb_all_layers = per_layer * model.n_layer + embed_extra + head_extra
    if lay.pp == 1:
        first = last = per_layer * layers + embed_extra + head_extra
    else:
        first = k * (per_layer * layers + embed_extra)
        last_k = lay.microbatches if lay.schedule == "gpipe" else 1
        last = last_k * (per_layer * layers + head_extra)
    return {"per_layer_bytes": per_layer, "first_stage_bytes": first, "last_stage_bytes": last,
            "in_flight_microbatches": k, "recompute_working_bytes": working,
            "per_microbatch_model_bytes": one_mb_all_layers}


# ---------------------------------------------------------------------------------------------
# 5. Which links a process group uses  [Ring]
# ---------------------------------------------------------------------------------------------


def group_link(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> tuple[float, float, bool]:
    """Bandwidth β and latency α of a process group of `size` ranks spaced `stride` apart.

    Ranks are numbered tensor parallel first, then data, then pipeline (as `hplab.dist`), and
    fill nodes in order. If the group fits in one node it talks over NVLink. Otherwise each
    ring crosses nodes; NCCL runs one ring per network card, so the k members sharing a node
    bring k cards: β = min(NVLink, k × card). Returns (β, α, crosses_nodes).
    """
    g = cluster.gpus_per_node
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    if size <= per_node:
        return cluster.intra_bw * eff.comm, cluster.intra_latency_s, False
    bw = min(cluster.intra_bw, per_node * cluster.inter_bw) * eff.comm
    return bw, cluster.inter_latency_s, True


# ---------------------------------------------------------------------------------------------
# 6. One plan: memory and time of a layout on a cluster
# ---------------------------------------------------------------------------------------------


def plan(model: ModelShape, lay: Layout, cluster: Cluster | None = None,
         eff: Efficiency | None = None, padded: bool = False) -> dict:
    """Memory per GPU, step time and throughput of `lay` on `cluster`. Returns a flat dict
    (the JSON the command line prints); all sizes in bytes, times in seconds."""
    cluster = cluster or Cluster(GPU_PRESETS["a100-80g"])
    eff = eff or Efficiency()
    check_layout(model, lay)
    dp, tp, pp, m, b = lay.dp, lay.tp, lay.pp, lay.microbatches, lay.micro_batch_size
    v = lay.virtual_stages if (lay.schedule == "interleaved" and pp > 1) else 1
    p_bytes, g_bytes, *_ , act_bytes = PRECISION_BYTES[lay.precision]

    # --- memory ---------------------------------------------------------------------------
    stage_params = params_per_stage(model, tp, pp)
    states = {where: model_state_bytes(stage_params[where], dp, lay.zero, lay.precision,
                                       lay.offload, padded) for where in ("first", "last")}
    acts = activation_memory(model, lay)
    zero3_buffer = 0.0
    if lay.zero == 3 and dp > 1:  # the gathered block in use + the next one being prefetched
        zero3_buffer = 2 * stage_params["block"] * p_bytes
    totals = {where: states[where]["total_bytes"] + acts[f"{where}_stage_bytes"]
              + acts["recompute_working_bytes"] + zero3_buffer for where in ("first", "last")}
    worst = max(totals, key=totals.get)
    state = states[worst]
    memory = totals[worst]
    usable = cluster.gpu.memory_bytes * eff.usable_memory

    # --- compute of the busiest stage, per microbatch ----------------------------------------
    peak = cluster.gpu.peak_tflops[lay.precision] * 1e12
    flops = flops_per_step(model, lay.batch_size, lay.recompute)
    layers = stage_params["blocks_per_stage"]
    per_seq = flops["hardware_flops"] / lay.batch_size
    block_hw = (per_seq - 3 * flops["head_fwd_flops"]) / model.n_layer  # one block, fwd+bwd(+rc)
    mb_flops_gpu = b * (layers * block_hw + 3 * flops["head_fwd_flops"] / pp) / tp
    gemm_s = mb_flops_gpu / (peak * eff.gemm)
    passes = eff.elementwise_passes * (4 / 3 if lay.recompute == "full" else 1)
    layer_act = activation_bytes_per_layer(model.seq_len, b, model.n_embd, model.n_head, tp,
                                           lay.sequence_parallel, "none", act_bytes,
                                           model.dropout, model.flash_attention)
    elementwise_s = passes * layers * layer_act / (cluster.gpu.hbm_gbps * GB)
    compute_mb = gemm_s + elementwise_s

    # --- tensor parallel: 2 collectives forward, 2 backward, 2 more if the forward is redone --
    tp_bw, tp_alpha, tp_cross = group_link(cluster, tp, 1, eff)
    tp_msg = b * model.seq_len * model.n_embd * act_bytes
    n_coll = 4 + (2 if lay.recompute == "full" else 0)
    if lay.sequence_parallel:  # all-gather + reduce-scatter: same bytes, twice the latency
        one = 2 * collective_time_s("all_gather", tp_msg, tp, tp_bw, tp_alpha)
    else:
        one = collective_time_s("all_reduce", tp_msg, tp, tp_bw, tp_alpha)
    tp_mb = n_coll * layers * one * (1 - eff.tp_overlap)

    # --- pipeline: bubble and point-to-point sends ([PTD-P] Sec. 4.1 scatter/gather: each of
    # the tp ranks sends 1/tp of the activation, then they all-gather over NVLink) ----------
    work_mb = compute_mb + tp_mb
    bubble = bubble_ratio(lay.schedule, pp, m, v)  # idle / compute
    pp_bw, pp_alpha, pp_cross = group_link(cluster, pp, dp * tp, eff)
    p2p_one = (pp_alpha + tp_msg / tp / pp_bw) if pp > 1 else 0.0
    p2p_s = 2 * (m * v + pp - 1) * p2p_one if pp > 1 else 0.0

    # --- data parallel / ZeRO traffic, per step ([ZeRO] Sec. 7) ----------------------------
    dp_bw, dp_alpha, dp_cross = group_link(cluster, dp, tp, eff)
    local = max(stage_params["first"], stage_params["last"])
    grad_buf, param_buf = local * g_bytes, local * p_bytes
    ar = collective_time_s("all_reduce", grad_buf, dp, dp_bw, dp_alpha)
    rs = collective_time_s("reduce_scatter", grad_buf, dp, dp_bw, dp_alpha)
    ag = collective_time_s("all_gather", param_buf, dp, dp_bw, dp_alpha)
    if lay.zero <= 1:  # one all-reduce (ZeRO-1: reduce-scatter + all-gather, same volume)
        dp_s = ar if lay.zero == 0 else rs + ag
    elif lay.zero == 2:  # no full gradient kept: reduce-scatter after every microbatch
        dp_s = m * rs + ag
    else:  # gather params for forward, (recompute,) backward; reduce-scatter grads; per mb
        gathers = 3 if lay.recompute == "full" else 2
        dp_s = m * (gathers * ag + rs)
    dp_exposed = dp_s * (1 - eff.dp_overlap)

    offload_s = 0.0
    if lay.offload:  # grads down and params up over PCIe, Adam on the host
        shard = local / (dp if lay.zero >= 1 else 1)
        offload_s = shard * (g_bytes + p_bytes) / (cluster.gpu.pcie_gbps * GB) \
            + shard / eff.cpu_adam_params_per_s

    pipeline_s = m * work_mb + bubble * m * work_mb + p2p_s
    step = pipeline_s + dp_exposed + offload_s
    gpus = lay.gpus
    tflops = flops["hardware_flops"] / (step * gpus) / 1e12
    model_tflops = flops["model_flops"] / (step * gpus) / 1e12

    return {
        "model": model.name, "params": model.num_params(), "layout": lay.short(),
        **{k: v2 for k, v2 in asdict(lay).items()}, "micro_batch_size": b, "gpus": gpus,
        "gpu": cluster.gpu.name, "gpus_per_node": cluster.gpus_per_node,
        # memory
        **{k: state[k] for k in ("params_bytes", "grads_bytes", "optim_bytes", "master_bytes")},
        "cpu_offload_bytes": state["cpu_bytes"],
        "model_state_bytes_per_gpu": state["total_bytes"],
        "activation_bytes_per_gpu": acts[f"{worst}_stage_bytes"],
        "activation_bytes_per_microbatch": acts["per_microbatch_model_bytes"],
        "activation_bytes_per_layer": acts["per_layer_bytes"],
        "in_flight_microbatches": acts["in_flight_microbatches"],
        "recompute_working_bytes": acts["recompute_working_bytes"],
        "zero3_gather_bytes": zero3_buffer,
        "memory_bytes_per_gpu": memory, "worst_stage": worst,
        "usable_bytes_per_gpu": usable, "fits": memory <= usable,
        # time
        "step_time_s": step,
        "compute_s": m * compute_mb, "gemm_s": m * gemm_s, "elementwise_s": m * elementwise_s,
        "tp_comm_s": m * tp_mb, "bubble_s": bubble * m * work_mb,
        "bubble_ratio": bubble, "bubble_fraction": bubble / (1 + bubble),  # of the pipeline
        "pp_comm_s": p2p_s, "dp_comm_s": dp_s, "dp_comm_exposed_s": dp_exposed,
        "offload_s": offload_s,
        "tp_crosses_nodes": tp_cross, "dp_crosses_nodes": dp_cross, "pp_crosses_nodes": pp_cross,
        # throughput
        "model_flops_per_step": flops["model_flops"],
        "hardware_flops_per_step": flops["hardware_flops"],
        "tokens_per_s": lay.batch_size * model.seq_len / step,
        "tflops_per_gpu": tflops, "model_tflops_per_gpu": model_tflops,
        "mfu": model_tflops * 1e12 / peak, "hfu": tflops * 1e12 / peak,
    }


# ---------------------------------------------------------------------------------------------
# 7. Search: every feasible layout, ranked, and why the winner wins
# ---------------------------------------------------------------------------------------------

MICRO_BATCH_SIZES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 3, 4, 6, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelShape, gpus: int, batch_size: int, precision: str = "bf16",
                      fixed: dict | None = None, allow_offload: bool = False,
                      micro_batch_sizes=MICRO_BATCH_SIZES):
    """Every layout of `gpus` GPUs that can run: dp·tp·pp = gpus, whole heads per tensor-
    parallel rank, a global batch that splits into whole microbatches, and each ZeRO stage,
    recompute mode, sequence parallel and pipeline schedule. `fixed` pins fields of Layout
    to a value or a tuple of allowed values (e.g. {"tp": 8, "schedule": ("1f1b", "gpipe")})."""
    fixed = fixed or {}
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if model.n_head % tp or pp > model.n_layer or batch_size % dp:
                continue
            for b in micro_batch_sizes:
                m = batch_size // dp // b
                if (batch_size // dp) % b:
                    continue
                scheds = [("1f1b", 1)] + ([("gpipe", 1), ("zb-h1", 1)] if pp > 1 else [])
                scheds += [("interleaved", v) for v in VIRTUAL_STAGES if pp > 1
                           and model.n_layer % (pp * v) == 0 and m % pp == 0]
                for (schedule, v), zero, rc, sp, off in itertools.product(
                        scheds, (0, 1, 2, 3) if dp > 1 else (0,), RECOMPUTE,
                        (False, True) if tp > 1 else (False,),
                        (False, True) if allow_offload else (False,)):
                    lay = Layout(dp, tp, pp, zero, schedule, v, m, batch_size, precision, rc, sp,
                                 off)
                    if all(_allowed(getattr(lay, k), val) for k, val in fixed.items()):
                        yield lay


def _allowed(value, wanted) -> bool:
    if isinstance(wanted, (tuple, list, set, frozenset)):
        return value in wanted
    return value == wanted


def _simplicity(p: dict) -> tuple:
    """Among layouts equally fast, prefer the simpler one: fewer model-parallel ranks (the
    model stays whole on more GPUs), less ZeRO sharding, no recompute, no sequence parallel,
    the plain 1F1B schedule, bigger microbatches."""
    return (p["tp"] * p["pp"], p["zero"], RECOMPUTE.index(p["recompute"]),
            p["sequence_parallel"], p["offload"], p["schedule"] != "1f1b", p["virtual_stages"],
            -p["micro_batch_size"])


def search(model: ModelShape, gpus: int, cluster: Cluster | None = None,
           eff: Efficiency | None = None, batch_size: int | None = None, precision: str = "bf16",
           fixed: dict | None = None, allow_offload: bool = False, tie: float = 0.02,
           comfortable_memory: float = 0.8) -> dict:
    """Plan every candidate layout; rank the ones that fit by step time.

    The planner is good to a few percent (tests/test_plan.py), so layouts within `tie` of the
    fastest count as equally fast. Among those the simplest wins (`_simplicity`), preferring
    one that leaves headroom (memory at most `comfortable_memory` of what is usable)."""
    cluster = cluster or Cluster(GPU_PRESETS["a100-80g"])
    eff = eff or Efficiency()
    batch_size = batch_size or model.default_batch_size
    plans = [plan(model, lay, cluster, eff) for lay in
             candidate_layouts(model, gpus, batch_size, precision, fixed, allow_offload)]
    if not plans:
        raise PlanError(f"no layout of {gpus} GPUs splits a batch of {batch_size} sequences and "
                        f"{model.n_head} heads evenly: change --gpus or --batch-size")
    feasible = sorted((p for p in plans if p["fits"]), key=lambda p: p["step_time_s"])
    winner = None
    if feasible:
        fastest = feasible[0]["step_time_s"]
        ties = [p for p in feasible if p["step_time_s"] <= fastest * (1 + tie)]
        roomy = [p for p in ties
                 if p["memory_bytes_per_gpu"] <= comfortable_memory * p["usable_bytes_per_gpu"]]
        winner = min(roomy or ties, key=_simplicity)
        feasible.remove(winner)
        feasible.insert(0, winner)
    return {"model": model.name, "params": model.num_params(), "gpus": gpus,
            "gpu": cluster.gpu.name, "gpus_per_node": cluster.gpus_per_node,
            "batch_size": batch_size, "precision": precision, "evaluated": len(plans),
            "feasible": len(feasible), "winner": winner, "ranking": feasible,
            "explanation": (explain(winner, plans, gpus, batch_size) if winner
                            else explain_infeasible(plans)),
            "_all": plans}


HEADLINE = ("model_state_bytes_per_gpu", "activation_bytes_per_gpu", "memory_bytes_per_gpu",
            "step_time_s", "tflops_per_gpu", "mfu", "layout")

TIME_PARTS = {"compute_s": "compute", "tp_comm_s": "tensor-parallel comm",
              "bubble_s": "pipeline bubble", "pp_comm_s": "pipeline sends",
              "dp_comm_exposed_s": "data-parallel/ZeRO comm", "offload_s": "offload"}

KNOBS = {"zero": "ZeRO stage", "tp": "tensor parallel", "pp": "pipeline parallel",
         "recompute": "recompute", "sequence_parallel": "sequence parallel",
         "schedule": "schedule", "micro_batch_size": "micro-batch size"}


def _why_slower(alt: dict, best: dict) -> str:
    if not alt["fits"]:
        return (f"does not fit: {alt['memory_bytes_per_gpu'] / GB:.0f} GB > "
                f"{alt['usable_bytes_per_gpu'] / GB:.0f} GB usable")
    delta = alt["step_time_s"] - best["step_time_s"]
    grew = max(TIME_PARTS, key=lambda k: alt[k] - best[k])
    if delta <= best["step_time_s"] * 0.005:
        return f"as fast ({alt['memory_bytes_per_gpu'] / GB:.0f} GB)"
    return f"+{delta / best['step_time_s']:.0%} ({TIME_PARTS[grew]} +{alt[grew] - best[grew]:.2g} s)"


def _best(plans: list[dict]) -> dict | None:
    """The fastest that fits, else the one closest to fitting."""
    fits = [p for p in plans if p["fits"]]
    if fits:
        return min(fits, key=lambda p: p["step_time_s"])
    return min(plans, key=lambda p: p["memory_bytes_per_gpu"]) if plans else None


def explain(winner: dict, plans: list[dict], gpus: int, batch_size: int) -> list[str]:
    """Why the winner wins, from the numbers: where its step time goes, then for each knob the
    best layout with another setting and what makes it slower (or not fit)."""
    w = winner
    lines = [f"winner: {w['layout']}: {w['step_time_s']:.3g} s/step, "
             f"{w['tflops_per_gpu']:.0f} TFLOP/s per GPU, MFU {w['mfu']:.0%}, "
             f"{w['memory_bytes_per_gpu'] / GB:.1f} GB of {w['usable_bytes_per_gpu'] / GB:.0f} GB usable"]
    parts = ", ".join(f"{name} {w[k]:.3g} s" for k, name in TIME_PARTS.items() if w[k] > 0)
    lines.append(f"  step = {parts}")
    links = [f"{g} group {'crosses nodes' if w[f'{g}_crosses_nodes'] else 'stays in a node'}"
             for g in ("tp", "dp", "pp") if w[g] > 1]
    if links:
        lines.append("  " + "; ".join(links))
    families = [
        ("plain DDP", lambda p: p["tp"] == p["pp"] == 1 and p["zero"] == 0),
        ("ZeRO only (no TP/PP)", lambda p: p["tp"] == p["pp"] == 1 and p["zero"] > 0),
        ("TP + DP (no PP)", lambda p: p["tp"] > 1 and p["pp"] == 1),
        ("PP + DP (no TP)", lambda p: p["pp"] > 1 and p["tp"] == 1),
        ("PP + TP + DP", lambda p: p["pp"] > 1 and p["tp"] > 1),
    ]
    lines.append("best of each family:")
    for name, member in families:
        best = _best([p for p in plans if member(p)])
        if best is None:
            if name == "plain DDP":
                states = model_state_bytes(w["params"], gpus, 0, w["precision"])["total_bytes"]
                lines.append(f"  {name:22s} dp={gpus} cannot split the batch of {batch_size}; "
                             f"its model states alone would need {states / GB:.0f} GB per GPU")
            continue
        tag = "winner" if best is w or best["layout"] == w["layout"] else _why_slower(best, w)
        lines.append(f"  {name:22s} {best['layout']:44s} {tag}")
    lines.append("changing one choice of the winner (the rest kept where possible):")
    for knob, name in KNOBS.items():
        values = sorted({p[knob] for p in plans})
        if len(values) < 2:
            continue
        alts = []
        for val in values:
            if val == w[knob]:
                continue
            alt = _best(_neighbours(w, plans, knob, val))
            if alt is not None:
                alts.append(f"{val}: {_why_slower(alt, w)}")
        if alts:
            lines.append(f"  {name} = {w[knob]}: " + "; ".join(alts))
    return lines


_SAME = ("tp", "pp", "zero", "recompute", "sequence_parallel", "schedule", "virtual_stages",
         "micro_batch_size", "offload")


def _neighbours(w: dict, plans: list[dict], knob: str, value) -> list[dict]:
    """Plans equal to the winner except for `knob` = value (dp and the number of microbatches
    follow from tp, pp and the micro-batch size). If there are none (say sequence parallel
    without tensor parallel), relax one more choice at a time, then all of them."""
    with_value = [p for p in plans if p[knob] == value]
    free = {knob} | ({"virtual_stages"} if knob == "schedule" else set())
    for relax in ((), ("sequence_parallel",), ("virtual_stages",), ("schedule", "virtual_stages"),
                  ("micro_batch_size",)):
        keys = [k for k in _SAME if k not in free and k not in relax]
        found = [p for p in with_value if all(p[k] == w[k] for k in keys)]
        if found:
            return found
    return with_value


def explain_infeasible(plans: list[dict]) -> list[str]:
    best = _best(plans)
    return [f"no layout fits: the smallest needs {best['memory_bytes_per_gpu'] / GB:.1f} GB per GPU "
            f"({best['layout']}) but only {best['usable_bytes_per_gpu'] / GB:.1f} GB are usable; "
            "add GPUs, use a bigger GPU, or --offload"]


# ---------------------------------------------------------------------------------------------
# 8. Reports for humans
# ---------------------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / GB:9.3f} GB" if x < 1e12 else f"{x / 1e12:9.3f} TB"


def format_model_state(psi: float, states: dict, dp: int, zero: int, precision: str) -> str:
    rows = [f"model states of Ψ = {psi:.4g} parameters, {precision}, ZeRO-{zero} over dp={dp} "
            "(per GPU) [ZeRO Sec. 5]"]
    for kind in ("params", "grads", "optim", "master"):
        rows.append(f"  {kind:<8s}{_gb(states[kind + '_bytes'])}")
    if states["cpu_bytes"]:
        rows.append(f"  {'on host':<8s}{_gb(states['cpu_bytes'])}")
    rows.append(f"  {'total':<8s}{_gb(states['total_bytes'])}")
    return "\n".join(rows)


def format_plan(p: dict, model: ModelShape, variants: list[tuple[str, float]] | None = None) -> str:
    out = [f"{p['model']} (Ψ = {p['params'] / 1e9:.3g} B) on {p['gpus']} × {p['gpu']} "
           f"({p['gpus_per_node']} per node): {p['layout']}, {p['precision']}"]
    out.append("memory per GPU" + (f" (worst: {p['worst_stage']} pipeline stage)" if p["pp"] > 1 else ""))
    for key, label in [("params_bytes", "parameters"), ("grads_bytes", "gradients"),
                       ("optim_bytes", "optimizer state"), ("master_bytes", "fp32 master weights"),
                       ("activation_bytes_per_gpu", f"activations ({p['in_flight_microbatches']:g} mb in flight)"),
                       ("recompute_working_bytes", "recompute working block"),
                       ("zero3_gather_bytes", "ZeRO-3 gathered blocks"),
                       ("memory_bytes_per_gpu", "total")]:
        if p[key] or key in ("params_bytes", "memory_bytes_per_gpu", "activation_bytes_per_gpu"):
            out.append(f"  {label:<34s}{_gb(p[key])}")
    out.append(f"  {'usable (' + p['gpu'] + ')':<34s}{_gb(p['usable_bytes_per_gpu'])}  "
               + ("fits" if p["fits"] else "DOES NOT FIT"))
    if p["cpu_offload_bytes"]:
        out.append(f"  {'offloaded to host':<34s}{_gb(p['cpu_offload_bytes'])}")
    if variants:
        out.append("activations per GPU with other choices [SP Table 2]")
        for label, val in variants:
            out.append(f"  {label:<34s}{_gb(val)}")
    out.append(f"time per step: {p['step_time_s']:.4g} s")
    for key, label in TIME_PARTS.items():
        val = p[key]
        if val or key == "compute_s":
            out.append(f"  {label:<34s}{val:10.4g} s  {val / p['step_time_s']:6.1%}")
    if p["dp_comm_s"] and p["dp_comm_exposed_s"] < p["dp_comm_s"]:
        out.append(f"  (data-parallel traffic {p['dp_comm_s']:.3g} s, of which hidden "
                   f"{p['dp_comm_s'] - p['dp_comm_exposed_s']:.3g} s)")
    out.append(f"throughput: {p['tokens_per_s']:.4g} tokens/s, {p['tflops_per_gpu']:.1f} TFLOP/s "
               f"per GPU (with recompute), {p['model_tflops_per_gpu']:.1f} model TFLOP/s, "
               f"MFU {p['mfu']:.1%}")
    return "\n".join(out)


def format_search(res: dict, top: int = 10) -> str:
    out = [f"{res['model']} (Ψ = {res['params'] / 1e9:.3g} B) on {res['gpus']} × {res['gpu']} "
           f"({res['gpus_per_node']} per node), global batch {res['batch_size']}, {res['precision']}: "
           f"{res['feasible']} of {res['evaluated']} layouts fit "
           "(within 2% of the fastest counts as a tie; the simplest of those is ranked first)"]
    if res["ranking"]:
        out.append(f"{'#':>3} {'layout':44s} {'GB/GPU':>7} {'s/step':>8} {'TFLOP/s':>8} {'MFU':>5}")
        for i, p in enumerate(res["ranking"][:top], 1):
            out.append(f"{i:>3} {p['layout']:44s} {p['memory_bytes_per_gpu'] / GB:7.1f} "
                       f"{p['step_time_s']:8.3g} {p['tflops_per_gpu']:8.1f} {p['mfu']:5.1%}")
    out.extend(res["explanation"])
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# 9. Command line
# ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit code 2
        print(f"hplab.plan: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m hplab.plan", description=__doc__.split("\n\n")[0])
    m = ap.add_argument_group("model (as hplab/train.py)")
    m.add_argument("--model", default="gpt2", help="preset: hplab's tiny/gpt2/gpt2-medium, "
                   "gpt3-125m ... gpt3-175b, megatron-1.7b ... megatron-1t")
    m.add_argument("--n-layer", type=int)
    m.add_argument("--n-embd", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--seq-len", type=int)
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="count dropout masks (default: as the preset)")
    m.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="attention keeps no s×s matrices (default: as the preset)")
    m.add_argument("--params", type=float, help="only the model-state memory of this many "
                   "parameters (with --dp, --zero, --precision)")
    lo = ap.add_argument_group("layout (as hplab/train.py)")
    lo.add_argument("--dp", type=int)
    lo.add_argument("--tp", type=int, default=1)
    lo.add_argument("--pp", type=int, default=1)
    lo.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    lo.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    lo.add_argument("--virtual-stages", type=int, default=1)
    lo.add_argument("--microbatches", type=int)
    lo.add_argument("--batch-size", type=int, help="global, in sequences")
    lo.add_argument("--precision", default=None, choices=tuple(PRECISION_BYTES),
                    help="default: fp32 for hplab's presets, bf16 for the others")
    lo.add_argument("--recompute", action="store_true", help="full activation recompute")
    lo.add_argument("--selective-recompute", action="store_true",
                    help="recompute only the attention scores [SP]")
    lo.add_argument("--sequence-parallel", action="store_true")
    lo.add_argument("--offload", action="store_true", help="optimizer state on the host")
    lo.add_argument("--padded", action="store_true",
                    help="ZeRO shards padded to a multiple of dp, as hplab allocates them")
    cl = ap.add_argument_group("cluster")
    cl.add_argument("--gpu", default="a100-80g", choices=tuple(GPU_PRESETS))
    cl.add_argument("--gpus", type=int, help="total GPUs (required with --search)")
    cl.add_argument("--gpus-per-node", type=int, default=8)
    cl.add_argument("--intra-bw", type=float, help="GB/s per GPU inside a node (default NVLink)")
    cl.add_argument("--inter-bw", type=float, help="GB/s per GPU between nodes (default its NIC)")
    ef = ap.add_argument_group("efficiency assumptions")
    for f in Efficiency.__dataclass_fields__.values():
        ef.add_argument("--eff-" + f.name.replace("_", "-"), type=float, default=f.default,
                        dest="eff_" + f.name)
    out = ap.add_argument_group("output")
    out.add_argument("--search", action="store_true", help="rank every layout of --gpus GPUs")
    out.add_argument("--top", type=int, default=10)
    out.add_argument("--json", action="store_true")
    return ap


def model_from_args(args) -> ModelShape:
    presets = model_presets()
    if args.model not in presets:
        raise PlanError(f"unknown model preset {args.model!r}: choose one of {', '.join(presets)}")
    names = ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size", "dropout", "flash_attention")
    model = replace(presets[args.model], **{k: getattr(args, k) for k in names
                                            if getattr(args, k) is not None})
    check_layout(model, Layout())  # the model's own sizes, before any search
    return model


def _run(args) -> tuple[dict, str]:
    eff = Efficiency(**{f: getattr(args, "eff_" + f) for f in Efficiency.__dataclass_fields__})
    if args.params is not None:  # model states of a bare parameter count
        if args.params <= 0:
            raise PlanError("--params must be positive")
        dp, precision = args.dp or 1, args.precision or "bf16"
        st = model_state_bytes(args.params / (args.tp * args.pp), dp, args.zero, precision,
                               args.offload, args.padded)
        res = {"params": args.params, "dp": dp, "tp": args.tp, "pp": args.pp, "zero": args.zero,
               "precision": precision, **{k: st[k] for k in ("params_bytes", "grads_bytes",
                                                             "optim_bytes", "master_bytes")},
               "cpu_offload_bytes": st["cpu_bytes"], "model_state_bytes_per_gpu": st["total_bytes"]}
        return res, format_model_state(args.params, st, dp, args.zero, precision)
    model = model_from_args(args)
    hplab_model = not (args.model.startswith(("gpt3-", "megatron-")))
    precision = args.precision or ("fp32" if hplab_model else "bf16")
    gpu = GPU_PRESETS[args.gpu]
    if args.gpus_per_node < 1:
        raise PlanError("--gpus-per-node must be at least 1")
    cluster = Cluster(gpu, args.gpus_per_node, args.intra_bw, args.inter_bw)
    batch = args.batch_size or model.default_batch_size
    if args.search:
        if not args.gpus:
            raise PlanError("--search needs --gpus N")
        res = search(model, args.gpus, cluster, eff, batch, precision,
                     allow_offload=args.offload)
        res.pop("_all")
        text = format_search(res, args.top)
        res["ranking"] = res["ranking"][:args.top]
        if res["winner"]:  # the headline numbers of the winner, at top level for notebooks
            res.update({k: res["winner"][k] for k in HEADLINE})
        return res, text
    tp, pp = args.tp, args.pp
    if tp < 1 or pp < 1:
        raise PlanError("--tp and --pp must be at least 1")
    dp = args.dp or (args.gpus // (tp * pp) if args.gpus else 1)
    if args.gpus and dp * tp * pp != args.gpus:
        raise PlanError(f"dp×tp×pp = {dp}×{tp}×{pp} = {dp * tp * pp} but --gpus is {args.gpus}")
    recompute = "full" if args.recompute else ("selective" if args.selective_recompute else "none")
    m = args.microbatches or (max(1, batch // dp) if pp > 1 else 1)
    lay = Layout(dp, tp, pp, args.zero, args.schedule, args.virtual_stages, m, batch, precision,
                 recompute, args.sequence_parallel, args.offload)
    res = plan(model, lay, cluster, eff, args.padded)
    variants = []
    for rc in RECOMPUTE:
        for sp in ((False, True) if tp > 1 else (False,)):
            alt = activation_memory(model, replace(lay, recompute=rc, sequence_parallel=sp))
            worst = max(alt["first_stage_bytes"], alt["last_stage_bytes"])
            variants.append((f"recompute {rc}" + (", sequence parallel" if sp else ""), worst))
    res["activation_variants"] = {label: val for label, val in variants}
    return res, format_plan(res, model, variants)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res, text = _run(args)
    except PlanError as e:
        print(f"hplab.plan: error: {e}", file=sys.stderr)
        raise SystemExit(2)
    print(json.dumps(res, indent=2, default=str, ensure_ascii=False) if args.json else text)
    return 0


if __name__ == "__main__":
    main()
