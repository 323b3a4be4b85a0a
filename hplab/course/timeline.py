"""Timelines of a real run: when each rank computed, and when its collectives really ran.

`train.py --trace DIR` records two steps with `torch.profiler`: a Chrome trace per rank,
`DIR/rank0.json`, ... (open it in https://ui.perfetto.dev or chrome://tracing). In it:

    step 1, forward block 2    hplab's ranges: per step, per forward of the model and its blocks
    autograd::engine::...      backward: autograd's own event per function it evaluates
    all_reduce dp 4,096 B      the Communicator's range around a launch (and `wait all_reduce dp`)
    gloo:all_reduce            gloo's thread: the collective from launch to completion
    link:all_reduce            under --link: the emulated link's transfer (hplab.runtime.link), in
                               place of gloo's (which only moved the bytes on loopback)

An asynchronous collective runs on gloo's threads while the caller computes on; its wait is only
where the caller needed the result. `hidden_fraction` measures that overlap from the spans.
gloo runs a reduce-scatter as an all-reduce of the whole input (its event: gloo:all_reduce).

On a GPU the trace also holds the device's own kernels: NCCL's (`ncclDevKernel_AllReduce_...`)
are the collectives as they really ran, the others the computation (kind "kernel"); there the
overlap is NCCL's kernels running beside compute kernels, whatever the host did meanwhile.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from hplab.parallel.schedule import COMPUTE

SPAN_KINDS = {
    "forward": "forward",
    "wait": "wait",
    "step": "step",
    "autograd::engine::evaluate_function:": "backward",
    "gloo:": "comm",
    "link:": "comm",  # under an emulated link (train.py --link): its transfers, not gloo's
}
COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", "barrier")
RUN_AS = {"all_reduce": ("all_reduce", "reduce_scatter")}  # gloo reduce-scatters by all-reducing
#: NCCL's kernel names (ncclDevKernel_AllReduce_Sum_f32_RING_LL, ...) → the operation
NCCL_OPS = {
    "allreduce": "all_reduce",
    "reducescatter": "reduce_scatter",
    "allgather": "all_gather",
    "broadcast": "broadcast",
    "sendrecv": "send",
    "send": "send",
    "recv": "recv",
}


def kind_of(event: dict) -> tuple[str | None, str]:
    """(its span kind, its name) of one profiler event: hplab's ranges and autograd's by their
    names; on a GPU, NCCL's kernels as `comm` (named like gloo's events: `gloo:all_reduce`
    becomes `nccl:all_reduce`) and every other kernel as `kernel`."""
    name = event["name"]
    if event.get("cat") == "kernel":
        kernel = name.lower().removeprefix("ncclkernel_").removeprefix("nccldevkernel_")
        if not name.lower().startswith("nccl"):
            return "kernel", name
        op = next((op for key, op in NCCL_OPS.items() if kernel.startswith(key)), "all_reduce")
        return "comm", f"nccl:{op}"
    return next((k for p, k in SPAN_KINDS.items() if name.startswith(p)), None), name


def read_timeline(directory) -> list[list[dict]]:
    """Per rank, its spans `{kind, name, start_s, end_s}` (kind: step, forward, backward, wait,
    comm), seconds from the earliest event of any rank (one machine: one clock). A comm span is
    named by the Communicator's launch it belongs to, its bucket numbered within the step."""
    if not (Path(directory) / "rank0.json").is_file():
        raise ValueError(f"{directory}: no rank0.json (write traces with train.py --trace DIR)")
    read = lambda rank: json.loads((Path(directory) / f"rank{rank}.json").read_text())  # noqa
    world = read(0).get("distributedInfo", {}).get("world_size", 1)
    ranks = [[e for e in read(rank)["traceEvents"] if e.get("ph") == "X"] for rank in range(world)]
    t0 = min((e["ts"] for events in ranks for e in events), default=0.0)
    return [_spans(sorted(events, key=lambda e: e["ts"]), t0) for events in ranks]


