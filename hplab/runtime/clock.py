"""Clocks that time the device's work, not the host's queueing of it.

On the CPU a call does its work before it returns: the host's clock (`time.perf_counter`) read
before and after is its duration. On a GPU a call returns as soon as its kernels are queued on
a stream, and they run later; the host's clock would time the queueing. There the clock is a
pair of CUDA events recorded on the stream around the work: the GPU stamps each when it gets
there, and `elapsed_time` reads the gap once the later one has happened.

    clock = clock_for(device)
    start = clock.mark(); ...work...; end = clock.mark()
    clock.seconds(start, end)          # after the work, at a point that may wait for the GPU

Observers (`hplab.observe.observers`) and the course's measurements take a clock, so that tests can
hand them a scripted one. The ledger's time of a collective on NCCL is NCCL's own measurement
(`on_the_device`, a layer of the collectives).
"""

from __future__ import annotations

import contextlib
import time

import torch


class HostClock:
    """The CPU's own clock: a mark is `time.perf_counter()`."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """CUDA events on the current stream: a mark is an event recorded there; `seconds` waits
    for the later event, then reads the GPU's own time between the two."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # (milliseconds)


def clock_for(device: torch.device | str) -> HostClock | CudaClock:
    """The clock that times work on `device`."""
    return CudaClock() if torch.device(device).type == "cuda" else HostClock()


def nccl_seconds(work) -> float | None:
    """NCCL's own time of a finished collective on the GPU (CUDA events around its kernel,
    TORCH_NCCL_ENABLE_TIMING, set by `hplab.runtime.group.init_distributed`); None where the
    group does not time its work."""
    try:
        return work._get_duration() / 1e3  # (milliseconds)
    except (RuntimeError, AttributeError):
        return None


@contextlib.contextmanager
def on_the_device(call):
    """The layer (hplab.parallel.collectives.LAYERS) that times collectives on a GPU, where the
    host only queues them: each is launched asynchronously (a blocking one then waited for at
    once), its launch counts no time in the ledger, and its wait counts NCCL's own time of it
    (or, untimed, the wait's). On the CPU the ledger keeps the host's clock: the time the caller
    was blocked in the call or its wait, while gloo did the work."""
    if call.comm.device.type != "cuda" or call.bookkeeping:
        yield
        return
    call.launch_async = True
    yield
    call.seconds = 0.0 if call.stage == "launch" else nccl_seconds(call.work)
