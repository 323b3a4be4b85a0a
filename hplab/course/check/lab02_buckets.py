"""Lab 02: a bucketed gradient all-reduce with hooks (2 processes), against one process's
gradients, where hplab.DDP starts its all-reduces, and whether backward went on while they ran.

The check runs under an emulated link (CHECK_LINK, hplab.runtime.link): every all-reduce takes at
least α there, as on a network, so an all-reduce that overlaps backward and one that a hook waits
for look different in time. The learner's code gets the world communicator through `WatchedComm`,
which notes a blocking call or a wait() made while backward runs.
"""

from __future__ import annotations

import itertools
import math
import time

import torch
import torch.distributed as dist

from hplab.course.check.reference import backward_in_sandbox, gpt_reference
from hplab.course.check.report import Report, first_wrong
from hplab.models.gpt import build_model
from hplab.parallel.buckets import bucket_params
from hplab.parallel.mesh import Mesh
from hplab.runtime import link

CHECK_LINK = "100MB/s,1ms"  # each all-reduce: 1 ms + its bytes at 100 MB/s


def launch_problem(started: list, params: list, arrived: list, bucket_bytes: float) -> str | None:
    """Where the (all-reduces, bytes) started — as each gradient arrived, when backward returned,
    after wait() — first differ from hplab.parallel.ddp's: bucket j (parameters in reverse) starts
    in the hook of its last gradient, once buckets 0 ... j-1 have started."""
    ready = {id(p): k + 1 for k, p in enumerate(arrived)}  # hooks run once p's has
    buckets = bucket_params(params, bucket_bytes / 2**20)
    at = list(itertools.accumulate((max(ready[id(p)] for p in b) for b in buckets), max))
    for k, mine in enumerate(started):  # k: the learner's hooks that have run
        want = (
            sum(t <= k for t in at),
            sum(p.nbytes for b, t in zip(buckets, at) if t <= k for p in b),
        )
        if mine != want:
            when = (
                f"when gradient {k + 1} of {len(params)} arrived"
                if k < len(params)
                else ("when backward returned", "after wait()")[k - len(params)]
            )
            return (
                f"{when}, {mine[0]} all-reduce(s) of {mine[1]:,} B had started, hplab.DDP's "
                f"{want[0]} of {want[1]:,} B — it takes the parameters in reverse (backward's"
                " order) and starts each bucket from the hook that completes it"
            )


class WatchedComm:
    """The learner's communicator: the world's, noting the all-reduces waited for while backward
    runs (`in_backward`), as (how, the gradient whose hook it was, seconds blocked)."""

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.size
        self.rank = comm.rank
        self.in_backward = False
        self.gradient = 0
        self.waited = []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def all_reduce(self, tensor, *args, async_op: bool = False, **kwargs):
        start = time.perf_counter()
        handle = self.comm.all_reduce(tensor, *args, async_op=async_op, **kwargs)
        if async_op:
            return WatchedHandle(handle, self)
        self.note("comm.all_reduce without async_op=True: a blocking call", start)

    def note(self, how: str, start: float) -> None:
        if self.in_backward:
            self.waited.append((how, self.gradient, time.perf_counter() - start))


class WatchedHandle:
    """An all-reduce's handle whose wait() the WatchedComm hears of."""

    def __init__(self, handle, comm: WatchedComm):
        self.handle = handle
        self.comm = comm

    def wait(self) -> None:
        start = time.perf_counter()
        self.handle.wait()
        self.comm.note("handle.wait()", start)

    def is_completed(self) -> bool:
        return self.handle.is_completed()


def waited_problem(waited: list, n_params: int) -> str | None:
    """The first all-reduce a hook waited for while backward ran, named."""
    if waited:
        how, gradient, seconds = waited[0]
        return (
            f"the hook of gradient {gradient} of {n_params} waited for an all-reduce "
            f"({how}): backward stood still for {1e3 * seconds:.1f} ms while the check's link "
            f"({CHECK_LINK}) carried it, and nothing overlapped — launch with async_op=True, "
            "return, and wait in wait()"
        )


def overlap_s(transfers: list, returned: list, arrived: list) -> float:
    """Seconds the link carried an all-reduce while backward computed: the transfers' (start,
    end) against the gaps from each hook's return to the next gradient's arrival."""
    gaps = list(zip(returned, arrived[1:]))
    return sum(max(0.0, min(end, b) - max(start, a)) for start, end in transfers for a, b in gaps)


