"""Time per step: compute of the busiest stage, then each process group's traffic, in the α-β
model of ring algorithms [Ring] on the links `group_link` finds for it, and the pipeline's
bubble. Each part is one small function returning a small dataclass; `step_time` adds them up.
Ranks are numbered as in `hplab.parallel.mesh` (tensor parallel innermost, then context, data
(expert parallel within it), pipeline), so a group's stride says whether it stays inside a node.
Sources: see `hplab.plan`."""

from __future__ import annotations

from dataclasses import dataclass

from hplab.config import Layout, ModelConfig
from hplab.plan.formulas import (
    PRECISION_BYTES,
    bubble_formula,
    collective_time_s,
    moe_all_to_all_bytes,
    ring_attention_bytes,
    ulysses_bytes,
)
from hplab.plan.presets import GB, Cluster, Efficiency


def group_link(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> tuple:
    """Bandwidth β, latency α and whether it crosses nodes, for a process group of `size`
    ranks spaced `stride` apart [Ring]. Ranks fill nodes in order; a group inside one node
    talks over NVLink. Otherwise each ring crosses nodes; NCCL runs one ring per network card,
    so the k members sharing a node bring k cards: β = min(NVLink, k × card)."""
    g = cluster.gpus_per_node
    gpu = cluster.gpu
    intra = (cluster.intra_node_gbps or gpu.nvlink_gbps) * GB
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    if size <= per_node:
        return intra * eff.comm, cluster.intra_latency_s, False
    inter = (cluster.inter_node_gbps or gpu.network_gbps) * GB
    return min(intra, per_node * inter) * eff.comm, cluster.inter_latency_s, True


def forward_passes(lay: Layout) -> int:
    """Forward passes per microbatch: full recompute runs each forward twice."""
    return 2 if lay.recompute == "full" else 1


def tokens_per_gpu(model: ModelConfig, lay: Layout) -> float:
    """Tokens one GPU holds of one microbatch (context parallel splits the sequence)."""
    return lay.micro_batch_size * model.seq_len / lay.cp


def activation_message(model: ModelConfig, lay: Layout) -> float:
    """Bytes of one microbatch's activations on one GPU: a tensor-parallel collective's
    message, and (split over tp) a pipeline send."""
    return tokens_per_gpu(model, lay) * model.n_embd * PRECISION_BYTES[lay.precision][4]


@dataclass(frozen=True)
class Compute:
    """Seconds of one microbatch's forward and backward on the busiest stage."""

    compute_s: float
    gemm_s: float  # the matrix multiplies, at `Efficiency.gemm` of peak
    elementwise_s: float  # norms, GeLU, softmax, residuals: memory-bound passes over HBM


def compute_time(
    model: ModelConfig,
    lay: Layout,
    cluster: Cluster,
    eff: Efficiency,
    flops: dict,
    stage: dict,
    acts: dict,
) -> Compute:
    """FLOPs ÷ achievable FLOP/s, plus element-wise passes over the activations. `flops`:
    formulas.flops_per_step; `stage`, `acts`: params_per_stage, activation_memory."""
    peak = cluster.gpu.peak_tflops[lay.precision] * 1e12
    layers = stage["blocks_per_stage"]
    head_hw = 3 * flops["head_fwd_flops"]  # LM head forward + backward, per sequence
    block_hw = (flops["hardware_flops"] / lay.batch_size - head_hw) / model.n_layer
    gemm_s = (
        lay.micro_batch_size
        * (layers * block_hw + head_hw / lay.pp)
        / (lay.tp * lay.cp)
        / (peak * eff.gemm)
    )
    passes = eff.elementwise_passes * (4 / 3 if lay.recompute == "full" else 1)
    elementwise_s = passes * layers * acts["unrecomputed_layer_bytes"] / (cluster.gpu.hbm_gbps * GB)
    return Compute(gemm_s + elementwise_s, gemm_s, elementwise_s)


@dataclass(frozen=True)
class Traffic:
    """One process group's collectives for one microbatch: seconds not hidden by compute,
    whether the group crosses nodes, and the bytes each GPU sends (where the plan reports it)."""

    seconds: float
    crosses_nodes: bool
    bytes_sent: float = 0.0


def tensor_parallel(
    model: ModelConfig, lay: Layout, cluster: Cluster, eff: Efficiency, layers: int
) -> Traffic:
    """Per layer 2 collectives forward, 2 backward, 2 more if the forward is redone; sequence
    parallel: an all-gather and a reduce-scatter for each, the same bytes, twice the latency."""
    bw, alpha, crosses = group_link(cluster, lay.tp, 1, eff)
    op, times = ("all_gather", 2) if lay.sequence_parallel else ("all_reduce", 1)
    one = collective_time_s(op, activation_message(model, lay), lay.tp, bw, alpha)
    seconds = (2 + 2 * forward_passes(lay)) * layers * times * one * (1 - eff.tp_overlap)
    return Traffic(seconds, crosses)


def context_parallel(
    model: ModelConfig, lay: Layout, cluster: Cluster, eff: Efficiency, layers: int
) -> Traffic:
    """K/V blocks around the ring, (cp−1)·passes + 2cp−1 sends per layer (the K/V heads only:
    n_kv_head·d wide), or Ulysses' 2·passes + 2 all-to-alls per layer (every query head's)."""
    cp = lay.cp
    redo = forward_passes(lay)
    ring = lay.cp_style == "ring"
    width = model.n_embd * (model.kv_heads / model.n_head if ring else 1)
    bw, alpha, crosses = group_link(cluster, cp, lay.tp, eff)
    act_bytes = PRECISION_BYTES[lay.precision][4]
    sent = (ring_attention_bytes if ring else ulysses_bytes)(
        lay.micro_batch_size, model.seq_len, width / lay.tp, cp, act_bytes
    )
    sent_bytes = layers * (redo * sent["forward"] + sent["backward"]) * (cp > 1)
    messages = layers * ((cp - 1) * redo + 2 * cp - 1 if ring else 2 * redo + 2)
    seconds = collective_time_s(
        "send" if ring else "all_to_all", sent_bytes, cp, bw, alpha, messages
    ) * (1 - eff.cp_overlap)
    return Traffic(seconds, crosses, sent_bytes)


def expert_parallel(
    model: ModelConfig, lay: Layout, cluster: Cluster, eff: Efficiency, layers: int
) -> Traffic:
    """Per layer, T·k token slots per rank out to their experts and back (a redone forward
    moves half the formula's slots again)."""
    redo = forward_passes(lay)
    bw, alpha, crosses = group_link(cluster, lay.ep, lay.tp * lay.cp, eff)
    act_bytes = PRECISION_BYTES[lay.precision][4]
    slots = tokens_per_gpu(model, lay) * model.moe_top_k
    a2a = [
        moe_all_to_all_bytes(n, n, model.n_embd, model.n_experts, act_bytes)
        for n in (slots, slots / 2)
    ]
    sent_bytes = layers * (a2a[0] + (redo - 1) * a2a[1]) * (lay.ep > 1)
    seconds = collective_time_s(
        "all_to_all", sent_bytes, lay.ep, bw, alpha, layers * (3 * redo + 2)
    )
    return Traffic(seconds, crosses, sent_bytes)


@dataclass(frozen=True)
class Pipeline:
    """The bubble ([PTD-P] Sec. 2.2) and the point-to-point sends of one step."""

    bubble_ratio: float  # idle ÷ compute
    bubble_fraction: float  # idle ÷ the pipeline's step
    pp_comm_s: float
    crosses_nodes: bool


def pipeline(model: ModelConfig, lay: Layout, cluster: Cluster, eff: Efficiency) -> Pipeline:
    """Each of the tp ranks sends 1/tp of the activation, then they all-gather it over NVLink
    ([PTD-P] Sec. 4.1, scatter/gather): 2·(m·v + pp − 1) sends per step."""
    dp = lay.dp
    cp = lay.cp
    tp = lay.tp
    pp = lay.pp
    m = lay.microbatches
    v = lay.virtual_stages if (lay.schedule == "interleaved" and pp > 1) else 1
    bubble = bubble_formula(lay.schedule, pp, m, v)
    bw, alpha, crosses = group_link(cluster, pp, dp * cp * tp, eff)
    message = activation_message(model, lay)
    sends = 2 * (m * v + pp - 1) * (alpha + message / tp / bw) if pp > 1 else 0.0
    return Pipeline(bubble["relative"], bubble["of_step"], sends, crosses)


@dataclass(frozen=True)
class DataParallel:
    """Data-parallel and ZeRO traffic of one step ([ZeRO] Sec. 7)."""

    dp_comm_s: float
    dp_comm_exposed_s: float  # what `Efficiency.dp_overlap` leaves exposed
    crosses_nodes: bool
    stepped_params: float  # the parameters each GPU's optimizer steps (ZeRO: its shard)


def data_parallel(lay: Layout, cluster: Cluster, eff: Efficiency, stage: dict) -> DataParallel:
    """Dense gradients over their replicas, the dp × cp ranks (context parallel's hold the same
    weights), the experts' over theirs, dp/ep × cp. `stage`: params_per_stage."""
    dp = lay.dp
    cp = lay.cp
    tp = lay.tp
    ep = lay.ep
    m = lay.microbatches
    p_bytes, g_bytes = PRECISION_BYTES[lay.precision][:2]
    bw, alpha, crosses = group_link(cluster, dp * cp, tp, eff)  # (cp inside dp: one block)
    local = max(stage["first"], stage["last"])
    experts = stage["experts"]
    groups = [
        (local, dp * cp, bw, alpha),
        (experts, dp // ep * cp, *group_link(cluster, dp // ep * cp, tp * ep, eff)[:2]),
    ]
    ar, rs, ag = (
        sum(collective_time_s(op, psi * nbytes, n, b, a) for psi, n, b, a in groups)
        for op, nbytes in (
            ("all_reduce", g_bytes),
            ("reduce_scatter", g_bytes),
            ("all_gather", p_bytes),
        )
    )
    shard = local / (dp * cp) + experts / (dp // ep * cp) if lay.zero else local + experts
    seconds = (
        ar,  # DDP: one all-reduce of the gradients
        rs + ag,  # ZeRO-1: reduce-scatter + all-gather, the same volume
        m * rs + ag,  # ZeRO-2 keeps no full gradient: reduce-scatter every microbatch
        # ZeRO-3, every microbatch: gather for forward, (recompute,) backward; scatter grads
        m * ((1 + forward_passes(lay)) * ag + rs),
    )[lay.zero]
    return DataParallel(seconds, seconds * (1 - eff.dp_overlap), crosses, shard)


def offload_time(lay: Layout, cluster: Cluster, eff: Efficiency, stepped_params: float) -> float:
    """--offload: gradients down and parameters up over PCIe, and Adam on the host."""
    if not lay.offload:
        return 0.0
    p_bytes, g_bytes = PRECISION_BYTES[lay.precision][:2]
    pcie = stepped_params * (g_bytes + p_bytes) / (cluster.gpu.pcie_gbps * GB)
    return pcie + stepped_params / eff.cpu_adam_params_per_s


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by part, and the bytes context and expert parallel send in it."""

    step_time_s: float
    compute_s: float
    gemm_s: float
    elementwise_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    cp_bytes_per_step: float
    ep_all_to_all_bytes_per_step: float
    bubble_s: float
    bubble_ratio: float  # idle ÷ compute
    bubble_fraction: float  # idle ÷ the pipeline's step
    pp_comm_s: float
    dp_comm_s: float
    dp_comm_exposed_s: float
    offload_s: float


@dataclass(frozen=True)
class Links:
    """Whether each process group crosses nodes (its collectives then use the network)."""

    tp_crosses_nodes: bool
    cp_crosses_nodes: bool
    ep_crosses_nodes: bool
    dp_crosses_nodes: bool
    pp_crosses_nodes: bool


def step_time(
    model: ModelConfig,
    lay: Layout,
    cluster: Cluster,
    eff: Efficiency,
    flops: dict,
    stage: dict,
    acts: dict,
) -> tuple[StepTime, Links]:
    """m microbatches of compute and tp/cp/ep traffic, the bubble on top of them, pipeline
    sends, exposed data-parallel traffic and offload."""
    m = lay.microbatches
    layers = stage["blocks_per_stage"]
    compute = compute_time(model, lay, cluster, eff, flops, stage, acts)
    tp, cp, ep = (
        part(model, lay, cluster, eff, layers)
        for part in (tensor_parallel, context_parallel, expert_parallel)
    )
    pipe = pipeline(model, lay, cluster, eff)
    dp = data_parallel(lay, cluster, eff, stage)
    offload_s = offload_time(lay, cluster, eff, dp.stepped_params)
    work = compute.compute_s + tp.seconds + cp.seconds + ep.seconds  # per microbatch
    bubble_s = pipe.bubble_ratio * m * work
    step = m * work + bubble_s + pipe.pp_comm_s + dp.dp_comm_exposed_s + offload_s
    time = StepTime(
        step_time_s=step,
        compute_s=m * compute.compute_s,
        gemm_s=m * compute.gemm_s,
        elementwise_s=m * compute.elementwise_s,
        tp_comm_s=m * tp.seconds,
        cp_comm_s=m * cp.seconds,
        ep_comm_s=m * ep.seconds,
        cp_bytes_per_step=m * cp.bytes_sent,
        ep_all_to_all_bytes_per_step=m * ep.bytes_sent,
        bubble_s=bubble_s,
        bubble_ratio=pipe.bubble_ratio,
        bubble_fraction=pipe.bubble_fraction,
        pp_comm_s=pipe.pp_comm_s,
        dp_comm_s=dp.dp_comm_s,
        dp_comm_exposed_s=dp.dp_comm_exposed_s,
        offload_s=offload_s,
    )
    crosses = (tp, cp, ep, dp, pipe)
    return time, Links(*(part.crosses_nodes for part in crosses))
