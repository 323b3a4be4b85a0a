"""The collectives' ranges in a profiler's timeline (`torch.profiler.record_function`).

Each launch is a range named by its operation, group and payload, "all_reduce dp 1,024 B"; each
wait for it "wait all_reduce dp"; a batch of messages "send pp 64 B + recv pp 64 B"; the kit's
own calls by their name, "barrier dp". `hplab.course.timeline` reads these names back from a
trace (`train.py --trace`). A layer of the collectives, installed by
`hplab.runtime.group.init_distributed`: a trace recorded by anyone shows them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function


def label(call) -> str:
    """The name of `call`'s range (a hplab.parallel.collectives.Call) at its current stage."""
    name = call.comm.name
    if call.stage == "wait":
        return f"wait {call.op} {name}"
    if call.parts:
        return " + ".join(label(part) for part in call.parts)
    if call.bookkeeping:
        return f"{call.bookkeeping} {name}"
    return f"{call.op} {name} {call.nbytes:,} B"


def labelled(call):
    """The layer (hplab.parallel.collectives.LAYERS): each launch and wait inside its range,
    while a profiler records (a range costs tens of µs a call, and nothing sees it otherwise)."""
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return record_function(label(call))
