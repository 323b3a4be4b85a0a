"""The formulas of distributed training, each in one place, with no torch.

Everything hplab measures has a formula from the papers next to it: the pipeline bubble, the
cost of a collective, a GPT's parameters and FLOPs, the bytes of its model states and
activations, for the library and the labs alike; only the standard library is imported.
The sources ([ZeRO], [PTD-P], [SP], [ZB], [Ring]) are cited in hplab/plan/__init__.py.
"""

from __future__ import annotations

import math

# --- 1. Pipeline schedules and the bubble  [PTD-P] Sec. 2.2, [ZB] ---------------------------------

#: The pipeline schedules hplab runs (pp.py), plans (plan/) and accepts (--schedule).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def bubble_formula(
    schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0, w: float = 1.0
) -> dict:
    """The textbook bubble of `schedule` (p stages, m microbatches, v chunks per rank when
    interleaved, F/B/W costs f, b, w): `relative`, the **bubble ratio** idle / compute time of a
    rank, and `of_step`, the **bubble fraction** idle / step time = relative / (1 + relative),
    which the plots and the measured traces show.

        GPipe, 1F1B   (p-1)/m                    of the step: (p-1)/(m+p-1)
        interleaved   (p-1)/(v·m)
        ZB-H1         (p-1)(f+b-w) / (m(f+b+w))  (f=b=w: (p-1)/(3m), a third of 1F1B's)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    relative, text = {
        "gpipe": ((p - 1) / m, "(p-1)/m"),
        "1f1b": ((p - 1) / m, "(p-1)/m"),
        "interleaved": ((p - 1) / (v * m), "(p-1)/(v·m)"),
        "zb-h1": ((p - 1) * (f + b - w) / (m * (f + b + w)), "(p-1)(F+B-W)/(m(F+B+W))"),
    }[schedule]
    return {"relative": relative, "of_step": relative / (1 + relative), "formula": text}


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, **costs) -> float:
    """Idle share of the step, (p−1)/(m+p−1) for GPipe and 1F1B: the bubble as the plots,
    `plan.simulate.Simulation.bubble_fraction` and the metrics file's measured
    `bubble_fraction` give it."""
    return bubble_formula(schedule, p, m, v, **costs)["of_step"]


def bubble_ratio(schedule: str, p: int, m: int, v: int = 1, **costs) -> float:
    """Idle time relative to compute time, (p−1)/m for GPipe and 1F1B: the form the papers
    write and the planner multiplies by the compute time to get the bubble's seconds."""
    return bubble_formula(schedule, p, m, v, **costs)["relative"]


def in_flight_microbatches(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
) -> float:
    """How many microbatches' activations the first pipeline stage holds at its peak. GPipe
    runs all m forwards before any backward: m. 1F1B (PipeDream-Flush, [PTD-P] Sec. 2.2) starts
    backward after pp warm-up forwards: min(pp, m). Interleaved with v chunks per rank holds
    (L/pp)·(pp + (pp−1)/v) layers' worth, i.e. pp·(1 + (pp−1)/(pp·v)) ([SP] Sec. 4.2.3). ZB-H1
    keeps 1F1B's peak ([ZB] Sec. 3). Without a pipeline, microbatches run one by one."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved":
        return min(pp + (pp - 1) / virtual_stages, microbatches)
    return min(pp, microbatches)


# --- 2. Collectives: bus bytes and the α-β model of ring algorithms  [Ring] -----------------------

#: Ring steps per (n − 1) ranks: an all-reduce is a reduce-scatter, then an all-gather.
RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def alpha_beta_terms(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth factor) of the ring algorithm for `op` among n ranks:

        T(S) = steps · α + factor · S / β

    A ring collective takes RING_STEPS[op]·(n−1) steps, each moving 1/n of the payload, so
    factor = steps / n: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (pairwise;
    the 1/n a rank addresses to itself stays home) (n-1)/n. Broadcast, send, recv: 1 step, 1."""
    if op not in RING_STEPS:
        return 1, 1.0
    steps = RING_STEPS[op] * (n - 1)
    return steps, steps / n


