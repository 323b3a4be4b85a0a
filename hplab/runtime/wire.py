"""The emulated wire: the links a transfer crosses, and how transfers on one link share it.

Every rank has four ports, each a link of its own (full duplex: sending and receiving are two):

    up, down    to and from its node's switch: the fast tier (NVLink; or the one tier of a
                single-link --link)
    out, in     its network card, to and from the other nodes: the slow tier (a card per rank,
                as on a DGX H100, whose eight GPUs each have a 400 Gb/s card of their own)

A hop from rank a to rank b inside a node crosses a's up and b's down; between nodes, a's out
and b's in. A collective runs its ring algorithm over such hops (the steps and the bytes per
step are `formulas.alpha_beta_terms`'s, their one home):

    all_reduce                  2(n−1) steps: each rank sends S/n to the next one on the ring
    all_gather, reduce_scatter  n−1 such steps
    all_to_all                  n−1 steps: at step k, rank i sends S/n to rank i+k (pairwise)
    broadcast                   one step: the payload down the chain of ranks, pipelined
    send / recv                 one hop

A step first waits the α of its slowest hop, then moves its bytes on all its hops at once, at
the pace of the slowest: a ring that crosses a slow link runs at that link's speed, and the
ring's 2(n−1)·α appears by itself. Transfers moving on one port at the same time share it
equally (a fluid model of a network's fair queueing): data parallel's all-reduce and a pipeline
message through one card each get half of it. A group's transfers (one NCCL communicator, one
stream) run one after the other, in launch order; two groups' run side by side.

The wire is shared by this machine's ranks: a memory-mapped file holds a record per transfer,
stamped by each member as it launches and ready when the last has. Whoever looks (under a file
lock) advances the wire up to now. A rank that waits projects its transfer's end from what is
on the wire and sleeps until then; it looks again only if a transfer was queued meanwhile (one
can only make it later). Nothing here touches the bytes: gloo or NCCL still moves them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import math
import mmap
import os
import re
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hplab.plan.formulas import alpha_beta_terms

UP, DOWN, OUT, IN = range(4)  # a rank's ports: port number 4·rank + one of these
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
MAX_RANKS = 128  # the members of a record are a bitmask of two 64-bit words
FREE, STAMPING, QUEUED, LATENCY, MOVING, DONE = range(6)  # a record's life, in order
RECORD = np.dtype(
    [
        ("channel", "u8"),  # the group (or one direction of a pair) it runs on
        ("index", "i8"),  # its place among the channel's launches
        ("state", "i1"),
        ("op", "i1"),  # OPS
        ("sender", "i2"),  # send: the two ends (global ranks)
        ("receiver", "i2"),
        ("ranks", "u8", 2),  # the group's global ranks, as a bitmask
        ("stamped", "u8", 2),  # the members that have launched it
        ("nbytes", "f8"),  # its payload, as the ledger counts it
        ("ready", "f8"),  # the last member's launch (time.perf_counter)
        ("step", "i4"),  # the step under way
        ("left", "f8"),  # of that step: its α still to wait (s), or its bytes still to move
        ("start", "f8"),
        ("end", "f8"),
    ]
)
SLOTS = 2048  # records in flight at once, at most (a done record's slot is reused later)
HEADER = 64  # bytes before the records: the time the wire has been advanced to (a float64),
# and the number of transfers queued so far (an int64)
REUSE_AFTER_S = 60.0  # a done record's slot is taken again this long after its end


@dataclass(frozen=True)
class Link:
    """β (bytes per second) and α (seconds) of every link of one tier."""

    bandwidth: float
    latency: float = 0.0

    def cost(self, nbytes: float) -> float:
        """α + n/β: the seconds `nbytes` take on one such link, alone."""
        return self.latency + nbytes / self.bandwidth

    def __str__(self) -> str:
        return f"{self.bandwidth / 1e6:g}MB/s,{self.latency * 1e6:g}us"


@dataclass(frozen=True)
class Topology:
    """Ranks in nodes of `node` consecutive ranks (Megatron's order puts tensor parallel's ranks
    side by side, inside a node), `inside` a node and `between` nodes (None: one node)."""

    inside: Link
    between: Link | None = None
    node: int = 0

    def __str__(self) -> str:
        if self.between is None:
            return str(self.inside)
        return f"node={self.node} inside={self.inside} between={self.between}"

    def node_of(self, rank: int) -> int:
        return rank // self.node if self.between else 0

    def beta(self, port: int) -> float:
        return (self.inside if port % 4 in (UP, DOWN) else self.between).bandwidth

    def hop(self, a: int, b: int) -> tuple[float, tuple[int, int]]:
        """(α, the two ports) of a message from global rank a to b."""
        if self.node_of(a) == self.node_of(b):
            return self.inside.latency, (4 * a + UP, 4 * b + DOWN)
        return self.between.latency, (4 * a + OUT, 4 * b + IN)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (a few topologies per process)
    def steps(self, op: str, ranks: tuple[int, ...], sender: int, receiver: int, nbytes: float):
        """The algorithm's steps over this wire: per step (α, bytes per hop, ports crossed)."""
        if op == "send":
            return [self.step([(sender, receiver)], nbytes)]
        n = len(ranks)
        count, factor = alpha_beta_terms(op, n)
        per_hop = factor * nbytes / count
        if op == "broadcast":  # down the chain from the first rank, pipelined
            return [self.step(list(zip(ranks, ranks[1:])), per_hop)]
        if op == "all_to_all":  # step k: rank i to rank i + k
            return [
                self.step([(ranks[i], ranks[(i + k) % n]) for i in range(n)], per_hop)
                for k in range(1, n)
            ]
        ring = self.step([(ranks[i], ranks[(i + 1) % n]) for i in range(n)], per_hop)
        return [ring] * count

    def step(self, hops: list[tuple[int, int]], per_hop: float) -> tuple:
        crossed = [self.hop(a, b) for a, b in hops]
        return (
            max(alpha for alpha, _ in crossed),
            per_hop,
            [p for _, ports in crossed for p in ports],
        )


