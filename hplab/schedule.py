"""Pipeline schedules as plain data, and a simulator that runs them — no torch needed.

A pipeline cuts the model's layers into p **stages**, one per rank, and the batch into m
**microbatches**. A **schedule** is the order in which each rank runs the forward (F) and the
backward (B) of each microbatch on each of its model chunks. This file writes every schedule
as data — for each rank a list of actions — so that one list can be printed, simulated with
given costs, checked for deadlocks, drawn, and run for real by `hplab.pp.PipelineExecutor`:

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

The **bubble** is the idle time left at the start and end of a step, while the pipeline
fills and drains; its textbook formulas live in `hplab.formulas` (`bubble_formula`).

This file reads in three parts:

1. **Actions and schedules**: F, B, W with a microbatch and a chunk id; each schedule's
   per-rank compute order; then the sends and receives those orders need.
2. **Simulator**: the same lists, run with given F, B, W costs, give the ideal timeline (and
   prove the schedule cannot deadlock).
3. **Measured bubble**: the same idle share, from the timestamps a real run recorded.

Only the standard library is used, so the labs' schedule drawings and the planner load fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplab.formulas import SCHEDULES

COMPUTE = ("F", "B", "W")


class PipelineError(ValueError):
    """A pipeline that cannot be built as asked; the message says how to fix it."""


class DeadlockError(RuntimeError):
    """A schedule in which some rank waits forever for a message."""


def chunk_owner(chunk: int, p: int) -> int:
    """Model chunk c lives on rank c mod p (with v chunks per rank, rank r holds chunks
    r, r+p, r+2p, ...: the interleaved layout; with v = 1 chunk c is simply rank c)."""
    return chunk % p


# =========================================================================================
# 1. Schedules: per rank, a plain list of actions
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
# 2. Simulator: the same action lists, with given costs
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
# 3. The measured bubble: the same idle share, from a real run's timestamps
# =========================================================================================

def measured_bubble(trace: list[dict], origin: float = 0.0, end: float | None = None) -> float:
    """1 - compute time / step time, from a rank's trace (times in seconds). The step runs
    from `origin` to `end` (default: this rank's first and last event)."""
    compute = [e for e in trace if e["kind"] in COMPUTE]
    if not compute:
        return 0.0
    end = max(e["end_s"] for e in compute) if end is None else end
    busy = sum(e["end_s"] - e["start_s"] for e in compute)
    return 1 - busy / (end - origin)