def bus_factor(op: str, n: int) -> float:
    """How many payload-sizes cross each rank's link for `op` among n ranks (ring): the
    nccl-tests "bus bytes" factor, `alpha_beta_terms(op, n)[1]`."""
    return alpha_beta_terms(op, n)[1]


def collective_time_s(
    op: str, nbytes: float, n: int, bw: float, alpha: float, calls: int = 1
) -> float:
    """Seconds of `calls` ring `op`s moving nbytes in all among n ranks, link β = bw bytes/s,
    α = alpha s per step: calls·steps·α + factor·S/β (all-reduce: 2(n−1)·α + 2(n−1)/n · S/β)."""
    if n <= 1:
        return 0.0
    steps, factor = alpha_beta_terms(op, n)
    return calls * steps * alpha + factor * nbytes / bw


def ddp_exposed_comm_s(
    bucket_bytes: list[float],
    window_s: float,
    n: int,
    bw: float,
    alpha: float,
    tied_bytes: float = 0.0,
) -> float:
    """Seconds of a DDP step's gradient all-reduces that backward does not hide, on a link of
    β = bw bytes/s and α = alpha s per ring step (`collective_time_s`: the emulated wire's).
    Backward produces the gradients during its last `window_s` seconds, at a steady rate of
    bytes (a transformer's blocks are alike), but a tied embedding's `tied_bytes` only when it
    ends (both of its uses summed). Bucket i (S_i bytes, in launch order) is ready with its last
    gradient; the link takes the buckets one at a time:

        ready_i = W · min(1, (S_1 + … + S_i) / (S − S_tied))
        end_i   = max(ready_i, end_(i−1)) + 2(n−1)·α + 2(n−1)/n · S_i / β
        exposed = max(0, end_last − W)

    One bucket: 2(n−1)·α + 2(n−1)/n · S/β, none of it hidden; k buckets pay k·2(n−1)·α."""
    steady = sum(bucket_bytes) - tied_bytes
    made = 0.0
    end = 0.0
    for size in bucket_bytes:
        made += size
        ready = window_s * min(1.0, made / steady) if steady > 0 else window_s
        end = max(ready, end) + collective_time_s("all_reduce", size, n, bw, alpha)
    return max(0.0, end - window_s)


def ddp_bucket_speedup_bound(
    compute_s: float, window_s: float, comm_s: float, tied_comm_s: float
) -> float:
    """The most buckets can gain over one bucket (α aside): (C + X) / (C + max(X_tied,
    X − W)), with C the step's compute, X the all-reduce's time on the link, X_tied the tied
    embedding's part (sent only after backward) and W the backward window that gradients come
    out of (see ddp_exposed_comm_s)."""
    return (compute_s + comm_s) / (compute_s + max(tied_comm_s, comm_s - window_s))


def moe_all_to_all_bytes(
    sent: int, received: int, n_embd: int, n_experts: int, dtype_bytes: int = 4
) -> int:
    """Payload bytes of one rank's all-to-alls for one MoE layer in one training step under
    expert parallel: the counts (E int64), the dispatch (its `sent` token-slots, h values each)
    and the combine (the `received` slots, sent back), each again in backward (the reverse
    exchange): 8·E + 2·(sent + received)·h·bytes. Balanced: sent = received = T·k."""
    return 8 * n_experts + 2 * (sent + received) * n_embd * dtype_bytes


# --- 3. The model: Ψ, hplab's presets, FLOPs  [PTD-P] ---------------------------------------------


def gpt_num_params(
    n_layer: int, n_embd: int, vocab_size: int, seq_len: int, n_experts: int = 0
) -> int:
    """Ψ of GPT-2 (tied embedding / LM head, learned positions, biases everywhere):

        Ψ = V·h + S·h + L·(12h² + 13h) + 2h

    per block: QKV 3h²+3h, attention projection h²+h, MLP 4h²+4h and 4h²+h, two layer
    norms 4h; then the final layer norm 2h. E experts (n_experts > 0) swap each MLP for E of
    them, L·E·(8h² + 5h) *expert* parameters, and a router h·E; the rest is *dense*."""
    h = n_embd
    L = n_layer
    E = n_experts
    moe = L * ((E - 1) * (8 * h * h + 5 * h) + h * E) if E else 0
    return vocab_size * h + seq_len * h + L * (12 * h * h + 13 * h) + 2 * h + moe


