"""Pipeline parallel, from scratch.

The idea: cut the model's layers into `p` consecutive **stages**, one per rank. A batch flows
through the stages like cars through a car wash: rank 0 embeds the tokens and runs the first
layers, sends the activation to rank 1, which runs the next layers, ..., and the last rank
applies the LM head and the loss. Backward flows the other way: each rank receives the
gradient of its output, backpropagates through its layers, and sends the gradient of its
input to the rank before. Each rank holds only 1/p of the weights, and only point-to-point
messages of one activation cross the wire.

Done naively, only one rank works at a time. So the batch is cut into `m` **microbatches**:
while rank 1 works on microbatch 0, rank 0 already runs microbatch 1. The idle time left at
the start and end of a step is the **bubble**. A **schedule** is the order in which each rank
runs forwards (F) and backwards (B) of the microbatches:

    GPipe        all F, then all B.                 bubble (p-1)/(m+p-1) of the step,
                                                    every rank holds m microbatches' activations
    1F1B         p-rank-1 warm-up F, then alternate  same bubble, but rank r holds at most
                 one F and one B, then cool-down B.  p-r microbatches' activations
    interleaved  each rank holds v model chunks      bubble (p-1)/(v·m) of the compute
                 (layers r, r+p, r+2p, ... of p·v),  (v times smaller; v times more messages)
                 1F1B over (microbatch, chunk) units
    ZB-H1        backward split into B (gradient of  bubble (p-1)(F+B-W)/(m(F+B+W)) of the
                 the input, on the critical path)    compute: a third of 1F1B's if F=B=W;
                 and W (weight gradients, can wait)  every rank holds up to p microbatches
                                                     (until their W): 1F1B's peak, rank 0

Gradients: each microbatch's loss is divided by m, so the accumulated gradients are those of
the mean loss over the whole batch — exactly what one process computes on the full batch.

This file reads in five parts:

1. **Stages**: split the GPT by layers (embedding on the first, head on the last); tied
   embedding / LM-head weights are kept equal by summing their gradients across the first
   and last stage, as Megatron-LM does.
2. **Schedules** as plain data: for each rank a list of actions — F, B, W with a microbatch
   and a chunk id, and the sends / receives they need.
3. **Simulator**: the same lists, run with given F, B, W costs, give the ideal timeline (and
   prove the schedule cannot deadlock).
4. **Executor**: runs this rank's list for real, with point-to-point messages, and records a
   timestamped trace of every action and the activations held.
5. **Bubble formulas**, to put next to the simulated and measured bubbles.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

COMPUTE = ("F", "B", "W")


class PipelineError(ValueError):
    """A pipeline that cannot be built as asked; the message says how to fix it."""


class DeadlockError(RuntimeError):
    """A schedule in which some rank waits forever for a message."""


# =========================================================================================
# 1. Stages
# =========================================================================================

def split_layers(n_layer: int, num_chunks: int) -> list[range]:
    """Balanced consecutive layer ranges: the first `n_layer % num_chunks` chunks get one
    layer more. Every chunk needs at least one layer."""
    if num_chunks > n_layer:
        raise PipelineError(
            f"{num_chunks} pipeline chunks (--pp × --virtual-stages) but the model has only "
            f"{n_layer} layers: use at most {n_layer} chunks or more layers (--n-layer)")
    base, extra = divmod(n_layer, num_chunks)
    bounds = [0]
    for c in range(num_chunks):
        bounds.append(bounds[-1] + base + (c < extra))
    return [range(bounds[c], bounds[c + 1]) for c in range(num_chunks)]


def chunk_owner(chunk: int, p: int) -> int:
    """Model chunk c lives on rank c mod p (with v chunks per rank, rank r holds chunks
    r, r+p, r+2p, ...: the interleaved layout; with v = 1 chunk c is simply rank c)."""
    return chunk % p


class Stage(nn.Module):
    """One model chunk: the embedding (first chunk only), some blocks, the head (last only).

    Its registered submodules are only the pieces it owns, so `stage.parameters()` is the
    chunk's own weights. On the last chunk `lm_head.weight` is the same tensor as `wte.weight`
    (tied); when first and last chunk live on different ranks, each rank has its own copy and
    `sync_tied_gradients` keeps the copies equal.
    """

    def __init__(self, gpt, chunk: int, num_chunks: int, layers: range):
        super().__init__()
        self.__dict__["gpt"] = gpt  # the model the pieces come from (not registered here)
        self.chunk, self.layers = chunk, layers
        self.is_first, self.is_last = chunk == 0, chunk == num_chunks - 1
        if self.is_first:
            self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe
        self.blocks = nn.ModuleList(gpt.transformer.h[i] for i in layers)
        if self.is_last:
            self.ln_f, self.lm_head = gpt.transformer.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first chunk) or an activation in; an activation or logits out."""
        if self.is_first:
            x = self.gpt.embed(x)
        for block in self.blocks:
            x = self.gpt.run_block(block, x)
        return self.gpt.head(x) if self.is_last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss: mean cross-entropy over the microbatch's tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_stages(gpt, rank: int, p: int, virtual_stages: int = 1) -> list[Stage]:
    """The chunks this pipeline rank runs, in chunk order."""
    num_chunks = p * virtual_stages
    layers = split_layers(gpt.config.n_layer, num_chunks)
    return [Stage(gpt, c, num_chunks, layers[c]) for c in range(num_chunks)
            if chunk_owner(c, p) == rank]