def overlap_problem(seconds: float, buckets: int) -> str | None:
    """None unless several buckets were sent and none of them ran beside backward (any rank)."""
    if buckets > 1 and seconds <= 0:
        return (
            f"none of the {buckets} all-reduces was on the check's link ({CHECK_LINK}) while "
            "backward computed: each hook returned only after its all-reduce was through "
            "(a hook that waits for it, however it waits) — return from the hook at once"
        )


def check_buckets(module, report: Report, mesh: Mesh) -> None:
    """Under CHECK_LINK: one bucket, one per parameter, a middle size."""
    link.use(CHECK_LINK)
    try:
        ref = gpt_reference(mesh, steps=2)
        for bucket_bytes in (math.inf, 0, 20_000):
            report.label = f"bucket_bytes={bucket_bytes}"  # an exception ends the file
            check_one_size(module, report, mesh, ref, bucket_bytes)
    finally:
        link.use(None)


def buckets_in_sandbox(env, config, bucket_bytes: float) -> None:
    """(In the learner's sandbox.) The model, and their BucketedAllReduce on its parameters
    between two hooks that tell the checker: one before theirs, one after theirs returned."""
    params = list((model := build_model(config, seed=0)).parameters())
    for k, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _, k=k: env.tell("arrived", k))
    sync = env.learner.BucketedAllReduce(params, env.comm, bucket_bytes)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: env.tell("returned"))
    env.state.update(model=model, sync=sync)


def wait_in_sandbox(env) -> dict:
    env.state["sync"].wait()
    return {k: p.grad for k, p in env.state["model"].named_parameters()}


def check_one_size(module, report: Report, mesh: Mesh, ref, bucket_bytes: float) -> None:
    """Two steps with the learner's BucketedAllReduce at `bucket_bytes`; one Result."""
    named = dict(build_model(ref.config, seed=0).named_parameters())  # the sandbox's, in order
    params = list(named.values())
    seen = {}
    module.comm = comm = WatchedComm(mesh.world)

    def arrived(k):  # told by a hook before the learner's: runs before theirs
        s = mesh.ledger.totals().get("all_reduce")
        seen["started"].append((s.calls, s.bytes) if s else (0, 0))
        seen["arrived"].append(params[k] if k is not None else None)
        seen["times"].append(time.perf_counter())
        comm.gradient = len(seen["arrived"])

    def returned():  # told by a hook after theirs: their hook has returned
        seen["returned"].append(time.perf_counter())

    module.listeners.update(arrived=arrived, returned=returned)
    module.run(buckets_in_sandbox, ref.config, bucket_bytes)
    for step, rows in enumerate(ref.rows):
        mesh.ledger.reset()
        seen.update(started=[], arrived=[], times=[], returned=[])
        link.WIRE.log = []
        comm.in_backward = True
        comm.waited = []
        module.run(backward_in_sandbox, rows)
        comm.in_backward = False
        arrived(None)  # when backward returned
        grads = module.run(wait_in_sandbox)
        arrived(None)  # after wait()
        transfers = [(start, end) for _, start, end in link.WIRE.log]
        arrivals = seen["times"][: len(params)]
        overlap = torch.tensor(overlap_s(transfers, seen["returned"], arrivals))
        dist.all_reduce(overlap, op=dist.ReduceOp.MAX)  # (raw: not the learner's traffic)
        n_buckets = seen["started"][-1][0]
        if problem := first_wrong(
            {k: grads.get(k) for k in named},
            ref.grads[step],
            "gradients are not the global-batch average",
            mesh.world.size,
        ) or (
            launch_problem(seen["started"], params, seen["arrived"][: len(params)], bucket_bytes)
            or waited_problem(comm.waited, len(params))
            or overlap_problem(float(overlap), n_buckets)
        ):
            break
    link.WIRE.log = None
    beside = (
        f"all-reduces ran {1e3 * float(overlap):.1f} ms beside backward"
        if n_buckets > 1
        else "one bucket: ready when backward ends, nothing left to overlap"
    )
    report.add(
        problem and f"step {step + 1}: {problem}",
        f"gradients equal one process's; {n_buckets} bucket(s), {seen['started'][-1][1]:,} B, "
        f"each sent by its last hook, none waited for in backward; on the check's link "
        f"({CHECK_LINK}) {beside}",
    )