def llama_num_params(
    n_layer: int, n_embd: int, vocab_size: int, kv_width: int, intermediate: int,
    tied: bool = True, qkv_bias: bool = False,
) -> int:  # fmt: skip
    """Ψ of a Llama, V·h·(1 if tied else 2) + L·(2h² + 2h·h_kv + 3h·I + 2h) + h: per block q and o
    h² each, k and v h·h_kv (h_kv = h·n_kv_head/n_head), gate, up, down h·I, two RMSNorm gains
    (no position table, no biases; Qwen2 adds h + 2h_kv a block); then the final norm."""
    h = n_embd
    kv = kv_width
    block = 2 * h * h + 2 * h * kv + 3 * h * intermediate + 2 * h + (h + 2 * kv) * qkv_bias
    return vocab_size * h * (1 if tied else 2) + n_layer * block + h


def training_flops_per_token(num_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """FLOPs to train on one token: 6Ψ for the matmuls with the weights (2 forward, 4 backward)
    plus 12·L·h·s for attention's scores and weighted sum (Chinchilla / PaLM appendix)."""
    return 6 * num_params + 12 * n_layer * n_embd * seq_len


def flops_per_step(model, batch_size: int, recompute: str = "none") -> dict:
    """Floating-point operations of one training step on the whole global batch B, for a
    `model` with sizes n_layer, n_embd, seq_len, vocab_size (`config.ModelConfig`).

    [PTD-P] Appendix: a block's forward costs 24·B·s·h² (the four matrix multiplies) plus
    4·B·s²·h (scores and their product with V); the LM head 2·B·s·h·V. Backward costs twice
    the forward, so a step is 3× forward (model FLOPs, what MFU counts):
        F = 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h))
    Full recompute runs every block's forward once more:
        F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))
    Selective recompute redoes only the score part, 4·B·s²·h per block ([SP] Sec. 5).
    Hardware FLOPs (with recompute) are what [PTD-P] reports as achieved TFLOP/s. With E
    experts (`model.n_experts`) a token runs only its top-k: the MLP's 16·B·s·h² becomes
    k·16·B·s·h² plus the router's 2·B·s·h·E (Switch Transformer's "FLOPs per token").
    """
    B = batch_size
    s = model.seq_len
    h = model.n_embd
    L = model.n_layer
    V = model.vocab_size
    E = model.n_experts  # (dense: E = 0)
    k = model.moe_top_k if model.n_experts else 1
    block_fwd = 8 * B * s * h * h + k * 16 * B * s * h * h + 2 * B * s * h * E + 4 * B * s * s * h
    head_fwd = 2 * B * s * h * V
    model_flops = 3 * (L * block_fwd + head_fwd)
    extra = {"none": 0, "selective": L * 4 * B * s * s * h, "full": L * block_fwd}[recompute]
    return {
        "model_flops": model_flops,
        "hardware_flops": model_flops + extra,
        "block_fwd_flops": block_fwd / B,
        "head_fwd_flops": head_fwd / B,
    }


# --- 4. Memory: model states [ZeRO] and activations [SP] ------------------------------------------

RMS_NORM_BYTES = 8  # torch's RMSNorm, computing in fp32, keeps its input and the normalized one
PRECISION_BYTES = {  # bytes per element: (param, grad, master, optimizer state, activation)
    "fp32": (4, 4, 0, 8, 4),
    "bf16": (2, 2, 4, 8, 2),
    "fp16": (2, 2, 4, 8, 2),
}


def model_state_bytes(
    psi: float,
    dp: int = 1,
    zero: int = 0,
    precision: str = "bf16",
    offload: bool = False,
    padded: bool = False,
) -> dict:
    """Bytes per GPU of the model states of Ψ parameters, by kind. [ZeRO] Sec. 3.1 and 5.

    Mixed precision with Adam holds 2Ψ (fp16/bf16 params) + 2Ψ (grads) + KΨ with K = 12
    (fp32 master copy 4Ψ, exp_avg 4Ψ, exp_avg_sq 4Ψ): 16Ψ in all. Pure fp32 holds
    4Ψ + 4Ψ + 8Ψ and no master copy. With N_d data-parallel ranks, ZeRO shards:

        stage 0 (DDP)   (2 + 2 + K)·Ψ
        stage 1 (P_os)  2Ψ + 2Ψ + K·Ψ/N_d
        stage 2 (P_os+g)  2Ψ + (2 + K)·Ψ/N_d
        stage 3 (P_os+g+p)  (2 + 2 + K)·Ψ/N_d

    `padded`: hplab (like DeepSpeed) shards one flat buffer padded up to a multiple of N_d, so
    each shard holds ceil(Ψ/N_d) elements. `offload` moves optimizer state and master weights
    to host memory (ZeRO-Offload); they are reported under `cpu_bytes`.
    """
    p_bytes, g_bytes, m_bytes, o_bytes, _ = PRECISION_BYTES[precision]
    shard = psi / dp  # what each data-parallel rank keeps of a sharded state
    if padded and dp > 1:
        shard = math.ceil(shard)
    out = {
        f"{kind}_bytes": nbytes * (shard if zero >= stage else psi)
        for kind, nbytes, stage in [
            ("params", p_bytes, 3),
            ("grads", g_bytes, 2),
            ("optim", o_bytes, 1),
            ("master", m_bytes, 1),
        ]
    }
    out["cpu_bytes"] = 0.0
    if offload:
        out["cpu_bytes"] = out["optim_bytes"] + out["master_bytes"]
        out["optim_bytes"] = out["master_bytes"] = 0.0
    out["total_bytes"] = sum(v for k, v in out.items() if k != "cpu_bytes")
    return out


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    act_bytes: int = 2,
    dropout: bool = True,
    flash_attention: bool = False,
    moe_top_k: int = 0,
    kv: int | None = None,
    swiglu: int | None = None,
) -> float:
    """Bytes one transformer block saves for backward, for one microbatch. [SP] Sec. 4.

    Counted tensor by tensor (s sequence, b microbatch, h hidden, a heads, t tensor parallel):
      * outside the tensor-parallel regions, replicated on all t ranks unless sequence
        parallel splits them: the inputs of both layer norms, of QKV and of the first MLP
        matrix (4·sbh elements) and two dropout masks (2·sbh bytes);
      * inside them, split by t: Q, K, V, the attention projection's input, the GeLU input and
        the second MLP matrix's input (12·sbh elements);
      * attention scores, split by t: softmax output, its dropout mask and the dropped-out
        scores (a·s²·b each) — FlashAttention instead keeps only a log-sum-exp per row (fp32);
      * a mixture of experts routing each token to `moe_top_k` = k of them keeps per token-slot
        the copy routed to its expert, the GeLU and second-matrix inputs, and the expert's
        output before and after its gate (hplab's sum over slots keeps it): k·11·sbh for the
        MLP's 8·sbh (the router's few T×E numbers are left out);
      * a Llama (`kv`: the K/V width n_kv_head·d; `swiglu`: the MLP width I) keeps K and V kv
        wide, and the gate's and up's outputs, silu(gate) and their product: 2·sbh + 2·sb·kv +
        4·sb·I inside (GPT-2's 12·sbh when kv = h, I = 2h); outside, the q/k/v and MLP inputs,
        and each RMSNorm its input and the normalized input in fp32 (`RMS_NORM_BYTES`).
    With 2-byte activations and dropout this is the paper's Table 2:
        no parallelism       sbh·(34 + 5as/h)
        tensor parallel      sbh·(10 + 24/t + 5as/(ht))
        + sequence parallel  sbh/t·(34 + 5as/h)
        selective recompute  drops the 5as/h term (the scores are recomputed; with a fused
                             attention only its log-sum-exp per row was left to drop)
        full recompute       keeps only the block input: 2sbh (2sbh/t with sequence parallel)
    """
    mask = 1 if dropout else 0
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (t if sequence_parallel else 1)
    outside = 4 * sbh * act_bytes + 2 * sbh * mask
    if swiglu:  # a Llama: each RMSNorm keeps its input in fp32 itself
        outside = 2 * sbh * act_bytes + 2 * RMS_NORM_BYTES * sbh
    attention = 2 * sbh + 2 * s * b * (h if kv is None else kv)
    mlp = 8 * sbh if swiglu is None else 4 * s * b * swiglu
    inside = (attention + (moe_top_k * (mlp + 3 * sbh) if moe_top_k else mlp)) * act_bytes
    if recompute == "selective":
        scores = 0  # recomputed in backward (a fused attention's log-sum-exp with them)
    elif flash_attention:
        scores = a * s * b * 4  # logsumexp, fp32
    else:
        scores = a * s * s * b * (act_bytes + mask + (act_bytes if dropout else 0))
    return outside / (t if sequence_parallel else 1) + (inside + scores) / t


