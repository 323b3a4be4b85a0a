"""Lab 03: the ZeRO-1 step (2 processes), against one process's AdamW on the whole batch."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hplab.course.check.reference import backward_in_sandbox, gpt_reference
from hplab.course.check.report import Report, collectives, differs, first, first_wrong
from hplab.models.gpt import build_model
from hplab.parallel.mesh import Mesh

ZERO1_OPS = ("reduce_scatter", "all_gather")


def traffic_problem(used: dict, flat_bytes: int) -> str | None:
    """ZeRO-1's traffic: one reduce-scatter and one all-gather of the padded flat buffer."""
    if used == dict.fromkeys(ZERO1_OPS, (1, flat_bytes)):
        return None
    others = sorted(set(used) - set(ZERO1_OPS))
    if not others and "all_gather" not in used:
        return (
            "no all-gather: each rank updated only its own shard, so the ranks' parameters "
            "now differ; every rank needs every rank's updated shard"
        )
    return (
        f"used {', '.join(others) or used}: ZeRO-1 needs only a reduce-scatter of the "
        f"gradients and an all-gather of the parameters, one each of {flat_bytes:,} B"
    )


def zero1_in_sandbox(env, config, lr: float) -> None:
    """(In the learner's sandbox.) The model, and their ZeRO1 over its parameters."""
    model = build_model(config, seed=0)
    env.state.update(model=model, opt=env.learner.ZeRO1(list(model.parameters()), env.comm, lr=lr))


def step_in_sandbox(env) -> tuple:
    """Their step; then the parameters, whether any changed, self.master.grad and how many
    numbers Adam keeps (its state's tensors)."""
    model = env.state["model"]
    opt = env.state["opt"]
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    state = sum(
        t.numel()
        for s in opt.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    moved = not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    master_grad = getattr(getattr(opt, "master", None), "grad", None)
    return dict(model.named_parameters()), moved, master_grad, state


def check_zero1(module, report: Report, mesh: Mesh) -> None:
    """ZeRO1 on this rank's rows against one process's AdamW on the whole batch: my shard's grad,
    the params, Adam state 2 × Ψ/n, one reduce-scatter and one all-gather of the padded buffer."""
    lr = 1e-2
    n = mesh.world.size
    r = mesh.world.rank
    ref = gpt_reference(mesh, steps=3, lr=lr)
    names = [k for k, _ in build_model(ref.config, seed=0).named_parameters()]
    numel = sum(g.numel() for g in ref.grads[0])
    shard = math.ceil(numel / n)  # padded, fp32
    flat_bytes = 4 * n * math.ceil(numel / n)
    report.label = "ZeRO1(params, comm, lr)"  # an exception ends the file's check (see Report)
    module.run(zero1_in_sandbox, ref.config, lr)
    for step, rows in enumerate(ref.rows):
        module.run(backward_in_sandbox, rows)
        report.label = f"step {step + 1}"
        (params, moved, got, state), used = collectives(mesh, module.run, step_in_sandbox)
        want = F.pad(
            torch.cat([g.reshape(-1) for g in ref.grads[step]]), (0, shard * n - numel)
        ).view(n, shard)[r]
        problem = first(
            [
                traffic_problem(used, flat_bytes),
                (d := differs(got, want, n))
                and f"self.master.grad is not my shard of the global-batch average gradient: {d}",
                not moved
                and "the parameters did not change in this step: the shards' values after the "
                "optimizer step must reach every rank's parameters",
                first_wrong(
                    {k: params.get(k) for k in names},
                    ref.params[step],
                    "parameters differ from one process's AdamW",
                ),
                state != 2 * shard
                and f"Adam keeps {state:,} numbers, not 2 × {shard:,} (my shard)",
            ]
        )
        report.add(
            problem,
            f"params equal one process's AdamW; one reduce-scatter + one all-"
            f"gather of {flat_bytes:,} B; Adam state 2 × Ψ/{n} = {2 * shard:,} numbers",
        )
        if problem:
            return
