"""Lab 02: a bucketed gradient all-reduce with hooks (2 processes), against one process's
gradients and where hplab.ddp starts its all-reduces.
"""

from __future__ import annotations

import itertools
import math

from hplab.comm import bucket_params
from hplab.course.check.reference import gpt_reference
from hplab.course.check.report import Report, first_wrong
from hplab.dist import Mesh
from hplab.models.gpt import build_model


def launch_problem(started: list, params: list, arrived: list, bucket_bytes: float) -> str | None:
    """Where the (all-reduces, bytes) started — as each gradient arrived, when backward returned,
    after wait() — first differ from hplab.ddp's: bucket j (parameters in reverse) starts in the
    hook of its last gradient, once buckets 0 ... j-1 have started."""
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
                f"{when}, {mine[0]} all-reduce(s) of {mine[1]:,} B had started, hplab.ddp's "
                f"{want[0]} of {want[1]:,} B — it takes the parameters in reverse (backward's"
                " order) and starts each bucket from the hook that completes it"
            )


def check_buckets(module, report: Report, mesh: Mesh) -> None:
    """One bucket, one per parameter, a middle size: one process's gradients, hplab.ddp's starts."""
    ref = gpt_reference(mesh, steps=2)
    for bucket_bytes in (math.inf, 0, 20_000):
        report.label = f"bucket_bytes={bucket_bytes}"  # an exception ends the file
        params = list((model := build_model(ref.config, seed=0)).parameters())

        def observe(param):  # registered before the learner's hooks: runs before theirs
            started.append(  # noqa: B023 (this step's lists: the hooks run inside the step)
                (s.calls, s.bytes) if (s := mesh.ledger.totals().get("all_reduce")) else (0, 0)
            )
            arrived.append(param)  # noqa: B023

        for p in params:
            p.register_post_accumulate_grad_hook(observe)
        sync = module.BucketedAllReduce(params, mesh.world, bucket_bytes)
        for step, rows in enumerate(ref.rows):
            model.zero_grad()
            mesh.ledger.reset()
            arrived, started = [], []  # per gradient hook: the (all-reduces, bytes) before it
            model(*rows)[1].backward()
            observe(None)  # when backward returned
            sync.wait()
            observe(None)  # after wait()
            if problem := first_wrong(
                {k: p.grad for k, p in model.named_parameters()},
                ref.grads[step],
                "gradients are not the global-batch average",
                mesh.world.size,
            ) or launch_problem(started, params, arrived[: len(params)], bucket_bytes):
                break
        report.add(
            problem and f"step {step + 1}: {problem}",
            "gradients equal one process's; "
            f"{started[-1][0]} bucket(s), {started[-1][1]:,} B, each sent by its last hook",
        )