def tensor_parallel_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    n_layer: int,
    vocab_size: int,
    t: int = 1,
    sequence_parallel: bool = False,
    act_bytes: int = 4,
) -> dict:
    """Bytes hplab's GPT (no dropout, fused attention) saves for backward on one tensor-parallel
    rank in one forward pass of b sequences of s tokens, by part. Per block, Korthikanti et al.'s
    sbh·(34 + 5as/h) ([SP] Table 2, `activation_bytes_per_layer`) without dropout masks and
    with fused attention (no a·s² scores, one fp32 log-sum-exp per row), in fp32:
        no parallelism       4·sbh·(4 + 12) + 4·asb
        tensor parallel      4·sbh·(4 + 12/t) + 4·asb/t
        + sequence parallel  4·sbh·(4 + 12)/t + 4·asb/t
    Beyond the blocks: the final layer norm's and the LM head's inputs (2·sbh elements, /t with
    sequence parallel) and the fp32 logits, 4·s·b·V/t bytes. With t > 1 hplab's vocab-parallel
    loss (`tp.vocab_parallel_cross_entropy`) also keeps exp(logits − max) for backward: another
    4·s·b·V/t (Megatron computes it in place and keeps one)."""
    sp_div = t if sequence_parallel else 1
    per_layer = activation_bytes_per_layer(
        s, b, h, a, t, sequence_parallel, act_bytes=act_bytes, dropout=False, flash_attention=True
    )
    logits = 4 * s * b * vocab_size / t
    return {
        "blocks": n_layer * per_layer,
        "head inputs": 2 * s * b * h * act_bytes / sp_div,
        "logits": logits,
        "loss's exp (vocab parallel)": logits if t > 1 else 0.0,
    }