def stage_parameters(stages: list[Stage]) -> list[nn.Parameter]:
    """This rank's parameters, each once (a tied weight owned twice is listed once)."""
    seen, params = set(), []
    for stage in stages:
        for p in stage.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


@torch.no_grad()
def free_unowned_parameters(gpt, stages: list[Stage]) -> None:
    """Every rank built the whole model from the seed (so initial weights do not depend on the
    layout); a pipeline rank keeps only its own layers and lets the rest go."""
    owned = {id(p) for p in stage_parameters(stages)}
    for p in gpt.parameters():
        if id(p) not in owned:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.requires_grad_(False)


def tied_embedding_group(mesh):
    """A communicator between the first and the last pipeline rank of this rank's pipeline,
    for the tied embedding / LM-head gradient (Megatron's "embedding group"). Every rank
    takes part in creating every group (torch.distributed requires it); ranks outside any
    group get None, as do pipelines of one stage."""
    from hplab.comm import Communicator

    mine = None
    for ranks in mesh.groups["pp"]:
        if len(ranks) < 2:
            continue
        ends = [ranks[0], ranks[-1]]
        group = dist.new_group(ends)
        if mesh.rank in ends:
            mine = Communicator(group, "pp", mesh.ledger, ends, mesh.device)
    return mine


def sync_tied_gradients(stages: list[Stage], tied_comm) -> None:
    """The first chunk's embedding and the last chunk's LM head are one weight in the model.
    Split across two ranks, each copy gets only its own use's gradient; summing the two
    gradients gives both copies the true gradient, so both take the same optimizer step and
    stay equal (they started equal: same seed)."""
    if tied_comm is None:
        return
    ends = [s for s in stages if s.is_first or s.is_last]
    if not ends:
        return
    weight = ends[0].wte.weight if ends[0].is_first else ends[0].lm_head.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    tied_comm.all_reduce(weight.grad)


# =========================================================================================
# 2. Schedules: per rank, a plain list of actions
# =========================================================================================

@dataclass(frozen=True)
class Action:
    """One step of one rank's program.

    kind: "F" forward, "B" backward (input gradient; with no W in the schedule, also the
    weight gradients), "W" weight gradients; "send_act"/"recv_act" an activation,
    "send_grad"/"recv_grad" an activation's gradient. `chunk` is the local chunk the action
    belongs to; `peer` is the other rank of a send or receive.
    """

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        tail = f"{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")
        return f"{self.kind}{tail}" + (f"→{self.peer}" if self.kind.startswith("send") else
                                        f"←{self.peer}" if self.kind.startswith("recv") else "")


