"""Fault injection, for teaching and tests: a rank fails on purpose, at a chosen step.

    HPLAB_FAULT=STEP:RANK:KIND[,STEP:RANK:KIND ...]        e.g. HPLAB_FAULT=9:2:kill

strikes global rank RANK as it starts step STEP (counted from 0, as the metrics count steps):

    kill            the process is killed by SIGKILL, as by the out-of-memory killer or a lost
                    node: it says nothing, its peers lose their connection to it
    hang            it stops answering (a stuck GPU, a deadlock): it stops itself (SIGSTOP),
                    and its peers time out in their next collective (HPLAB_TIMEOUT_S)
    slow=SECONDS    a straggler: that step takes SECONDS longer, on that rank alone
    kill-in-save    killed by SIGKILL while it writes the checkpoint of STEP steps (its first
                    file written, the rest not): the writer is rank 0, so RANK must be 0

A fault strikes in the job's first attempt only, so that a restart can get past it; `@N`
makes it strike in attempt N instead (restart N of `--max-restarts`), `@*` in every attempt:

    HPLAB_FAULT=3:1:kill@0,3:1:kill@1        killed at step 3 of the first two attempts

The attempt is HPLAB_ATTEMPT, which `train.py --nproc` sets for each attempt (under torchrun,
its TORCHELASTIC_RESTART_COUNT). `train.py` calls `strike(step, rank)` before each step, and
`checkpoint.save` calls `strike_in_save(step)` inside each write.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

KINDS = ("kill", "hang", "slow", "kill-in-save")


@dataclass(frozen=True)
class Fault:
    step: int
    rank: int
    kind: str  # one of KINDS
    seconds: float = 0.0  # slow's delay
    attempt: int | None = 0  # the attempt it strikes in; None: every attempt


def parse(text: str) -> list[Fault]:
    """The faults `text` (HPLAB_FAULT's syntax) asks for; ValueError, one line, if malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            faults.append(_parse_one(item))
        except ValueError as err:
            raise ValueError(
                f"HPLAB_FAULT={text}: {item!r} {err}; write STEP:RANK:KIND[@ATTEMPT], KIND one "
                f"of kill, hang, slow=SECONDS, e.g. HPLAB_FAULT=9:2:kill"
            ) from None
    return faults


def _parse_one(item: str) -> Fault:
    where, _, attempt = item.partition("@")
    parts = where.split(":")
    if len(parts) != 3:
        raise ValueError("is not STEP:RANK:KIND")
    step, rank = (_count(text, name) for text, name in zip(parts, ("step", "rank")))
    kind, _, seconds = parts[2].partition("=")
    if kind not in KINDS or bool(seconds) != (kind == "slow"):
        raise ValueError(f"has kind {parts[2]!r}")
    if kind == "kill-in-save" and parts[1] != "0":
        raise ValueError("kills a rank other than 0 in a save: only rank 0 writes checkpoints")
    delay = _seconds(seconds) if kind == "slow" else 0.0
    every = attempt == "*"
    return Fault(step, rank, kind, delay, None if every else _count(attempt or "0", "attempt"))


def _count(text: str, name: str) -> int:
    if not text.isdigit():
        raise ValueError(f"has {name} {text!r}, not a whole number of at least 0")
    return int(text)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < 86400:  # (NaN, inf, 0 and negatives fail)
        raise ValueError(f"has slow={text}, not a number of seconds in (0, 86400)")
    return seconds


def planned() -> list[Fault]:
    """The faults HPLAB_FAULT asks for (none when it is unset or empty)."""
    return parse(os.environ.get("HPLAB_FAULT", ""))


def attempt() -> int:
    """Which attempt of the job this process belongs to: 0, then 1 after the first restart."""
    return int(os.environ.get("HPLAB_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def strike(step: int, rank: int, faults: list[Fault]) -> None:
    """Carry out the faults planned for `rank` at the start of `step` in this attempt."""
    for fault in faults:
        if (fault.step, fault.rank) != (step, rank) or fault.attempt not in (None, attempt()):
            continue
        if fault.kind in ("kill", "hang"):  # (a launcher wakes a stopped rank to end it)
            os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        if fault.kind == "slow":
            time.sleep(fault.seconds)


def strike_in_save(step: int) -> None:
    """A `kill-in-save` planned for the checkpoint of `step` steps in this attempt (rank 0)."""
    for fault in planned():
        if fault.kind == "kill-in-save" and fault.step == step:
            if fault.attempt in (None, attempt()):
                os.kill(os.getpid(), signal.SIGKILL)
