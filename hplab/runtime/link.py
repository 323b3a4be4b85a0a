"""An emulated link: the time a real network takes, on a laptop whose own "network" is free.

On one machine gloo's messages cross loopback: the CPU cores that compute also move the bytes,
and moving them costs little next to computing. Over NVLink or a network card, bytes move
beside the computation, at a rate that makes communication cost about as much as compute. With
`--link BANDWIDTH[,LATENCY]` (or the HPLAB_LINK environment variable), e.g. `--link 20MB/s,200us`,
every rank gets such a link:

    a collective        α + (its bus bytes)/β      bus bytes: the nccl-tests convention, an
                                                   all-reduce's 2(n−1)/n·S (formulas.bus_factor)
    a message           α + (its payload)/β        the receiver waits for it

The real data still moves through gloo (or NCCL), so every result is bit for bit the one
without a link; the link's time starts when that real transfer is done, which on loopback is
when the last rank launched it (on a GPU: when the host queued it). A rank's transfers queue on
its link one after the other (`Queue`), a group's in the order they were launched (as a
communication stream runs them), and a `wait()` sleeps the time out, using no core, as a network
card moves bytes without the CPU. The link is a layer of the collectives (`emulated`, installed
by `hplab.runtime.group.init_distributed`). Off by default, and then nothing is paid: the layer
makes a `Transfer` only when this process has a link.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hplab.plan.formulas import bus_factor
from hplab.runtime.errors import CommTimeout

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
PER_SECOND = {"s": 1, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}


class LinkError(ValueError):
    """A --link that cannot be read; the message shows one that can."""


@dataclass(frozen=True)
class Link:
    """β (bytes per second) and α (seconds) of every rank's link."""

    bandwidth: float
    latency: float = 0.0

    def cost(self, nbytes: float) -> float:
        """α + n/β: the seconds `nbytes` take on this link."""
        return self.latency + nbytes / self.bandwidth

    def __str__(self) -> str:
        return f"{self.bandwidth / 1e6:g}MB/s,{self.latency * 1e6:g}us"


def parse(text: str, source: str = "--link") -> Link:
    """`20MB/s,200us` → Link(20e6, 200e-6). Bandwidth in B/s, kB/s, MB/s, GB/s (or KiB/s,
    MiB/s, GiB/s); the latency in s, ms, us or ns (default 0). `source` names the text in an
    error: the flag, or HPLAB_LINK."""
    bandwidth, _, latency = text.replace(" ", "").partition(",")
    rate = re.fullmatch(r"([0-9.eE+-]+)([kKmMgG]i?)?B/s", bandwidth)
    delay = re.fullmatch(r"([0-9.eE+-]+)(s|ms|us|µs|ns)", latency or "0s")
    try:
        beta = float(rate[1]) * UNITS[(rate[2] or "").lower()]
        alpha = float(delay[1]) / PER_SECOND[delay[2]]
    except (TypeError, ValueError):
        raise LinkError(
            f"{source} {text!r}: give a bandwidth and, after a comma, a latency, e.g. "
            "--link 20MB/s,200us"
        ) from None
    if not BANDWIDTHS[0] <= beta <= BANDWIDTHS[1]:  # (NaN fails too)
        raise LinkError(
            f"{source} {text!r}: a bandwidth of {bandwidth} is outside what a link carries; "
            "give one from 1kB/s to 100TB/s (NVLink: 900GB/s), e.g. --link 20MB/s,200us"
        )
    if not LATENCIES[0] <= alpha <= LATENCIES[1]:
        raise LinkError(
            f"{source} {text!r}: a latency of {latency} is outside what a link takes; give one "
            "from 0 to 1s (InfiniBand: about 2us), e.g. --link 20MB/s,200us"
        )
    return Link(beta, alpha)


# What a link can physically be: from a slow modem's kB/s to beyond NVLink, and a latency up to
# a second (a continent away). Outside these a value is a typo, and a link of 1e9 s would make
# every collective sleep for ever.
BANDWIDTHS = (1e3, 1e14)  # bytes per second
LATENCIES = (0.0, 1.0)  # seconds


