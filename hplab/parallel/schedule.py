"""Pipeline schedules as plain data — no torch needed.

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
This file: each schedule's per-rank compute order, and the sends and receives it needs. The
planner's simulator (`hplab.plan.simulate`) runs the same lists with given F, B, W costs and
proves that no rank waits forever; the same idle share measured from a real run's timestamps:
`hplab.observe.observers`. Standard library and hplab.config only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplab.config import check_pipeline

COMPUTE = ("F", "B", "W")


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
    plans = []  # queues[sender, receiver]: the receiver's receives, in send order
    queues = {}
    for r, order in enumerate(orders):
        plan = []
        for kind, mb, chunk in order:
            plan.append(Action(kind, mb, chunk))
            to = chunk + 1 if kind == "F" else chunk - 1  # the chunk that consumes the output
            if kind in ("F", "B") and 0 <= to < num_chunks:
                what = "act" if kind == "F" else "grad"
                peer = chunk_owner(to, p)
                plan.append(Action(f"send_{what}", mb, chunk, peer))
                queues.setdefault((r, peer), []).append(Action(f"recv_{what}", mb, to, r))
        plans.append(plan)
    full = []
    for r, plan in enumerate(plans):
        out = []
        posted = set()
        for a in plan:
            key = input_message(a, num_chunks)
            sender = chunk_owner(a.chunk - 1 if a.kind == "F" else a.chunk + 1, p)
            while key is not None and key not in posted:  # the sender's messages, in order
                out.append(queues[sender, r].pop(0))
                posted.add(message_key(out[-1]))
            out.append(a)
        full.append(out)
    return full


def receives_ahead(plan: list[Action], computations: int = 1) -> list[Action]:
    """`plan` with each receive posted `computations` computations earlier (never before the
    plan's start or an earlier receive: receives keep their order), so that its message
    crosses the link while this rank computes, as Megatron-LM's overlapped p2p communication and
    torch.distributed.pipelining post receives ahead. A receive is waited for only when the
    computation that needs it comes (on gloo, posting one while its message's bytes are crossing
    returns once they have crossed: 1-4 ms on two busy CPU cores; NCCL only queues it). 0: the
    plan as it is."""
    out: list[Action] = []
    for a in plan:
        at = len(out)
        passed = 0
        while a.kind.startswith("recv") and at > 0 and passed < computations:
            if out[at - 1].kind.startswith("recv"):
                break
            at -= 1
            passed += out[at].kind in COMPUTE
        out.insert(at, a)
    return out


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