def message_key(action: Action, num_chunks: int) -> tuple:
    """Which message a send or receive carries: (activation or gradient, microbatch, the chunk
    that consumes it). A send and a receive match when their keys are equal."""
    if action.kind == "send_act":
        return ("act", action.microbatch, action.chunk + 1)
    if action.kind == "recv_act":
        return ("act", action.microbatch, action.chunk)
    if action.kind == "send_grad":
        return ("grad", action.microbatch, action.chunk - 1)
    if action.kind == "recv_grad":
        return ("grad", action.microbatch, action.chunk)
    raise ValueError(f"{action.kind} is not a message")


def gpipe_order(p: int, m: int) -> list[list[tuple]]:
    """GPipe (Huang et al. 2019): every forward, then every backward."""
    return [[("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)] for r in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[list[tuple]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r runs p-r-1 warm-up forwards, then
    alternates one forward and one backward, then finishes the remaining backwards. A
    microbatch's activations are freed by its backward, so rank r never holds more than p-r."""
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, r), ("B", i, r)]
        order += [("B", i, r) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def interleaved_order(p: int, m: int, v: int) -> list[list[tuple]]:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): rank r holds chunks r, r+p, ...
    It runs units of (microbatch, chunk) in groups of p microbatches per chunk: forward unit k
    is chunk (k // p) % v of microbatch (k // pv)·p + k % p; backward units go through the
    chunks in reverse. Warm-up is longer than 1F1B's: 2(p-r-1) + (v-1)p units."""
    if m % p:
        raise PipelineError(
            f"the interleaved schedule runs microbatches in groups of p={p}, but --microbatches "
            f"is {m}: use a multiple of {p}")

    def unit(k: int, forward: bool) -> tuple[int, int]:
        local = (k // p) % v
        local = local if forward else v - 1 - local
        return (k // (p * v)) * p + k % p, local

    orders = []
    for r in range(p):
        total = m * v
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = []
        for k in range(warmup):
            mb, local = unit(k, True)
            order.append(("F", mb, local * p + r))
        for k in range(total - warmup):
            mb, local = unit(warmup + k, True)
            order.append(("F", mb, local * p + r))
            mb, local = unit(k, False)
            order.append(("B", mb, local * p + r))
        for k in range(total - warmup, total):
            mb, local = unit(k, False)
            order.append(("B", mb, local * p + r))
        orders.append(order)
    return orders


def zb_h1_order(p: int, m: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward is split in B,
    the gradient of the stage's input (the previous rank waits for it), and W, the gradients
    of the weights (nobody waits for them), so W can fill the bubbles.

    Rank r repeats the triple (F of microbatch x, B of x-(p-1-r), W of x-(p-1)) for
    x = 0, 1, ..., m+p-2, leaving out microbatches outside 0..m-1. Its F and B follow 1F1B
    (p-r-1 forwards ahead), while every W is p-1 microbatches behind its F: on the last rank
    W waits for up to p-1 later backwards, which shortens the chain of B's the first rank
    waits for. A microbatch is held until its W: at most p at once, 1F1B's peak (rank 0)."""
    orders = []
    for r in range(p):
        order = []
        for x in range(m + p - 1):
            for kind, mb in (("F", x), ("B", x - (p - 1 - r)), ("W", x - (p - 1))):
                if 0 <= mb < m:
                    order.append((kind, mb, r))
        orders.append(order)
    return orders


def add_communication(orders: list[list[tuple]], p: int, v: int) -> list[list[Action]]:
    """Turn per-rank compute orders into full action lists with sends and receives.

    Send: right after the F (B) that produced the activation (gradient) — sends never block.
    Receive: posted before the computation that needs it; and receives from one peer are
    posted in the order that peer sends (messages between two ranks are matched in order,
    on NCCL and gloo alike), so a receive may be posted early, never late.
    """
    num_chunks = p * v
    plans: list[list[Action]] = []
    for r in range(p):
        plan = []
        for kind, mb, chunk in orders[r]:
            plan.append(Action(kind, mb, chunk))
            if kind == "F" and chunk < num_chunks - 1:
                plan.append(Action("send_act", mb, chunk, chunk_owner(chunk + 1, p)))
            if kind == "B" and chunk > 0:
                plan.append(Action("send_grad", mb, chunk, chunk_owner(chunk - 1, p)))
        plans.append(plan)
    # what each rank sends to each peer, in order, as receive actions on the peer
    sent_to: dict[tuple[int, int], list[Action]] = {}
    for r, plan in enumerate(plans):
        for a in plan:
            if a.kind.startswith("send"):
                key = message_key(a, num_chunks)
                kind = "recv_act" if key[0] == "act" else "recv_grad"
                sent_to.setdefault((r, a.peer), []).append(Action(kind, key[1], key[2], r))
    full = []
    for r, plan in enumerate(plans):
        posted = {src: 0 for (src, dst) in sent_to if dst == r}
        out = []
        for a in plan:
            needs = (a.kind == "F" and a.chunk > 0) or (a.kind == "B" and a.chunk < num_chunks - 1)
            if needs:
                src = chunk_owner(a.chunk - 1 if a.kind == "F" else a.chunk + 1, p)
                kind = "recv_act" if a.kind == "F" else "recv_grad"
                want = Action(kind, a.microbatch, a.chunk, src)
                queue = sent_to[(src, r)]
                while want not in queue[:posted[src]]:
                    out.append(queue[posted[src]])
                    posted[src] += 1
            out.append(a)
        full.append(out)
    return full


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The action list of every rank for schedule `name` with p ranks, m microbatches and
    (interleaved only) v chunks per rank."""
    if name not in SCHEDULES:
        raise PipelineError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if p < 2:
        raise PipelineError(f"a pipeline needs at least 2 stages, got --pp {p}")
    if m < 1:
        raise PipelineError(f"--microbatches must be at least 1, got {m}")
    if v < 1:
        raise PipelineError(f"--virtual-stages must be at least 1, got {v}")
    if name != "interleaved" and v != 1:
        raise PipelineError(f"--virtual-stages {v} needs --schedule interleaved "
                            f"(the {name} schedule runs one chunk per rank)")
    if name == "interleaved" and v < 2:
        raise PipelineError("the interleaved schedule needs --virtual-stages of at least 2 "
                            "(with 1 chunk per rank it is plain 1f1b)")
    orders = {"gpipe": lambda: gpipe_order(p, m), "1f1b": lambda: one_f_one_b_order(p, m),
              "interleaved": lambda: interleaved_order(p, m, v),
              "zb-h1": lambda: zb_h1_order(p, m)}[name]()
    return add_communication(orders, p, v)


def schedule_text(plans: list[list[Action]], compute_only: bool = True) -> str:
    """One line per rank, e.g. `rank 1: F0 F1 B0 F2 B1 ...` (chunk ids after a dot)."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in plan
                                              if not compute_only or a.kind in COMPUTE)
                     for r, plan in enumerate(plans))


# =========================================================================================
# 3. Simulator: the same action lists, with given costs
# =========================================================================================

@dataclass
class Simulation:
    """The ideal timeline: per rank, a list of (action, start, end); and the step's length."""

    timeline: list[list[tuple[Action, float, float]]]
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(end - start for a, start, end in self.timeline[rank] if a.kind in COMPUTE)

    def bubble_fraction(self, rank: int) -> float:
        """Idle share of the step on this rank: 1 - compute time / step time."""
        return 1 - self.busy(rank) / self.makespan

    def in_flight_max(self, rank: int) -> int:
        """Most microbatch-chunks whose activations the rank held at once (F done, its last
        backward piece — W if the schedule has one, else B — not yet)."""
        return in_flight_max([a for a, _, _ in self.timeline[rank]])


def in_flight_max(actions: list[Action]) -> int:
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    held = peak = 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == release)
        peak = max(peak, held)
    return peak


def simulate(plans: list[list[Action]], f: float = 1.0, b: float = 1.0, w: float = 1.0,
             latency: float = 0.0) -> Simulation:
    """Run the action lists with costs per whole stage and microbatch: F = f, B = b (input
    gradient), W = w (weight gradients); a schedule without W runs b + w in its B. A chunk of
    an interleaved stage costs 1/v of that. A message arrives `latency` after its send.

    Sends never wait. A computation waits for its input message. If no rank can move and some
    are not finished, the schedule deadlocks: DeadlockError names where each rank is stuck."""
    p = len(plans)
    num_chunks = p * max(1 + max(a.chunk for a in plan) // p for plan in plans)
    v = num_chunks // p
    split = any(a.kind == "W" for plan in plans for a in plan)
    cost = {"F": f / v, "B": (b if split else b + w) / v, "W": w / v}
    arrival: dict[tuple, float] = {}
    posted: list[set] = [set() for _ in range(p)]
    finished: list[set] = [set() for _ in range(p)]
    pos, clock = [0] * p, [0.0] * p
    timeline: list[list] = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                a = plans[r][pos[r]]
                if a.kind.startswith("send"):
                    arrival[message_key(a, num_chunks)] = clock[r] + latency
                    timeline[r].append((a, clock[r], clock[r]))
                elif a.kind.startswith("recv"):
                    posted[r].add(message_key(a, num_chunks))
                    timeline[r].append((a, clock[r], clock[r]))
                else:
                    before = {"B": "F", "W": "B"}.get(a.kind)
                    if before and (before, a.microbatch, a.chunk) not in finished[r]:
                        raise DeadlockError(f"rank {r} runs {a} before its {before}")
                    finished[r].add((a.kind, a.microbatch, a.chunk))
                    start = clock[r]
                    needs = ((a.kind == "F" and a.chunk > 0) or
                             (a.kind == "B" and a.chunk < num_chunks - 1))
                    if needs:
                        key = ("act" if a.kind == "F" else "grad", a.microbatch, a.chunk)
                        if key not in posted[r]:
                            raise DeadlockError(f"rank {r} runs {a} without receiving its input")
                        if key not in arrival:
                            break  # the sender has not got there yet
                        start = max(start, arrival[key])
                    clock[r] = start + cost[a.kind]
                    timeline[r].append((a, start, clock[r]))
                pos[r] += 1
                moved = True
    stuck = {r: str(plans[r][pos[r]]) for r in range(p) if pos[r] < len(plans[r])}
    if stuck:
        raise DeadlockError("schedule deadlocks: " + ", ".join(
            f"rank {r} waits at {a}" for r, a in stuck.items()))
    return Simulation(timeline, max(clock))


# =========================================================================================
# 4. Executor: run this rank's action list for real
# =========================================================================================

class DeferredWeightGrads:
    """Where a stage's Linear layers put their weight-gradient work during a split backward.

    ZB-H1's B computes only what the previous stage waits for: the gradient of the stage's
    input. Every Linear y = x Wᵀ + b has two backward products: dx = dy W (needed now) and
    dW = dyᵀ x (can wait). While `collecting` is a list, Linear layers put their dW, db work
    in it as closures; W runs them later. Layer-norm and embedding gradients are small and
    stay in B. When `collecting` is None everything is computed at once, as usual."""

    def __init__(self):
        self.collecting: list | None = None


class _LinearSplitBackward(torch.autograd.Function):
    """y = x Wᵀ + b, whose backward returns dx at once and defers dW, db when asked to."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferred):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.deferred = weight, bias, deferred  # parameters, not activations
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        grad_x = grad_y @ weight

        def weight_grads():
            dy, xs = grad_y.reshape(-1, grad_y.shape[-1]), x.reshape(-1, x.shape[-1])
            return dy.t() @ xs, (dy.sum(0) if bias is not None else None)

        if ctx.deferred.collecting is None:
            return (grad_x, *weight_grads(), None)

        def accumulate():
            for param, grad in zip((weight, bias), weight_grads()):
                if param is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)

        ctx.deferred.collecting.append(accumulate)
        return grad_x, None, None, None


def split_linear_backward(stage: Stage, deferred: DeferredWeightGrads) -> None:
    """Make every Linear of the stage run through `_LinearSplitBackward`."""
    for module in stage.modules():
        if isinstance(module, nn.Linear):
            module.forward = (lambda x, module=module:
                              _LinearSplitBackward.apply(x, module.weight, module.bias, deferred))


@dataclass
class TraceEvent:
    kind: str
    microbatch: int
    chunk: int
    start_s: float
    end_s: float

    def as_dict(self) -> dict:
        return {"kind": self.kind, "microbatch": self.microbatch, "chunk": self.chunk,
                "start_s": self.start_s, "end_s": self.end_s}


class PipelineExecutor:
    """Runs one rank's action list for one training step.

    `comm` is the pipeline group's Communicator (peers are pipeline ranks). Sends are
    asynchronous (isend) and awaited at the end of the step; a receive is posted (irecv) where
    the list says and awaited by the computation that needs it. `memory` (a MemoryLedger)
    measures each forward's saved activations; `trace` gets one event per action."""

    def __init__(self, stages: list[Stage], plan: list[Action], comm, memory=None,
                 dtype=torch.float32):
        self.stages = {s.chunk: s for s in stages}
        self.plan, self.comm = plan, comm
        self.memory = memory
        self.split_backward = any(a.kind == "W" for a in plan)
        self.deferred = DeferredWeightGrads()
        if self.split_backward:
            for s in stages:
                split_linear_backward(s, self.deferred)
        self.dtype = dtype
        self.loss_scale = 1.0  # fp16: the loss is multiplied by this before backward
        self.trace: list[TraceEvent] = []
        self.in_flight_max = 0
        self.activation_bytes_in_flight_max = 0

    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> list[float]:
        """One step: runs every action; returns the losses of the microbatches whose last chunk
        is here (empty on other ranks). Gradients are left accumulated in `.grad`."""
        m = len(inputs)
        device = inputs[0].device
        act_shape = (*inputs[0].shape, self.stages[next(iter(self.stages))].gpt.config.n_embd)
        stage_in, stage_out, input_grads = {}, {}, {}
        received: dict[tuple, tuple] = {}  # message key -> (buffer, pending)
        sends, weight_work, act_bytes = [], {}, {}
        held = held_bytes = 0
        self.trace = []
        release = "W" if self.split_backward else "B"
        step_losses = []
        t0 = time.perf_counter()

        def record(kind, a, start):
            self.trace.append(TraceEvent(kind, a.microbatch, a.chunk, start - t0,
                                         time.perf_counter() - t0))

        def wait_for(key, a):
            buffer, pending = received.pop(key)
            start = time.perf_counter()
            pending.wait()
            record("recv", a, start)
            return buffer

        for a in self.plan:
            sends = [s for s in sends if not s[1].is_completed()]  # free delivered buffers
            start = time.perf_counter()
            mb, c = a.microbatch, a.chunk
            if a.kind == "F":
                stage = self.stages[c]
                if stage.is_first:
                    x = inputs[mb]
                else:
                    x = wait_for(("act", mb, c), a).requires_grad_()
                    start = time.perf_counter()
                tracker = (self.memory.track_activations(exclude=stage.parameters())
                           if self.memory is not None else contextlib.nullcontext([0]))
                with tracker as counted:
                    out = stage(x)
                    if stage.is_last:
                        loss = stage.gpt.loss_fn(out, targets[mb])  # vocab-parallel under TP
                        step_losses.append(loss.detach())
                        out = loss * self.loss_scale / m  # 1/m of the batch's mean
                stage_in[(mb, c)], stage_out[(mb, c)] = x, out
                act_bytes[(mb, c)] = counted[0]
                held, held_bytes = held + 1, held_bytes + act_bytes[(mb, c)]
                self.in_flight_max = max(self.in_flight_max, held)
                self.activation_bytes_in_flight_max = max(self.activation_bytes_in_flight_max,
                                                          held_bytes)
                record("F", a, start)
            elif a.kind == "B":
                stage = self.stages[c]
                out = stage_out.pop((mb, c))
                if stage.is_last:
                    grad = None
                else:
                    grad = wait_for(("grad", mb, c), a)
                    start = time.perf_counter()
                self.deferred.collecting = [] if self.split_backward else None
                torch.autograd.backward(out, grad)
                if not stage.is_first:
                    input_grads[(mb, c)] = stage_in[(mb, c)].grad
                if self.split_backward:
                    weight_work[(mb, c)] = self.deferred.collecting
                self.deferred.collecting = None
                record("B", a, start)
            elif a.kind == "W":
                with torch.no_grad():  # plain products into .grad: no graph to build
                    for work in weight_work.pop((mb, c)):
                        work()
                record("W", a, start)
            elif a.kind in ("send_act", "send_grad"):
                tensor = (stage_out[(mb, c)].detach() if a.kind == "send_act"
                          else input_grads.pop((mb, c)))
                sends.append((tensor, self.comm.send(tensor, a.peer, async_op=True)))
                record("send", a, start)
            else:  # recv_act / recv_grad: post the receive now, wait for it when needed
                buffer = torch.empty(act_shape, dtype=self.dtype, device=device)
                key = ("act" if a.kind == "recv_act" else "grad", mb, c)
                received[key] = (buffer, self.comm.recv(buffer, a.peer, async_op=True))
            if a.kind == release:  # this microbatch's activations are gone
                freed = act_bytes.pop((mb, c))
                held, held_bytes = held - 1, held_bytes - freed
                stage_in.pop((mb, c))
                if self.memory is not None:
                    self.memory.release_activations(freed)
        for _, pending in sends:
            pending.wait()
        return [float(loss) for loss in step_losses]


def measured_bubble(trace: list[dict], origin: float = 0.0, end: float | None = None) -> float:
    """1 - compute time / step time, from a rank's trace (times in seconds). The step runs
    from `origin` to `end` (default: this rank's first and last event)."""
    compute = [e for e in trace if e["kind"] in COMPUTE]
    if not compute:
        return 0.0
    end = max(e["end_s"] for e in compute) if end is None else end
    busy = sum(e["end_s"] - e["start_s"] for e in compute)
    return 1 - busy / (end - origin)


# =========================================================================================
# 5. Bubble formulas
# =========================================================================================

def bubble_formula(name: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                   w: float = 1.0) -> dict:
    """The textbook bubble: `relative` = idle time / compute time per rank, and `of_step` =
    idle time / step time = relative / (1 + relative).

        GPipe, 1F1B   (p-1)/m                   of the step: (p-1)/(m+p-1)
        interleaved   (p-1)/(v·m)
        ZB-H1         (p-1)(f+b-w) / (m(f+b+w))  (f=b=w: (p-1)/(3m), a third of 1F1B's)
    """
    if name in ("gpipe", "1f1b"):
        relative = (p - 1) / m
        text = "(p-1)/m"
    elif name == "interleaved":
        relative = (p - 1) / (v * m)
        text = "(p-1)/(v·m)"
    elif name == "zb-h1":
        relative = (p - 1) * (f + b - w) / (m * (f + b + w))
        text = "(p-1)(F+B-W)/(m(F+B+W))"
    else:
        raise PipelineError(f"unknown schedule {name!r}")
    return {"relative": relative, "of_step": relative / (1 + relative), "formula": text}
