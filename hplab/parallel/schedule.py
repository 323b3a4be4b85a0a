"""Pipeline schedules as plain data, and a simulator that runs them — no torch needed.

A pipeline cuts the model's layers into p **stages**, one per rank, and the batch into m
**microbatches**. A **schedule** is the order in which each rank runs the forward (F) and the
backward (B) of each microbatch on each of its model chunks. Here every schedule is data — for
each rank a list of actions — that can be printed, simulated with given costs, checked for
deadlocks, drawn, and run for real by `hplab.parallel.pp.PipelineExecutor`:

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

The **bubble** is the idle time while the pipeline fills and drains (`formulas.bubble_formula`).
This file: 1. each schedule's per-rank compute order, and the sends and receives it needs; 2. a
simulator: the ideal timeline with given F, B, W costs, and the proof that no rank waits
forever. (The same idle share measured from a real run's timestamps: `hplab.observe.observers`.)
Standard library and hplab.config only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hplab.config import check_pipeline

COMPUTE = ("F", "B", "W")


class DeadlockError(RuntimeError):
    """A schedule in which some rank waits forever for a message."""


def chunk_owner(chunk: int, p: int) -> int:
    """Model chunk c lives on rank c mod p: rank r holds chunks r, r+p, r+2p, ... (interleaved)."""
    return chunk % p


# --- 1. Schedules: per rank, a plain list of actions ----------------------------------------------


@dataclass(frozen=True)
class Action:
    """One step of one rank's program. kind: "F", "B" (without W: the weight gradients too),
    "W"; "send_act" / "recv_act" an activation, "send_grad" / "recv_grad" its gradient.
    `chunk`: its model chunk (a receive: the chunk that consumes it); `peer`: the other rank."""

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        arrow = {"send": "→", "recv": "←"}.get(self.kind[:4])
        return (
            f"{self.kind}{self.microbatch}"
            + (f".{self.chunk}" if self.chunk else "")
            + (f"{arrow}{self.peer}" if arrow else "")
        )


def message_key(action: Action) -> tuple:
    """Which message a send or receive carries: (activation or gradient, microbatch, the chunk
    that consumes it). A send and a receive match when their keys are equal."""
    what, towards_consumer = {
        "send_act": ("act", 1),
        "recv_act": ("act", 0),
        "send_grad": ("grad", -1),
        "recv_grad": ("grad", 0),
    }[action.kind]
    return what, action.microbatch, action.chunk + towards_consumer


def input_message(a: Action, num_chunks: int) -> tuple | None:
    """The message computation `a` waits for: F its input activation (but on chunk 0: the
    tokens), B its output's gradient (but on the last chunk: the loss's); else None."""
    if a.kind == "F" and a.chunk > 0:
        return "act", a.microbatch, a.chunk
    if a.kind == "B" and a.chunk < num_chunks - 1:
        return "grad", a.microbatch, a.chunk
    return None


def gpipe_order(p: int, m: int) -> list[list[tuple]]:
    """GPipe (Huang et al. 2019): every forward, then every backward."""
    return [[("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)] for r in range(p)]


def _warm_up_then_alternate(forwards: list, backwards: list, warmup: int) -> list:
    """`warmup` forwards, then one forward and one backward in turn, then the backwards left."""
    steady = [a for pair in zip(forwards[warmup:], backwards) for a in pair]
    return forwards[:warmup] + steady + backwards[len(forwards) - warmup :]


def one_f_one_b_order(p: int, m: int) -> list[list[tuple]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r runs p-r-1 warm-up forwards, then
    alternates one forward and one backward, then finishes the remaining backwards. A
    microbatch's activations are freed by its backward, so rank r never holds more than p-r."""
    return [
        _warm_up_then_alternate(
            [("F", i, r) for i in range(m)], [("B", i, r) for i in range(m)], min(p - r - 1, m)
        )
        for r in range(p)
    ]