@functools.lru_cache(maxsize=4096)
def channel_id(text: str) -> int:
    """A channel's number, the same in every process (Python's own hash is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def home_slot(key: int, index: int) -> int:
    """Where a transfer's record goes when that slot is free: one look finds it there (the
    channel's launches take consecutive slots)."""
    return (key + index) % SLOTS


def bitmask(ranks) -> tuple[int, int]:
    mask = sum(1 << r for r in ranks)
    return mask & (2**64 - 1), mask >> 64


def members(words) -> tuple[int, ...]:
    return ranks_in(int(words[0]) | int(words[1]) << 64)


@functools.lru_cache(maxsize=4096)
def ranks_in(mask: int) -> tuple[int, ...]:
    return tuple(r for r in range(MAX_RANKS) if mask >> r & 1)


class Transfer:
    """One record being simulated: its fields as Python numbers (attributes), and its steps."""

    MOVED = ("state", "step", "left", "start", "end")  # what the model changes in a record

    def __init__(self, slot: int, fields: dict, steps: list):
        self.__dict__.update(fields)
        self.slot = slot
        self.steps = steps

    @classmethod
    def of(cls, slot: int, record, topology: Topology) -> Transfer:
        fields = dict(zip(RECORD.names, record.item()))
        op = OPS[fields["op"]]
        group = members(fields["ranks"])
        ends = (fields["sender"], fields["receiver"])
        return cls(slot, fields, topology.steps(op, group, *ends, fields["nbytes"]))

    def clone(self) -> Transfer:
        return Transfer(self.slot, dict(vars(self)), self.steps)

    def update(self, **fields) -> None:
        self.__dict__.update(fields)


