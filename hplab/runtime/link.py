"""An emulated network: the time a real one takes, on a laptop whose own "network" is free.

On one machine gloo's messages cross loopback: the CPU cores that compute also move the bytes,
and moving them costs little next to computing. Over NVLink or a network card, bytes move
beside the computation, at a rate that makes communication cost about as much as compute.
`--link` (or the HPLAB_LINK environment variable) gives the ranks such a network:

    --link 20MB/s,200us                         one tier: every rank's links β = 20 MB/s, α = 200 µs
    --link "node=4 inside=900GB/s,2us between=50GB/s,5us"
                                                nodes of 4 consecutive ranks: fast links inside a
                                                node, slower ones between nodes

A collective then runs its ring algorithm over those links, hop by hop, and transfers that
cross one link at once share it (`hplab.runtime.wire`, the model). The real data still moves
through gloo (or NCCL), so every result is bit for bit the one without a link: a transfer's
time on the wire starts when its last member launches it, and its `wait()` returns when both
the real transfer and the wire are through, sleeping the difference out (using no core, as a
network card moves bytes without the CPU). The network is a layer of the collectives
(`emulated`, installed by `hplab.runtime.group.init_distributed`). Off by default, and then
nothing is paid: the layer passes every call straight through.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
from collections import Counter

from hplab.runtime.errors import CommTimeout
from hplab.runtime.wire import MAX_RANKS, Link, Topology, Wire  # noqa: F401 (link.Link)

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
PER_SECOND = {"s": 1, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}


class LinkError(ValueError):
    """A --link that cannot be read; the message shows one that can."""


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


def parse_wire(text: str, source: str = "--link") -> Topology:
    """The network of `--link`: one link (`parse`) for every rank, or two tiers,
    `node=N inside=LINK between=LINK` (in any order, apart by spaces or ';')."""
    if "=" not in text:
        return Topology(parse(text, source))
    fields = dict(part.partition("=")[::2] for part in re.split(r"[;\s]+", text.strip()) if part)
    example = "e.g. --link 'node=4 inside=900GB/s,2us between=50GB/s,5us'"
    if sorted(fields) != ["between", "inside", "node"]:
        raise LinkError(
            f"{source} {text!r}: two tiers need node=, inside= and between= (and nothing else), "
            + example
        )
    if not fields["node"].isdigit() or int(fields["node"]) < 1:
        raise LinkError(
            f"{source} {text!r}: node={fields['node']} is not a number of ranks (1 or more), "
            + example
        )
    return Topology(
        parse(fields["inside"], f"{source} inside="),
        parse(fields["between"], f"{source} between="),
        int(fields["node"]),
    )


WIRE: Wire | None = None  # this process's network (None: no emulation)
LAUNCHES: dict[str, Counter] = {}  # per job: its channels' launches so far (kept across `use`)
OPENED: dict[str, Wire] = {}  # per job: the wire this process opened (`release` removes them)


def use(network: Topology | Link | str | None, source: str = "--link") -> None:
    """Give the ranks `network` (a Topology, a Link for one tier, its text, or None for none);
    `train.py` calls it with --link, or HPLAB_LINK when the flag is not given (`source` names
    it in an error). Every rank of the job calls it with the same network."""
    global WIRE
    network = parse_wire(network, source) if isinstance(network, str) else network
    network = Topology(network) if isinstance(network, Link) else network
    if network is None:
        WIRE = None
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > MAX_RANKS:
        raise LinkError(
            f"{source}: the emulated network has room for {MAX_RANKS} ranks, not {world}"
        )
    job = "-".join(
        os.environ.get(key, "")
        for key in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    )
    if job not in OPENED:  # (kept when switched off: the other ranks may still be on it)
        OPENED[job] = Wire(network, job, LAUNCHES.setdefault(job, Counter()))
        atexit.register(OPENED[job].close)
    WIRE = OPENED[job]
    WIRE.topology = network


class OnTheWire:
    """A collective's work and its transfer on the wire, waited for as one: the work, then the
    wire (one range in a timeline: the rank waits)."""

    def __init__(self, work, wire: Wire, ticket: tuple, what: str):
        self.work = work
        self.wire = wire
        self.ticket = ticket
        self.what = what

    def wait(self) -> None:
        self.work.wait()
        self.wire.wait(self.ticket, self.what, collective_timeout_s(), self.too_long)

    def too_long(self, left: float) -> None:
        """Bounded like every wait: a transfer the wire would take longer than the collective
        timeout to carry is a CommTimeout, said at once."""
        raise CommTimeout(
            f"{self.what} would take {left:.3g} s more on the emulated link, longer than a "
            f"collective may wait ({collective_timeout_s():g} s, HPLAB_TIMEOUT_S): give the "
            "link more bandwidth, or send less"
        )

    def is_completed(self) -> bool:
        return self.work.is_completed() and self.wire.is_through(self.ticket)

    def _get_duration(self) -> float:
        """The device's own time of the work (hplab.runtime.clock reads it on a GPU)."""
        return self.work._get_duration()


def release() -> None:
    """At shutdown, once every collective is over: remove the files of the wires this process
    opened, on or switched off since (a forked rank ends without running atexit, and they
    stayed in /dev/shm)."""
    global WIRE
    for wire in OPENED.values():
        wire.close()
    OPENED.clear()  # (a later `use` opens a new file)
    WIRE = None


def collective_timeout_s() -> float:
    """The seconds a collective may wait (HPLAB_TIMEOUT_S: `hplab.runtime.group`)."""
    from hplab.runtime.group import TIMEOUT  # (group imports this module)

    return TIMEOUT.total_seconds()


def launch(call) -> tuple:
    """Stamp `call`'s launch on the wire: a collective among its group's ranks, a message
    between its sender and its receiver (global ranks); its ticket."""
    comm = call.comm
    me = comm.ranks[comm.rank]
    if call.op not in ("send", "recv"):
        return WIRE.launch(f"{comm.name}{comm.ranks}", call.op, comm.ranks, me, call.nbytes)
    other = comm.ranks[call.peer]
    ends = (me, other) if call.op == "send" else (other, me)
    channel = f"{comm.name}{comm.ranks}:{ends[0]}>{ends[1]}"
    return WIRE.launch(channel, "send", list(ends), me, call.nbytes, ends)


@contextlib.contextmanager
def emulated(call):
    """The layer (hplab.parallel.collectives.LAYERS) that puts every launch on the wire:
    stamped as it launches (inside its range: in a trace a transfer never starts before its
    launch), launched asynchronously, its work then waited for with the wire (`OnTheWire`;
    a send's sender does not wait for it, its receiver does). Without a network, or for the
    kit's own calls, it passes straight through."""
    if WIRE is None or call.bookkeeping or call.stage != "launch":
        yield
        return
    messages = call.parts or [call]  # send_and_recv: each message of the batch
    tickets = [launch(message) for message in messages]
    call.launch_async = True
    yield
    for message, ticket in zip(messages, tickets, strict=True):
        if message.op != "send" and message.work is not None:  # (NCCL's batch: one work)
            message.work = OnTheWire(message.work, WIRE, ticket, message.op)