def interleaved_order(p: int, m: int, v: int) -> list[list[tuple]]:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): rank r holds chunks r, r+p, ...
    It runs units of (microbatch, chunk) in groups of p microbatches per chunk: forward unit k
    is chunk (k // p) % v of microbatch (k // pv)·p + k % p; backward units go through the
    chunks in reverse. Warm-up is longer than 1F1B's: 2(p-r-1) + (v-1)p units."""
    check_pipeline("interleaved", p, m, v)

    def unit(kind: str, k: int, r: int) -> tuple:
        local = (k // p) % v if kind == "F" else v - 1 - (k // p) % v
        return kind, (k // (p * v)) * p + k % p, local * p + r

    units = range(m * v)
    return [
        _warm_up_then_alternate(
            [unit("F", k, r) for k in units],
            [unit("B", k, r) for k in units],
            min(2 * (p - r - 1) + (v - 1) * p, m * v),
        )
        for r in range(p)
    ]


def zb_h1_order(p: int, m: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), B and W as in the table above.
    Rank r repeats the triple (F of microbatch x, B of x-(p-1-r), W of x-(p-1)) for
    x = 0, 1, ..., m+p-2, leaving out microbatches outside 0..m-1. Its F and B follow 1F1B
    (p-r-1 forwards ahead), while every W is p-1 microbatches behind its F: on the last rank
    W waits for up to p-1 later backwards, which shortens the chain of B's the first rank
    waits for."""
    return [
        [
            (kind, mb, r)
            for x in range(m + p - 1)
            for kind, mb in (("F", x), ("B", x - (p - 1 - r)), ("W", x - (p - 1)))
            if 0 <= mb < m
        ]
        for r in range(p)
    ]


def add_communication(orders: list[list[tuple]], p: int, v: int) -> list[list[Action]]:
    """Per-rank compute orders → full action lists. A send comes right after the F (B) that
    produced the activation (gradient): sends never block. A receive is posted before the
    computation that needs it, and receives from one peer in the order that peer sends
    (messages between two ranks match in order, on NCCL and gloo): early, never late."""
    num_chunks = p * v
    plans, queues = [], {}  # queues[sender, receiver]: the receiver's receives, in send order
    for r, order in enumerate(orders):
        plan = []
        for kind, mb, chunk in order:
            plan.append(Action(kind, mb, chunk))
            to = chunk + 1 if kind == "F" else chunk - 1  # the chunk that consumes the output
            if kind in ("F", "B") and 0 <= to < num_chunks:
                what, peer = "act" if kind == "F" else "grad", chunk_owner(to, p)
                plan.append(Action(f"send_{what}", mb, chunk, peer))
                queues.setdefault((r, peer), []).append(Action(f"recv_{what}", mb, to, r))
        plans.append(plan)
    full = []
    for r, plan in enumerate(plans):
        out, posted = [], set()
        for a in plan:
            key = input_message(a, num_chunks)
            sender = chunk_owner(a.chunk - 1 if a.kind == "F" else a.chunk + 1, p)
            while key is not None and key not in posted:  # the sender's messages, in order
                out.append(queues[sender, r].pop(0))
                posted.add(message_key(out[-1]))
            out.append(a)
        full.append(out)
    return full


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The action list of every rank for schedule `name` with p ranks, m microbatches and
    (interleaved only) v chunks per rank."""
    check_pipeline(name, p, m, v)
    orders = {
        "gpipe": gpipe_order,
        "1f1b": one_f_one_b_order,
        "zb-h1": zb_h1_order,
        "interleaved": lambda p, m: interleaved_order(p, m, v),
    }[name]
    return add_communication(orders(p, m), p, v)


def schedule_text(plans: list[list[Action]]) -> str:
    """One line per rank of its computations: `rank 0: F0 F1 B0 ...` (chunk after a dot)."""
    return "\n".join(
        f"rank {r}: " + " ".join(str(a) for a in plan if a.kind in COMPUTE)
        for r, plan in enumerate(plans)
    )


# --- 2. Simulator: the same action lists, with given costs ----------------------------------------


@dataclass
class Simulation:
    """The ideal timeline: per rank, a list of (action, start, end); and the step's length."""

    timeline: list[list[tuple[Action, float, float]]]
    makespan: float

    def bubble_fraction(self, rank: int) -> float:
        """Idle share of the step on this rank: 1 - compute time / step time."""
        busy = sum(end - start for a, start, end in self.timeline[rank] if a.kind in COMPUTE)
        return 1 - busy / self.makespan

    def in_flight_max(self, rank: int) -> int:
        """Most microbatch-chunks held at once: F done, the release (W, else B) not yet."""
        actions = [a.kind for a, _, _ in self.timeline[rank]]
        release = "W" if "W" in actions else "B"
        return max(itertools.accumulate((k == "F") - (k == release) for k in actions))


def simulate(
    plans: list[list[Action]],
    f: float | list = 1.0,
    b: float | list = 1.0,
    w: float | list = 1.0,
    latency: float = 0.0,
    own: dict | None = None,
    rendezvous: bool = False,
) -> Simulation:
    """Run the action lists with costs per whole stage and microbatch: F = f, B = b (input
    gradient), W = w (weight gradients); a schedule without W runs b + w in its B. A chunk of
    an interleaved stage costs 1/v of that; unequal stages: f, b, w as lists, one cost per
    chunk. A message arrives `latency` after its send. Sends never wait; a computation waits
    for its input. If no rank can move, DeadlockError names where each rank is stuck. `own`
    replays a real run: an action's own cost and a message's own delay, where it has them.
    `rendezvous`: a message's `latency` counts from the later of its send and the posting of
    its receive (an emulated link starts a transfer when both ends have launched it)."""
    own = own or {}
    p = len(plans)
    v = 1 + max(a.chunk for plan in plans for a in plan) // p
    split = any(a.kind == "W" for plan in plans for a in plan)
    f, b, w = ([c / v] * p * v if isinstance(c, (int, float)) else c for c in (f, b, w))
    cost = {"F": f, "B": b if split else [x + y for x, y in zip(b, w)], "W": w}
    arrival: dict[tuple, float] = {}  # message key -> when it arrives (or leaves: rendezvous)
    posted: dict[tuple, float] = {}  # message key -> when its receive was posted
    finished: set[tuple] = set()
    pos, clock = [0] * p, [0.0] * p
    timeline: list[list] = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                a = plans[r][pos[r]]
                before = {"B": "F", "W": "B"}.get(a.kind)
                if before and (before, a.microbatch, a.chunk) not in finished:
                    raise DeadlockError(f"rank {r} runs {a} before its {before}")
                key = input_message(a, p * v)
                if key is not None and key not in arrival:
                    break  # the sender has not got there yet
                if key is not None and rendezvous and key not in own:
                    arrival[key] = max(arrival[key] - latency, posted[key]) + latency
                start = clock[r] if key is None else max(clock[r], arrival[key])
                if a.kind.startswith("send"):
                    arrival[message_key(a)] = start + own.get(message_key(a), latency)
                if a.kind.startswith("recv"):
                    posted[message_key(a)] = clock[r]
                clock[r] = start + own.get(a, cost[a.kind][a.chunk] if a.kind in cost else 0.0)
                finished.add((a.kind, a.microbatch, a.chunk))
                timeline[r].append((a, start, clock[r]))
                pos[r] += 1
                moved = True
    stuck = {r: str(plans[r][pos[r]]) for r in range(p) if pos[r] < len(plans[r])}
    if stuck:
        raise DeadlockError(
            "schedule deadlocks: " + ", ".join(f"rank {r} waits at {a}" for r, a in stuck.items())
        )
    return Simulation(timeline, max(clock))
