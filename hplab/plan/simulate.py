"""The pipeline simulator: a schedule's action lists (`hplab.parallel.schedule`) run with given
costs, no torch and no processes. Its timeline is the ideal one: each rank computes as soon as
its input has arrived, each message arrives `latency` after its send. It proves that a
schedule never deadlocks, gives each rank's bubble and how many microbatches it holds at once,
and replays a real run's schedule with the costs that run measured (`own`), so that the
measured bubble and the formula can be put beside what the schedule alone implies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hplab.parallel.schedule import COMPUTE, Action, input_message, message_key


class DeadlockError(RuntimeError):
    """A schedule in which some rank waits forever for a message."""


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
    pos = [0] * p
    clock = [0.0] * p
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
