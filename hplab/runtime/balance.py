"""The laptop at a real machine's balance: `--link h100-80g`, or `--link 'h100-80g node=2'`.

A laptop computes some ten thousand times slower than a GPU, so a link with a GPU cluster's
α and β would make communication look free. What a lesson about time needs is the machine's
balance: how long a step's messages take next to its compute. Let

    r = this machine's FLOP/s for the run's model / the GPU's FLOP/s for it

Every second of work there lasts 1/r seconds here. Messages keep that scale when the link's
latency grows and its bandwidth shrinks by the same factor:

    α_here = α_there / r        β_here = β_there · r

Then a step's compute and its messages take the times they would take there, all multiplied
by 1/r. The GPU's FLOP/s, its links and their latencies are the planner's data sheet
(`hplab.plan.presets`: peak in the run's precision × `Efficiency.gemm`; NVLink and the network
card × `Efficiency.comm`; `Cluster`'s α of a step inside a node and across nodes). This
machine's FLOP/s is measured as the run begins: every rank runs the whole model's forward and
backward on one micro-batch at the same time as the others (so sharing the cores as they will
in the run), and the ranks take the mean.

    --link h100-80g            every rank inside one H100 node, on NVLink
    --link 'h100-80g node=2'   nodes of 2 consecutive ranks: NVLink inside a node, each rank's
                               400 Gb/s InfiniBand card between nodes

What it keeps is the FLOP-to-byte balance of a step. What it does not keep: the cost of
launching a GPU's kernels, its memory bandwidth (the element-wise passes a CPU pays in its
FLOP/s) and how far below its peak a GPU runs a model this small.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hplab.plan.formulas import flops_per_step
from hplab.plan.presets import GB, GPU, GPU_PRESETS, Cluster, Efficiency
from hplab.runtime import link
from hplab.runtime.clock import clock_for
from hplab.runtime.errors import explained
from hplab.runtime.wire import Link, Topology

MACHINES = ", ".join(GPU_PRESETS)
PLANNERS = Efficiency()  # the planner's assumptions of how close to its data sheet a GPU runs


@dataclass(frozen=True)
class Machine:
    """A GPU of the data sheet, `node` ranks to a node (0: every rank inside one node)."""

    gpu: GPU
    node: int = 0

    def __str__(self) -> str:
        return self.gpu.name + (f" node={self.node}" if self.node else "")


def parse_machine(text: str | None, source: str = "--link") -> Machine | None:
    """`'h100-80g node=2'` → Machine; None for a link given by its numbers (`link.parse_wire`'s
    to read). A word that names no machine is refused, naming those there are."""
    words = (text or "").replace(";", " ").split()
    if not words or not words[0][0].isalpha() or "=" in words[0] or "/" in words[0]:
        return None
    example = f"e.g. {source} 'h100-80g node=2' (or a link of your own: {source} 20MB/s,200us)"
    if words[0] not in GPU_PRESETS:
        raise link.LinkError(
            f"{source} {text!r}: no machine {words[0]!r}: name one of {MACHINES}, or give a "
            f"link's numbers, e.g. {source} 20MB/s,200us"
        )
    fields = dict(word.partition("=")[::2] for word in words[1:])
    if set(fields) - {"node"} or len(fields) < len(words) - 1:
        raise link.LinkError(f"{source} {text!r}: after the machine only node=N, {example}")
    node = fields.get("node", "0")
    if "node" in fields and not (node.isdigit() and int(node) >= 1):
        raise link.LinkError(f"{source} {text!r}: node={node} is not a number of ranks, {example}")
    return Machine(GPU_PRESETS[words[0]], int(node))


def gpu_flops(machine: Machine, precision: str, eff: Efficiency = PLANNERS) -> float:
    """The FLOP/s the planner expects of the machine's GPU: its peak × `Efficiency.gemm`."""
    return machine.gpu.peak_tflops[precision] * 1e12 * eff.gemm


def network(
    machine: Machine, here_flops: float, precision: str, eff: Efficiency = PLANNERS
) -> Topology:
    """The wire at the machine's balance, for a run computing at `here_flops` per rank."""
    r = here_flops / gpu_flops(machine, precision, eff)
    cluster = Cluster(machine.gpu)
    nvlink = Link(machine.gpu.nvlink_gbps * GB * eff.comm * r, cluster.intra_latency_s / r)
    if not machine.node:
        return link.parse_wire(str(Topology(nvlink)))  # (as the metrics spell it)
    card = Link(machine.gpu.network_gbps * GB * eff.comm * r, cluster.inter_latency_s / r)
    return link.parse_wire(str(Topology(nvlink, card, machine.node)))


def measure_flops(work: Callable[[], None], flops: float, device, repeats: int = 3) -> float:
    """FLOP/s of `work` (`flops` of computation), the median of `repeats` after a warm-up,
    every rank at once; the ranks' mean, the same number on each (1 rank: its own)."""
    clock = clock_for(device)
    if dist.is_initialized():
        with explained("the balance's start"):  # (a lost peer: one line)
            dist.barrier()
    times = []
    for _ in range(repeats + 1):
        start = clock.mark()
        work()
        times.append(clock.seconds(start, clock.mark()))
    rate = torch.tensor([flops / statistics.median(times[1:])], device=device)
    if dist.is_initialized():
        with explained("the balance's mean rate"):
            dist.all_reduce(rate)
        rate /= dist.get_world_size()
    return float(rate)


def at_balance(
    text: str, work: Callable[[], None], flops: float, precision: str = "fp32", device="cpu"
) -> dict:
    """Put the ranks on `text`'s machine at this machine's balance (`link.use`), having measured
    `work` (a forward and backward of the model: `flops` of it); every rank calls it, after
    `init_distributed`. Returns what the metrics keep of it."""
    machine = parse_machine(text)
    if machine is None:
        raise link.LinkError(f"--link {text!r} gives a link's numbers: pass it to link.use")
    here = measure_flops(work, flops, device)
    try:
        wire = network(machine, here, precision)
    except link.LinkError:
        there = gpu_flops(machine, precision)
        raise link.LinkError(
            f"--link {text!r}: this machine trains the model at {here / 1e9:.3g} GFLOP/s, "
            f"1/{there / here:,.0f} of the {machine.gpu.name}'s {there / 1e12:.3g} TFLOP/s in "
            f"{precision}: its network's latency would last over a second here, or its "
            "bandwidth fall under 1 kB/s; train in fp32 or a smaller model, or give a link of "
            "your own (--link 20MB/s,200us)"
        ) from None
    link.use(wire)
    return {
        "machine": str(machine),
        "precision": precision,
        "here_flops_per_s": here,
        "gpu_flops_per_s": gpu_flops(machine, precision),
        "scale": here / gpu_flops(machine, precision),
        "network": str(wire),
    }


def model_at_balance(text: str, model, x, y, config, precision: str = "fp32", device="cpu") -> dict:
    """`at_balance`, measured on one forward and backward of hplab's decoder `model` (of shape
    `config`) on tokens `x` and targets `y`, this rank's micro-batch. Dropout draws from a fork
    of the random generators: the run's own random numbers stay as they would be."""
    device = torch.device(device)

    def forward_and_backward():
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model(x, y)[1].backward()

    flops = flops_per_step(config, len(x))["model_flops"]
    return at_balance(text, forward_and_backward, flops, precision, device)
