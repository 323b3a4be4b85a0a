"""Memory per GPU: the model states a pipeline stage holds ([ZeRO] Sec. 3, 5), sharded by ZeRO
over data parallel and split by tensor, pipeline and expert parallel, plus the activations the
schedule keeps in flight ([SP] Sec. 4). Sources: see `hplab.plan`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hplab.config import Layout, ModelConfig
from hplab.plan.formulas import (
    PRECISION_BYTES,
    RMS_NORM_BYTES,
    activation_bytes_per_layer,
    in_flight_microbatches,
    model_state_bytes,
)
from hplab.plan.presets import Cluster, Efficiency

STAGES = ("first", "last")  # the pipeline's two ends: embeddings on one, the LM head on the other


def params_per_stage(model: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> dict:
    """Parameters one GPU holds on the first and on the last pipeline stage (dense), and of
    experts on either (`experts`). Tensor parallel ([PTD-P] Sec. 2.3) splits QKV, the attention
    projection, both MLP matrices, the column-parallel biases (12h² + 7h per block) and the
    embedding's vocabulary; layer norms, row-parallel biases (6h per block) and position
    embeddings stay whole. Pipeline parallel splits the blocks (the busiest stage holds
    ceil(L/pp)); the first stage also holds the embeddings, the last the final layer norm and a
    copy of the tied LM head (as Megatron ties them). A mixture of experts swaps each MLP for a
    router h·E (whole) and E experts, each split by tp as the MLP and E/ep of them per GPU.
    A Llama: q and o h², k and v h·kv (kv = n_kv_head·d; with fewer K/V heads than tp ranks,
    a whole head d on each), SwiGLU 3h·I, all split by tp; two
    RMSNorm gains whole; no position table; an untied head is a second V·h matrix."""
    h = model.n_embd
    V = model.vocab_size
    S = model.seq_len
    E = model.n_experts
    mlp = (8 * h * h + 4 * h) / tp + h  # h → 4h column-, 4h → h row-parallel
    attention = (4 * h * h + 3 * h) / tp
    norms = 5 * h
    positions = S * h
    final_norm = 2 * h
    if model.arch == "llama":  # (fewer K/V heads than tp ranks: a whole one on each rank)
        kv = max(h * model.kv_heads // model.n_head, tp * h // model.n_head)
        attention = (2 * h * h + 2 * h * kv + (h + 2 * kv) * model.qkv_bias) / tp
        mlp = 3 * h * model.mlp_width / tp
        norms = 2 * h
        positions = 0
        final_norm = h
    blocks = math.ceil(model.n_layer / pp)
    experts = blocks * mlp * E / ep
    block = attention + norms + (h * E if E else mlp)  # dense
    embed = V * h / tp + positions
    second_head = pp > 1 or not model.tie_word_embeddings  # tied on one stage: no second copy
    head = final_norm + (V * h / tp if second_head else 0)
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
    of it: b·(s/cp)·h more per layer (K/V blocks in flight not counted). A Llama's layers each
    compute and keep RoPE's cos and sin tables, 2·s·d fp32 numbers."""
    s = model.seq_len // lay.cp
    b = lay.micro_batch_size
    h = model.n_embd
    t = lay.tp
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
    llama = model.arch == "llama"
    if llama:  # grouped-query K/V, a SwiGLU MLP (split by tp like the rest), RMSNorms
        kv = max(h * model.kv_heads // model.n_head, t * h // model.n_head)  # (as above)
        kw.update(kv=kv, swiglu=model.mlp_width)
    head_major = s * b * h * act / t if lay.cp > 1 else 0.0
    rope = 2 * s * (h // model.n_head) * 4 if llama else 0  # each layer's cos, sin tables (fp32)
    per_layer = activation_bytes_per_layer(recompute=lay.recompute, **kw) + (head_major + rope) * (
        lay.recompute != "full"
    )
    unrecomputed = activation_bytes_per_layer(recompute="none", **kw) + head_major + rope
    sp_div = t if lay.sequence_parallel else 1
    layers = math.ceil(model.n_layer / lay.pp)
    embed_extra = (s * b * h / sp_div) if model.dropout else 0
    norm_and_head = s * b * h * (RMS_NORM_BYTES + act if llama else 2 * act)  # (+ LM head input)
    head_extra = norm_and_head / sp_div + 4 * s * b * model.vocab_size / t
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


def stage_states(lay: Layout, stage: dict, padded: bool = False) -> dict[str, dict]:
    """Model-state bytes per GPU (`formulas.model_state_bytes`) on the first and on the last
    stage: ZeRO shards the dense states over their replicas, the dp × cp ranks (context
    parallel's ranks hold the same weights: Megatron and torchtitan shard over both), and the
    experts' over theirs, dp/ep × cp. `stage`: params_per_stage."""
    sharding = (lay.zero, lay.precision, lay.offload, padded)
    replicas = lay.dp * lay.cp
    experts = model_state_bytes(stage["experts"], replicas // lay.ep, *sharding)
    return {
        where: {
            k: v + experts[k]
            for k, v in model_state_bytes(stage[where], replicas, *sharding).items()
        }
        for where in STAGES
    }


@dataclass(frozen=True)
class Memory:
    """One GPU's bytes on the worse of the first and last pipeline stage (the plan's JSON)."""

    expert_params_per_gpu: float
    params_bytes: float
    grads_bytes: float
    optim_bytes: float
    master_bytes: float
    cpu_offload_bytes: float  # optimizer state kept on the host (--offload)
    model_state_bytes_per_gpu: float
    activation_bytes_per_gpu: float
    activation_bytes_per_microbatch: float  # of the whole model
    activation_bytes_per_layer: float
    in_flight_microbatches: float
    recompute_working_bytes: float
    zero3_gather_bytes: float  # ZeRO-3: the gathered block in use and the next, prefetched
    memory_bytes_per_gpu: float
    worst_stage: str
    usable_bytes_per_gpu: float
    fits: bool


def memory_per_gpu(
    model: ModelConfig,
    lay: Layout,
    cluster: Cluster,
    eff: Efficiency,
    padded: bool = False,
    stage: dict | None = None,
    acts: dict | None = None,
) -> Memory:
    """Model states + activations (+ the block recompute redoes, + ZeRO-3's gathered blocks) on
    the stage that needs more; `stage` and `acts` as params_per_stage and activation_memory."""
    stage = stage or params_per_stage(model, lay.tp, lay.pp, lay.ep)
    acts = acts or activation_memory(model, lay)
    states = stage_states(lay, stage, padded)
    gathered = lay.zero == 3 and lay.dp * lay.cp > 1
    zero3 = 2 * stage["block"] * PRECISION_BYTES[lay.precision][0] if gathered else 0.0
    totals = {
        where: states[where]["total_bytes"]
        + acts[f"{where}_stage_bytes"]
        + acts["recompute_working_bytes"]
        + zero3
        for where in STAGES
    }
    worst = max(totals, key=totals.get)
    usable = cluster.gpu.memory_bytes * eff.usable_memory
    kept = states[worst]
    return Memory(
        expert_params_per_gpu=stage["experts"],
        params_bytes=kept["params_bytes"],
        grads_bytes=kept["grads_bytes"],
        optim_bytes=kept["optim_bytes"],
        master_bytes=kept["master_bytes"],
        cpu_offload_bytes=kept["cpu_bytes"],
        model_state_bytes_per_gpu=kept["total_bytes"],
        activation_bytes_per_gpu=acts[f"{worst}_stage_bytes"],
        activation_bytes_per_microbatch=acts["per_microbatch_model_bytes"],
        activation_bytes_per_layer=acts["per_layer_bytes"],
        in_flight_microbatches=acts["in_flight_microbatches"],
        recompute_working_bytes=acts["recompute_working_bytes"],
        zero3_gather_bytes=zero3,
        memory_bytes_per_gpu=totals[worst],
        worst_stage=worst,
        usable_bytes_per_gpu=usable,
        fits=totals[worst] <= usable,
    )
