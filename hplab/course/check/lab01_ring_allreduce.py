"""Lab 01: ring all-reduce from send/recv (4 processes).

A right sum and the right byte count do not make a ring: an all-pairs exchange (every rank
sends chunk j straight to rank j, then its finished chunk to everyone) moves exactly a ring's
2(n-1)/n·S bytes. So the checker also watches every message (`Watched`) and asks what makes a
ring: each rank sends only to the next rank and receives only from the previous one, and each
step passes on the chunk it received at the step before — during the reduce-scatter with its
own numbers added (step s carries a chunk summed over ranks r-s … r), during the all-gather
finished (summed over every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hplab.course.check.report import Report, collectives, differs, first
from hplab.parallel.mesh import Mesh
from hplab.plan import formulas

CASES = [((1000,), "float32"), ((7, 13), "float32"), ((3,), "float32"), ((64, 64), "float32")]
CASES += [((10,), "float64")]


class Watched:
    """The learner's communicator, noting each message: where it went or came from, and what a
    send carried when it was posted."""

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.size
        self.rank = comm.rank
        self.sent = []  # [(dst, the numbers)], [src]
        self.sources = []

    def _note(self, kind: str, tensor, peer: int) -> None:
        if kind == "send":
            self.sent.append((peer, tensor.detach().flatten().clone()))
        else:
            self.sources.append(peer)

    def send(self, tensor, dst, async_op=False):
        self._note("send", tensor, dst)
        return self.comm.send(tensor, dst, async_op)

    def recv(self, tensor, src, async_op=False):
        self._note("recv", tensor, src)
        return self.comm.recv(tensor, src, async_op)

    def send_and_recv(self, ops):
        for kind, tensor, peer in ops:
            self._note(kind, tensor, peer)
        return self.comm.send_and_recv(ops)

    def __getattr__(self, name):  # anything else (a built-in collective: the ledger sees it)
        return getattr(self.comm, name)


def locate(numbers: torch.Tensor, candidates: torch.Tensor) -> tuple[int, int] | None:
    """(first, last + 1): where in the flat `candidates` the message's numbers sit, or None."""
    m = numbers.numel()
    if not 0 < m <= candidates.numel():
        return None
    windows = candidates.unfold(0, m, 1)  # every run of m consecutive elements
    hits = torch.isclose(windows, numbers.to(candidates.dtype), 1e-5, 1e-6).all(dim=1)
    where = hits.nonzero()
    return (int(where[0]), int(where[0]) + m) if len(where) else None


def chunks_sent(watch: Watched, inputs: torch.Tensor) -> list:
    """For each message this rank sent, the elements it carried if they are what step k of a
    ring carries (step s < n-1: summed over ranks r-s … r; later: summed over all), else None."""
    n = watch.size
    r = watch.rank
    flat = inputs.flatten(1)
    summed_up_to = [flat[[(r - j) % n for j in range(s + 1)]].sum(0) for s in range(n)]
    return [
        locate(numbers, summed_up_to[min(k, n - 1)]) for k, (_, numbers) in enumerate(watch.sent)
    ]


def not_a_ring(watch: Watched, every_rank: list, numel: int) -> str | None:
    """Why the messages are not a ring's (every_rank: each rank's `chunks_sent`), or None."""
    n = watch.size
    r = watch.rank
    right = (r + 1) % n
    left = (r - 1) % n
    if wrong := [dst for dst, _ in watch.sent if dst != right]:
        return (
            f"sent to rank {wrong[0]}: this is not a ring (r → r+1) — in a ring rank r sends "
            f"only to the next rank (r+1) % n = {right}"
        )
    if wrong := [src for src in watch.sources if src != left]:
        return (
            f"received from rank {wrong[0]}: this is not a ring (r-1 → r) — in a ring rank r "
            f"receives only from the previous rank (r-1) % n = {left}"
        )
    if numel < n:  # empty chunks are not sent: fewer messages, no step numbers to compare
        return None
    if len(watch.sent) != 2 * (n - 1):
        return f"sent {len(watch.sent)} messages; a ring sends 2(n-1) = {2 * (n - 1)}, one a step"
    mine = every_rank[r]
    before = every_rank[left]
    for k, chunk in enumerate(mine):
        phase, s = ("reduce-scatter", k) if k < n - 1 else ("all-gather", k - n + 1)
        if chunk is None:
            ranks = ", ".join(str((r - j) % n) for j in range(k, -1, -1))
            held = f"ranks {ranks}"
            added = ", with its own numbers added"
            if k >= n - 1:
                held = "every rank"
                added = ""
            return (
                f"{phase} step {s}: the message is not a chunk summed over {held} — not the "
                "ring's chunk order: each step passes on the chunk received at the step "
                f"before{added}"
            )
        if k and before[k - 1] is not None and chunk != before[k - 1]:
            return (
                f"{phase} step {s}: sent elements {chunk[0]}…{chunk[1] - 1}, but the chunk it "
                f"received at the step before was {before[k - 1][0]}…{before[k - 1][1] - 1}: "
                "not the ring's chunk order (pass on what came from the left)"
            )
    return None


def ring_in_sandbox(env, tensor: torch.Tensor) -> torch.Tensor:
    """(In the learner's sandbox.) Their ring on this rank's tensor, in place; the result."""
    env.learner.ring_all_reduce(tensor, env.comm)
    return tensor


def check_ring(module, report: Report, mesh: Mesh) -> None:
    """On every rank, for tensors of several shapes and dtypes: only send and recv were used,
    the messages form a ring, each rank sent 2(n-1) chunks of S/n bytes, and the result is the
    sum over the ranks."""
    n = mesh.world.size
    r = mesh.world.rank
    for shape, dtype in CASES:
        report.label = f"{'×'.join(map(str, shape))} {dtype}"  # an exception ends the file
        inputs = torch.randn(
            (n, *shape),
            dtype=getattr(torch, dtype),
            generator=torch.Generator().manual_seed(len(shape)),
        )  # [rank]
        expected = inputs.sum(0)
        tensor = inputs[r].clone()
        module.comm = watch = Watched(mesh.world)  # what the learner's comm calls run on
        tensor, used = collectives(mesh, module.run, ring_in_sandbox, tensor)
        every_rank = [None] * n
        dist.all_gather_object(every_rank, chunks_sent(watch, inputs))
        others = sorted(set(used) - {"send", "recv"})
        sent = used.get("send", (0, 0))[1]
        ideal = formulas.bus_factor("all_reduce", n) * tensor.nbytes  # 2(n-1)/n·S
        per_element = 2 * (n - 1) * tensor.element_size()  # chunks: ⌊S/n⌋ to ⌈S/n⌉ numbers
        problem = first(
            [
                others and f"used {', '.join(others)}: build it from send and recv only",
                not tensor.numel() // n <= sent / per_element <= -(-tensor.numel() // n)
                and (
                    f"sent {sent:,} bytes; a ring all-reduce sends 2(n-1) chunks of S/n = "
                    f"{ideal:,.0f} bytes: one chunk per step, not the whole tensor"
                ),
                not_a_ring(watch, every_rank, tensor.numel()),
                (d := differs(tensor, expected))
                and f"the result is not the sum over the ranks: {d}",
            ]
        )
        report.add(
            problem,
            f"a ring, sum correct, {sent:,} bytes sent (2(n-1)/n·S = {ideal:,.0f})",
        )
        stopped = [None] * n  # a wrong exchange can send sizes gloo cannot match: stop at the
        dist.all_gather_object(stopped, bool(problem))  # first case that fails on any rank
        if any(stopped):
            break