# --- 5. The learning-rate schedule ----------------------------------------------------------------
LR_DECAYS = ("constant", "linear", "cosine")


def learning_rate(
    step: int,
    lr: float,
    warmup_steps: int = 0,
    decay: str = "constant",
    decay_steps: int = 0,
    min_lr: float = 0.0,
) -> float:
    """The lr of step `step` (from 0): warm-up lr·step/warmup_steps (Hugging Face's), then
    `decay` to min_lr at `decay_steps` (Megatron's), x = (step - warmup) / (decay - warmup):
    linear min_lr + (lr - min_lr)(1 - x), cosine min_lr + (lr - min_lr)(1 + cos πx)/2."""
    if decay not in LR_DECAYS:
        raise ValueError(f"unknown lr decay {decay!r}: choose one of {', '.join(LR_DECAYS)}")
    if step < warmup_steps:
        return lr * step / warmup_steps
    if decay == "constant":
        return lr
    x = min((step - warmup_steps) / max(decay_steps - warmup_steps, 1), 1.0)
    shape = 1 - x if decay == "linear" else (1 + math.cos(math.pi * x)) / 2
    return min_lr + (lr - min_lr) * shape


# --- 6. Context parallel: the sequence over cp ranks  [Ring attention], [Ulysses] ---------------
CP_STYLES = ("ring", "ulysses")
CP_SPLITS = ("zigzag", "contiguous")