def _spans(events: list[dict], t0: float) -> list[dict]:
    """One rank's spans from its events in time order; t0: the time (µs) they count from."""
    spans = []
    launches = []
    numbers = Counter()
    linked = any(e["name"].startswith("link:") for e in events)
    for e in events:
        kind, name = kind_of(e)
        if linked and name.startswith("gloo:"):  # the link's transfer is the collective
            continue
        on_the_link = not (linked and name.startswith("all_reduce_scalar"))  # (bookkeeping)
        launch_range = e.get("cat") == "user_annotation" and name.startswith(COMM_OPS)
        if kind is None and launch_range and on_the_link:
            kind = "launch"  # the Communicator's range: "all_reduce dp 262,144 B"
            launches.append((name, e["ts"]))
        if kind == "step":
            numbers.clear()  # buckets are numbered within a step
        if kind == "comm":  # named after the first launch of its op not yet matched
            ops = RUN_AS.get(name[5:], name[5:])
            i = next((i for i, (la, _) in enumerate(launches) if la.startswith(ops)), None)
            launch, launched = (name[5:], e["ts"]) if i is None else launches.pop(i)
            numbers[key := " ".join(launch.split()[:2])] += 1
            name = f"{launch} #{numbers[key]}"
        if kind:
            spans.append(
                dict(
                    kind=kind,
                    name=name,
                    start_s=(e["ts"] - t0) / 1e6,
                    end_s=(e["ts"] + e.get("dur", 0) - t0) / 1e6,
                )
            )
        if kind == "comm":  # when the caller's launch of it began
            spans[-1]["launched_s"] = (launched - t0) / 1e6
    return spans


def _union(spans) -> list[tuple[float, float]]:
    """The intervals covered by `spans`, as sorted disjoint (start, end) pairs."""
    return _merge((s["start_s"], s["end_s"]) for s in spans)


def _merge(pairs) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(pairs):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif start < end:
            merged.append((start, end))
    return merged


def _intersect(a, b) -> list[tuple[float, float]]:
    return [(max(s, t), min(e, f)) for s, e in a for t, f in b if max(s, t) < min(e, f)]


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def seconds(spans: list[dict], kinds=("forward", "backward")) -> float:
    """The time covered by spans of these kinds (overlapping spans count once)."""
    return _length(_union(s for s in spans if s["kind"] in kinds))


def hidden_fraction(spans: list[dict], during=None, ops=COMM_OPS) -> float:
    """Of the time this rank's communication (collectives of `ops`; not the scalar all-reduces of
    hplab's own bookkeeping) ran, the share during which it also computed `during` rather than
    waiting or launching: |comm ∩ (compute − waits)| / |comm|, on one rank's spans from
    `read_timeline`. Collectives that overlap each other count once. `during`: the backward
    pass on a CPU trace; on a GPU trace the compute kernels, and the host's waits do not count
    (the device computes while the host waits)."""
    gpu = any(s["kind"] == "kernel" for s in spans)
    during = during or (("kernel",) if gpu else ("backward",))
    comm = _union(s for s in spans if s["kind"] == "comm" and s["name"].split()[0] in ops)
    if not comm:
        raise ValueError(f"no communication of {', '.join(ops)} in this timeline")
    computing = _intersect(comm, _union(s for s in spans if s["kind"] in during))
    host_waits = () if gpu else ("wait", "launch")
    waiting = _intersect(computing, _union(s for s in spans if s["kind"] in host_waits))
    return (_length(computing) - _length(waiting)) / _length(comm)


def held_up(spans: list[dict], ops=COMM_OPS) -> dict:
    """On one rank's spans from `read_timeline` under an emulated link: `blocked_s`, the time it
    was blocked in collectives of `ops` (launching or waiting), and `held_s`, the part of it
    during which the transfer it needed had not started because another rank launched it later
    (the link starts a transfer at its last member's launch, or when the link is free)."""
    blocked = _union(
        s
        for s in spans
        if s["kind"] in ("launch", "wait") and s["name"].removeprefix("wait ").split()[0] in ops
    )
    held = []  # this rank's link: one transfer after the other
    free = 0.0
    for s in sorted((s for s in spans if s["kind"] == "comm"), key=lambda s: s["start_s"]):
        ready = max(s.get("launched_s", s["start_s"]), free)  # without the other ranks
        held.append((ready, s["start_s"]))
        free = s["end_s"]
    return dict(blocked_s=_length(blocked), held_s=_length(_intersect(blocked, _merge(held))))