class Queue:
    """One rank's link: its transfers one after the other, and the launch board they start
    from."""

    def __init__(self, link: Link, job: str):
        self.link = link
        self.free_at = 0.0
        self.lock = threading.RLock()
        self.board = Board(job)
        self.log: list | None = None  # a list: (what, start, end) of each transfer (a trace)
        self.launched: dict[int, deque] = {}  # per channel: its transfers not yet on the link

    def transfer(self, ready_at: float, nbytes: float, what: str = "") -> float:
        """When `nbytes`, ready at `ready_at` (time.perf_counter), are through."""
        with self.lock:
            start = max(ready_at, self.free_at)
            self.free_at = start + self.link.cost(nbytes)
            if self.log is not None:
                self.log.append((what, start, self.free_at))
            return self.free_at

    def launch(self, channel: int, transfer: Transfer) -> None:
        """`transfer` is launched on `channel` (a group, or one direction of a pair)."""
        with self.lock:
            self.launched.setdefault(channel, deque()).append(transfer)

    def done(self, channel: int) -> None:
        """Transfers of `channel` are done for real: put the ready ones on the link in launch
        order (gloo may finish a later one first: a reduce-scatter runs as a slower all-reduce)."""
        with self.lock:
            waiting = self.launched[channel]
            while waiting and waiting[0].ready_at is not None:
                first = waiting.popleft()
                first.through_at = self.transfer(first.ready_at, first.nbytes, first.what)
                first.on_the_link.set()


def sleep_until(moment: float) -> None:
    """Sleep (using no core) until time.perf_counter() reaches `moment`."""
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class Board:
    """When each rank launched each transfer, shared by this machine's ranks: a memory-mapped
    file per channel (a group's collectives, or one direction of a pair's messages), a row
    per member, a column per transfer in launch order. One machine, one clock:
    time.perf_counter is the machine's monotonic clock in every process."""

    SLOTS = 4096  # columns reused in turn: far more than can be in flight at once

    def __init__(self, job: str):
        self.job = job
        self.tables = {}
        self.launches = Counter()
        self.opened: set[tuple[str, int]] = set()  # (channel, members) of the files it mapped
        self.folder = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())

    def stamp(self, channel: str, members: int, me: int) -> tuple:
        """Note now as member `me`'s launch of the channel's next transfer; its ticket."""
        table = self.tables.get(channel)
        if table is None:
            table = self.tables[channel] = self._open(channel, members)
        slot = self.launches[channel] % self.SLOTS
        self.launches[channel] += 1
        table[me, slot] = time.perf_counter()
        return table, slot

    @staticmethod
    def last_launch(ticket: tuple) -> float:
        """When the last member launched it (call once the real transfer is done)."""
        table, slot = ticket
        return float(table[:, slot].max())

    def remove_files(self) -> None:
        """Remove this board's files (the processes that mapped them keep their maps)."""
        for channel, members in list(self.opened):
            self.path(channel, members).unlink(missing_ok=True)

    def path(self, channel: str, members: int) -> Path:
        return self.folder / re.sub(r"[^\w.-]", "_", f"hplab-link-{self.job}-{channel}-{members}")

    def _open(self, channel: str, members: int) -> np.ndarray:
        path = self.path(channel, members)
        self.opened.add((channel, members))
        with open(path, "a+b") as f:  # every member opens it; the first one sizes it
            if f.seek(0, 2) < members * self.SLOTS * 8:
                f.truncate(members * self.SLOTS * 8)
        table = np.memmap(path, dtype=np.float64, mode="r+", shape=(members, self.SLOTS))
        atexit.register(lambda: path.unlink(missing_ok=True))  # (the map outlives the name)
        return table


class Transfer:
    """One transfer on this rank's link: when gloo is done with `work`, the link takes its
    `nbytes` after the transfers launched before it on its channel; `wait()` (after the work's)
    sleeps until the link is through. On a GPU NCCL's future completes when the work is queued,
    before the other ranks need have launched: there (`on_gpu`) the link takes it at the wait,
    which blocks until the work is done."""

    def __init__(self, work, nbytes: float, ticket: tuple, what: str = "", on_gpu=False):
        self.queue = QUEUE
        self.work = work
        self.nbytes = nbytes
        self.what = what
        self.ticket = ticket  # (the channel's launch table)
        self.channel = id(ticket[0])
        self.ready_at = None
        self.through_at = 0.0
        self.on_the_link = threading.Event()
        self.on_gpu = on_gpu
        self.queue.launch(self.channel, self)
        if on_gpu:
            return

        def then(*_):
            return self._done()

        try:
            work.get_future().then(then)
        except RuntimeError:  # gloo's send and recv have no future: a thread waits for them
            self.work = WaitedByThread(work, then)

    def _done(self) -> None:
        """Done for real, so every member has launched it and, a channel's launches being in
        the same order everywhere, every transfer launched before it: each is ready from its
        last member's launch, and goes on the link in launch order."""
        with self.queue.lock:
            if self.ready_at is not None:  # put on the link already, with a later one
                return
            for earlier in self.queue.launched[self.channel]:
                if earlier.ready_at is None:
                    earlier.ready_at = Board.last_launch(earlier.ticket)
                if earlier is self:
                    break
            self.queue.done(self.channel)

    def wait(self) -> None:
        """Call after the work's own wait. Bounded like every wait: a transfer the link would
        take longer than the collective timeout to carry is a CommTimeout, said at once."""
        if not self.on_the_link.wait(timeout=0 if self.on_gpu else 5):
            self._done()  # a GPU's, or a callback not yet run: done, as the work is
        self.on_the_link.wait()
        if (left := self.through_at - time.perf_counter()) > collective_timeout_s():
            raise CommTimeout(
                f"{self.what or 'a transfer'} would take {left:.3g} s more on the emulated "
                f"link, longer than a collective may wait ({collective_timeout_s():g} s, "
                "HPLAB_TIMEOUT_S): give the link more bandwidth, or send less"
            )
        sleep_until(self.through_at)

    def is_through(self) -> bool:
        return self.on_the_link.is_set() and self.through_at <= time.perf_counter()