def ring_attention_bytes(b: int, s: int, h: int, cp: int, elem_bytes: int = 4) -> dict:
    """Bytes one rank sends per layer in ring attention (b sequences of s tokens, K/V width h,
    n_kv_head·d under GQA): forward, cp-1 K/V blocks of 2·b·(s/cp)·h numbers; backward, the K/V
    blocks again and cp dK/dV blocks (one more hop brings each home), 2·(2cp-1)·b·s/cp·h."""
    block = 2 * b * s // cp * h * elem_bytes
    return {"forward": (cp - 1) * block, "backward": (2 * cp - 1) * block}


def ring_attention_hidden(cp: int) -> float:
    """The share of a rank's ring-attention transfers that compute can hide, per layer and
    step, if every transfer is shorter than the block computed under it: of the 3·cp − 2 hops
    (cp − 1 forward, 2·cp − 1 backward) all but the last, the dK/dV accumulator going home
    after the last block's gradients, (3·cp − 3)/(3·cp − 2). A hop longer than its block
    shows the difference too."""
    return (3 * cp - 3) / (3 * cp - 2)


def ulysses_bytes(b: int, s: int, h: int, cp: int, elem_bytes: int = 4) -> dict:
    """Payload bytes one rank sends per layer in Ulysses: all-to-alls of q, k, v (3·b·(s/cp)·h
    numbers) and of the output (b·(s/cp)·h) forward, the same two reversed backward."""
    return dict.fromkeys(("forward", "backward"), 4 * b * s // cp * h * elem_bytes)


def ring_attention_blocks(rank: int, cp: int, split: str) -> float:
    """How many (s/N)² blocks of scores rank `rank` of N = cp computes in ring attention, when
    a diagonal block is computed whole and then masked (a CPU does; fused GPU kernels skip
    masked tiles and compute the pairs, `cp.pairs_computed`): contiguous, its own block and the
    r earlier ones, r + 1; zig-zag, its own block and half of each other, (N + 1)/2."""
    return rank + 1 if split == "contiguous" else (cp + 1) / 2


# --- 7. ZeRO-3 on a link: what prefetch hides  [ZeRO] Sec. 7, PyTorch FSDP ------------------------
PREFETCH = ("both", "forward", "backward", "none")  # the passes that gather a unit ahead


def zero3_link_seconds(
    unit_bytes: list[float], n: int, bandwidth: float, latency: float = 0.0, prefetch="both"
) -> dict:
    """Per step of ZeRO-3 (`fully_shard`: a unit per block, then the root) on a link of β bytes/s
    and α s per ring step, each transfer t(S) = (n−1)·α + (n−1)/n·S/β (`collective_time_s`:
    an all-gather or a reduce-scatter, as the emulated wire runs it). `unit_bytes`: the bytes
    each unit gathers, the root's first, then the blocks' in forward order. Each unit is
    gathered for forward, again for backward, and its gradients reduce-scattered:

        total    = Σ_u 3·t(S_u)
        exposed  = what the rank waits out, if each block computes at least as long as the
                   transfers under it. Always: the root's gather before forward and before
                   backward, the first block's before forward, and the two last reduce-scatters
                   (the first block's, the root's). Without forward prefetch, + every other
                   block's gather in forward; without backward prefetch, + every block's gather in
                   backward and the other blocks' reduce-scatters (each queued ahead of one).
        hidden   = 1 − exposed / total: the share of the link's time run under compute"""
    if prefetch not in PREFETCH:
        raise ValueError(f"unknown prefetch {prefetch!r}: choose one of {', '.join(PREFETCH)}")
    t = [collective_time_s("all_gather", s, n, bandwidth, latency) for s in unit_bytes]
    root = t[0]
    first = t[1]
    later = sum(t[2:])
    exposed = 2 * root + first + first + root
    exposed += later * (prefetch in ("backward", "none"))
    exposed += (first + 2 * later) * (prefetch in ("forward", "none"))
    total = 3 * sum(t)
    return {"total_s": total, "exposed_s": exposed, "hidden": 1 - exposed / total}