def waits(directory, ops=("all_reduce", "reduce_scatter", "all_gather")) -> list[dict]:
    """Per rank, over the traced steps, the time `blocked_s` in collectives of `ops` (launching
    or waiting), taken apart call by call (the i-th of each name on every rank; one machine,
    one clock) into what it was blocked by, the first that applies at each instant:
    `running_s`    gloo's thread ran a call with every rank there;
    `other_rank_s` gloo's thread had begun a call, the last rank's had not;
    `launching_s`  launched, gloo's thread had not begun the call (dispatch, or its queue);
    `waking_s`     a call was done, the caller had not yet returned;
    and `hidden_s`, the time the call ran with every rank there while this rank was not blocked
    (it computed), and `core_s`, gloo's threads' wait for a core over the steps (schedstat)."""
    timeline = read_timeline(directory)
    path = Path(directory)
    if any(s["kind"] == "kernel" for spans in timeline for s in spans):
        raise ValueError(
            f"{directory}: a GPU trace: its collectives run on the device, not on gloo's "
            "threads; take its overlap with hidden_fraction"
        )
    comm = [
        [s for s in spans if s["kind"] == "comm" and s["name"].split()[0] in ops]
        for spans in timeline
    ]
    if any([c["name"] for c in calls] != [c["name"] for c in comm[0]] for calls in comm):
        raise ValueError(f"{directory}: the ranks launched different collectives")
    last = [max(starts) for starts in zip(*([c["start_s"] for c in calls] for calls in comm))]
    result = []
    for rank, (spans, calls) in enumerate(zip(timeline, comm)):
        blocked = _union(
            s
            for s in spans
            if s["kind"] in ("launch", "wait") and s["name"].removeprefix("wait ").split()[0] in ops
        )
        returned = [
            next((e for s, e in blocked if s <= c["end_s"] <= e), c["end_s"]) for c in calls
        ]  # the end of the wait that the call's completion ended
        phases = dict(
            running=[(max(c["start_s"], t), c["end_s"]) for c, t in zip(calls, last)],
            other_rank=[(c["start_s"], t) for c, t in zip(calls, last)],
            launching=[(c["launched_s"], c["start_s"]) for c in calls],
            waking=[(c["end_s"], r) for c, r in zip(calls, returned)],
        )
        times = dict(blocked_s=_length(blocked))
        counted = []
        for name, intervals in phases.items():  # each instant counted once, in this order
            now = _merge(counted + _intersect(blocked, _merge(intervals)))
            times[f"{name}_s"], counted = _length(now) - _length(counted), now
        times["hidden_s"] = _length(_merge(blocked + phases["running"])) - _length(blocked)
        recorded = json.loads((path / f"rank{rank}.json").read_text())
        result.append(times | dict(core_s=recorded.get("gloo_queued_s", 0.0)))
    return result


# --- a pipeline's trace: the part of its bubble no replay of the schedule sees -------------

# A wait for a message longer than this: the message was not there yet. Waiting for one that is
# already there costs the host 0.15-0.45 ms under the emulated link on two busy cores (measured:
# gloo's wait, then a look at the wire); counted as a wait, its "delay" from a send made long
# before would be tens of milliseconds that no message took.
WAITED_S = 1e-3


def idle_between_actions(trace: list[dict], origin: float = 0.0, end: float | None = None) -> float:
    """The share of the step (as in `measured_bubble`) this rank spent between its actions, not
    computing, sending or waiting for a message (a later start than the first rank, Python
    between actions, a wait for a core): the part of the bubble no schedule replay sees. A gap
    before a wait that lasted (over WAITED_S) is left out: the message would have kept it idle."""
    between = 0.0
    previous = origin
    for e in trace:
        if not (e["kind"] == "recv" and e["end_s"] - e["start_s"] > WAITED_S):
            between += max(0.0, e["start_s"] - previous)
        previous = max(previous, e["end_s"])
    end = max(e["end_s"] for e in trace if e["kind"] in COMPUTE) if end is None else end
    return between / (end - origin)