class Wire:
    """This machine's wire for one job: the shared records, and the model that advances them."""

    def __init__(self, topology: Topology, job: str, launches: Counter | None = None):
        self.topology = topology
        self.job = job
        self.path = SHARED_FOLDER / ("hplab-wire-" + re.sub(r"[^\w.-]", "_", job))
        self.thread_lock = threading.RLock()
        self.launches = Counter() if launches is None else launches  # per channel: this rank's
        self.log: list | None = None  # a list: (what, start, end) of each transfer waited for
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        size = HEADER + SLOTS * RECORD.itemsize
        with self.locked():
            if os.fstat(self.fd).st_size < size:
                os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.now = np.frombuffer(self.map, dtype=np.float64, count=1)  # the wire's clock
        self.queued = np.frombuffer(self.map, dtype=np.int64, count=1, offset=8)
        self.records = np.frombuffer(self.map, dtype=RECORD, count=SLOTS, offset=HEADER)

    @contextlib.contextmanager
    def locked(self):
        """The wire to this thread alone: other ranks wait at the file lock, threads here at
        the thread lock (a file lock is the process's)."""
        with self.thread_lock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Remove the file (the other ranks keep their maps of it), if it is still this wire's:
        a later job of the same name may have made a new one there."""
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                Path(self.path).unlink(missing_ok=True)

    # -- launching --------------------------------------------------------------------------
    def launch(self, channel: str, op: str, group: list[int], me: int, nbytes: float, ends=None):
        """Stamp this rank's launch of the channel's next transfer: `op` among the global ranks
        `group` (`ends`: a message's (sender, receiver)); its ticket, for `wait`."""
        index = self.launches[channel]
        self.launches[channel] += 1
        key = channel_id(channel)
        group = sorted(ends or group)
        with self.locked():
            now = time.perf_counter()
            slot = self.find(key, index)
            if slot is not None and self.stale(slot, me):
                self.records[slot]["state"] = FREE  # (an earlier job's, of the same name)
                slot = None
            if slot is None:
                slot = self.new_record(key, index, op, group, nbytes, ends, now)
            row = self.records[slot]
            mask = int(row["stamped"][0]) | int(row["stamped"][1]) << 64 | 1 << me
            row["stamped"] = (mask & (2**64 - 1), mask >> 64)
            row["ready"] = max(row["ready"], now)
            if all(mask >> r & 1 for r in group):
                row["state"] = QUEUED
                self.queued[0] += 1  # (a waiting rank's projection may no longer hold)
        return slot, key, index

    def find(self, key: int, index: int) -> int | None:
        """The slot of the channel's `index`-th transfer, if some member launched it: its home
        slot (`home`) first, where it usually is, then all of them."""
        home = home_slot(key, index)
        row = self.records[home]
        if row["channel"] == key and row["index"] == index and row["state"] != FREE:
            return home
        hits = np.nonzero(
            (self.records["channel"] == key)
            & (self.records["index"] == index)
            & (self.records["state"] != FREE)
        )[0]
        return int(hits[0]) if len(hits) else None

    def stale(self, slot: int, me: int) -> bool:
        """A record of an earlier job with the same name: past stamping, or stamped by me."""
        row = self.records[slot]
        mine = members(row["stamped"])
        return row["state"] != STAMPING or me in mine

    def new_record(self, key, index, op, group, nbytes, ends, now) -> int:
        """A slot for a new record: its home slot if that is free, else the first free one."""
        home = home_slot(key, index)
        states = self.records["state"]
        if self.reusable(home, now):
            free = [home]
        else:
            free = np.nonzero(
                (states == FREE) | ((states == DONE) & (self.records["end"] < now - REUSE_AFTER_S))
            )[0]
        if not len(free):  # many short transfers: the one through longest ago
            done = np.nonzero(states == DONE)[0]
            free = done[np.argsort(self.records["end"][done])[:1]]
        if not len(free):
            raise RuntimeError(
                f"the emulated wire holds {SLOTS} transfers in flight; wait for some before "
                "launching more"
            )
        row = self.records[int(free[0])]
        row.fill(0)
        row["channel"] = key
        row["index"] = index
        row["state"] = STAMPING
        row["op"] = OPS.index(op)
        row["sender"], row["receiver"] = ends or (0, 0)
        row["ranks"] = bitmask(group)
        row["nbytes"] = nbytes
        row["ready"] = now
        return int(free[0])

    def reusable(self, slot: int, now: float) -> bool:
        row = self.records[slot]
        return row["state"] == FREE or row["state"] == DONE and row["end"] < now - REUSE_AFTER_S

    # -- waiting ----------------------------------------------------------------------------
    def wait(self, ticket, what: str, timeout_s: float, on_timeout) -> None:
        """Sleep until the ticket's transfer is through; `on_timeout(seconds)` raises when the
        wire would take longer than `timeout_s` to carry it (or to see all its launches). A
        projection holds if no transfer was queued while this rank slept: then the wait ends
        at its end, without running the wire again."""
        began = time.perf_counter()
        while True:
            with self.locked():
                transfers = self.advance_to(time.perf_counter())
                mine = self.mine(ticket, transfers)
                if mine is None:  # through long ago (its slot reused since)
                    return
                if mine.state == DONE:
                    break
                mine = projected(transfers, mine, float(self.now[0]), self.topology)
                queued = int(self.queued[0])
            now = time.perf_counter()
            end = mine.end if mine.state == DONE else math.inf
            if math.isfinite(end) and end - now > timeout_s or now - began > timeout_s:
                on_timeout(end - now)  # (inf: a member that never launched)
            time.sleep(min(end - now, 0.001) if math.isinf(end) else max(end - now, 0.0))
            if mine.state == DONE:
                with self.locked():
                    if int(self.queued[0]) == queued:  # nothing new came: the projection held
                        break
        if self.log is not None:
            self.log.append((what, float(mine.start), float(mine.end)))

    def is_through(self, ticket) -> bool:
        with self.locked():
            mine = self.mine(ticket, self.advance_to(time.perf_counter()))
        return mine is None or mine.state == DONE

    def mine(self, ticket, transfers: list[Transfer]) -> Transfer | None:
        slot, key, index = ticket
        row = self.records[slot]
        if row["channel"] != key or row["index"] != index or row["state"] == FREE:
            return None
        found = [t for t in transfers if t.slot == slot]
        return found[0] if found else Transfer.of(slot, row, self.topology)

    def advance_to(self, now: float) -> list[Transfer]:
        """Run the wire from where it stands to `now` (under the lock); the transfers not yet
        through, as they stand now."""
        states = self.records["state"]
        live = np.nonzero((states >= STAMPING) & (states < DONE))[0]
        transfers = [Transfer.of(int(s), self.records[int(s)], self.topology) for s in live]
        then = float(self.now[0])
        if now > then:
            run(transfers, then, now, self.topology)
            for t in transfers:
                row = self.records[t.slot]
                for name in Transfer.MOVED:
                    row[name] = getattr(t, name)
            self.now[0] = now
        return [t for t in transfers if t.state != DONE]


def project(transfers: list[Transfer], mine: Transfer, now: float, topology) -> float:
    """When `mine` will be through if nothing more is launched (inf: not all have launched)."""
    target = projected(transfers, mine, now, topology)
    return target.end if target.state == DONE else math.inf


def projected(transfers: list[Transfer], mine: Transfer, now: float, topology) -> Transfer:
    """`mine` as it will be once through if nothing more is launched (not DONE: not all its
    members have launched it)."""
    future = [t.clone() for t in transfers]
    target = next(t for t in future if t.slot == mine.slot)
    run(future, now, math.inf, topology, until_done=target)
    return target


def run(transfers: list[Transfer], t: float, until: float, topology, until_done=None) -> None:
    """The fluid model, from time t to `until` (or until `until_done` is through): each event
    (a transfer starting, a step's α waited, a step's bytes moved) in time order. Only the
    first transfer of each channel not yet through can move (one stream)."""
    lines = channel_lines(transfers)
    while until_done is None or until_done.state != DONE:
        heads = [line[0] for line in lines.values() if line]
        start_what_can(heads, t)
        rates = moving_rates(heads, topology)
        events = [next_event(x, t, rates.get(i)) for i, x in enumerate(heads)]
        when = min(events, default=math.inf)
        if when > until:
            progress(heads, rates, until - t)
            return
        if math.isinf(when):
            return
        progress(heads, rates, when - t)
        t = when
        for x, event in zip(heads, events, strict=True):
            if event <= when:
                finish_stage(x, t)
                if x.state == DONE:
                    lines[x.channel].popleft()


def channel_lines(transfers: list[Transfer]) -> dict[int, deque]:
    """Per channel, its transfers not yet through, in launch order."""
    lines: dict[int, deque] = {}
    for x in sorted((x for x in transfers if x.state != DONE), key=lambda x: x.index):
        lines.setdefault(x.channel, deque()).append(x)
    return lines


def start_what_can(heads: list[Transfer], t: float) -> None:
    """A channel's first transfer starts once all its members have launched it."""
    for x in heads:
        if x.state == QUEUED and x.ready <= t:
            x.update(state=LATENCY, step=0, left=x.steps[0][0], start=t)


def moving_rates(transfers: list[Transfer], topology) -> dict[int, float]:
    """Bytes per second of each moving transfer: its slowest port's share."""
    moving = [(i, x.steps[x.step][2]) for i, x in enumerate(transfers) if x.state == MOVING]
    load = Counter(port for _, ports in moving for port in ports)
    return {i: min(topology.beta(p) / load[p] for p in ports) for i, ports in moving}


def next_event(x: Transfer, t: float, rate: float | None) -> float:
    """When `x` next changes: its α waited, its bytes moved (at today's rate), its start."""
    if x.state == LATENCY:
        return t + x.left
    if x.state == MOVING:
        return t + x.left / rate
    if x.state == QUEUED and x.ready > t:
        return x.ready
    return math.inf


def progress(transfers: list[Transfer], rates: dict[int, float], dt: float) -> None:
    for i, x in enumerate(transfers):
        if x.state == LATENCY:
            x.left = max(0.0, x.left - dt)
        elif x.state == MOVING:
            x.left = max(0.0, x.left - rates[i] * dt)


def finish_stage(x: Transfer, t: float) -> None:
    """x's α is waited (its bytes move next) or its bytes are moved (the next step, or done)."""
    if x.state == LATENCY:
        x.update(state=MOVING, left=x.steps[x.step][1])
    elif x.state == MOVING and x.step + 1 < len(x.steps):
        x.update(state=LATENCY, step=x.step + 1, left=x.steps[x.step + 1][0])
    elif x.state == MOVING:
        x.update(state=DONE, end=t)


SHARED_FOLDER = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