class WaitedByThread:
    """A work whose one `wait()` (gloo's send and recv allow only one) a thread makes as soon
    as it is posted, to note when it is done; the caller's `wait()` waits for that thread."""

    def __init__(self, work, then):
        self.error = None
        self.done = threading.Event()
        threading.Thread(target=self._wait, args=(work, then), daemon=True).start()

    def _wait(self, work, then) -> None:
        try:
            work.wait()
        except RuntimeError as err:  # (the caller's wait raises it)
            self.error = err
        then()
        self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.error:
            raise self.error

    def is_completed(self) -> bool:
        return self.done.is_set()


QUEUE: Queue | None = None  # this process's link (None: no emulation)


def use(link: Link | str | None, source: str = "--link") -> None:
    """Give this rank `link` (a Link, its text, or None for none); `train.py` calls it with
    --link, or HPLAB_LINK when the flag is not given (`source` names it in an error)."""
    global QUEUE
    link = parse(link, source) if isinstance(link, str) else link
    job = f"{os.environ.get('MASTER_PORT', '')}-{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    QUEUE = Queue(link, job) if link else None


class OnTheLink:
    """A collective's work and its transfer on this rank's link, waited for as one: the work,
    then the link (one range in a timeline: the rank waits)."""

    def __init__(self, transfer: Transfer):
        self.transfer = transfer

    def wait(self) -> None:
        self.transfer.work.wait()
        self.transfer.wait()

    def is_completed(self) -> bool:
        return self.transfer.work.is_completed() and self.transfer.is_through()

    def _get_duration(self) -> float:
        """The device's own time of the work (hplab.runtime.clock reads it on a GPU)."""
        return self.transfer.work._get_duration()


def release() -> None:
    """At shutdown, once every collective is over: remove this rank's board files (a forked
    rank ends without running atexit, and they stayed in /dev/shm)."""
    if QUEUE is not None:
        QUEUE.board.remove_files()


def collective_timeout_s() -> float:
    """The seconds a collective may wait (HPLAB_TIMEOUT_S: `hplab.runtime.group`)."""
    from hplab.runtime.group import TIMEOUT  # (group imports this module)

    return TIMEOUT.total_seconds()


def stamp(call) -> tuple:
    """Note `call`'s launch on the board: a collective's among its group, a message's between
    its sender and its receiver; its ticket."""
    comm = call.comm
    if call.peer is None:
        return QUEUE.board.stamp(f"{comm.name}{comm.ranks}", comm.size, comm.rank)
    sender = comm.rank if call.op == "send" else call.peer
    receiver = call.peer if call.op == "send" else comm.rank
    channel = f"{comm.name}{comm.ranks}:{sender}>{receiver}"
    return QUEUE.board.stamp(channel, 2, int(call.op != "send"))


def wire_bytes(call) -> float | None:
    """What `call` puts on this rank's link: a collective's bus bytes, a received message's
    payload; None for a send (its receiver waits for it)."""
    if call.op == "send":
        return None
    return call.nbytes * bus_factor(call.op, call.comm.size)


@contextlib.contextmanager
def emulated(call):
    """The layer (hplab.parallel.collectives.LAYERS) that puts every launch on this rank's
    link: stamped on the board as it launches (inside its range: in a trace a transfer never
    starts before its launch), launched asynchronously, its work then waited for with the link
    (`OnTheLink`). Without a link, or for the kit's own calls, it passes straight through."""
    if QUEUE is None or call.bookkeeping or call.stage != "launch":
        yield
        return
    messages = call.parts or [call]  # send_and_recv: each message of the batch
    tickets = [stamp(message) for message in messages]
    call.launch_async = True
    yield
    on_gpu = call.comm.device.type == "cuda"
    for message, ticket in zip(messages, tickets, strict=True):
        wire = wire_bytes(message)
        if wire is not None and message.work is not None:  # (NCCL's batch: one work, no link)
            transfer = Transfer(message.work, wire, ticket, message.op, on_gpu)
            message.work = OnTheLink(transfer)
