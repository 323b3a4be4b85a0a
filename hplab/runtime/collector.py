"""Python's garbage collector, kept out of the steps that ranks time.

Python's cyclic collector starts by itself when allocations pass a threshold. A full
collection of a process that holds torch takes ~200 ms on a laptop CPU, at a moment of its own
on each rank, and the other ranks wait for the one that paused mid-step: it came at step 5 of
every run, and a 5-step pipeline measured GPipe's bubble at 70% for its formula's 20%. As
torchtitan (`gc_freq`) and Megatron-LM (`--manual-gc`) do, a timed loop freezes what was built
before it (never scanned again), turns the automatic collector off, and collects the young
generations between steps, every EVERY steps, on every rank at the same step.
"""

from __future__ import annotations

import contextlib
import gc

EVERY = 50  # steps between two collections (torchtitan's default gc_freq)


@contextlib.contextmanager
def between_steps():
    """The automatic collector off for the loop inside, what exists now frozen; both restored
    afterwards (a notebook that trains in its own process gets its collector back)."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def collect_before(step: int, first: int = 0) -> None:
    """Call before step `step` starts its clock: collects every EVERY steps after `first`."""
    if step > first and step % EVERY == 0:
        gc.collect(1)
