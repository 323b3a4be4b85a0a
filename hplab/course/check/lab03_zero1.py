"""Lab 03: the ZeRO-1 step (2 processes), against one process's AdamW on the whole batch."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hplab.course.check.reference import gpt_reference
from hplab.course.check.report import Report, collectives, differs, first, first_wrong
from hplab.dist import Mesh
from hplab.models.gpt import build_model


def check_zero1(module, report: Report, mesh: Mesh) -> None:
    """ZeRO1 on this rank's rows against one process's AdamW on the whole batch: my shard's grad,
    the params, Adam state 2 × Ψ/n, one reduce-scatter and one all-gather of the padded buffer."""
    lr, n, r = 1e-2, mesh.world.size, mesh.world.rank
    ref = gpt_reference(mesh, steps=3, lr=lr)
    model, numel = build_model(ref.config, seed=0), sum(g.numel() for g in ref.grads[0])
    shard, flat_bytes = math.ceil(numel / n), 4 * n * math.ceil(numel / n)  # padded, fp32
    report.label = "ZeRO1(params, comm, lr)"  # an exception ends the file's check (see Report)
    opt = module.ZeRO1(list(model.parameters()), mesh.world, lr=lr)
    for step, rows in enumerate(ref.rows):
        model.zero_grad()
        model(*rows)[1].backward()
        report.label = f"step {step + 1}"
        _, used = collectives(mesh, opt.step)
        others = sorted(set(used) - {"reduce_scatter", "all_gather"})
        want = F.pad(
            torch.cat([g.reshape(-1) for g in ref.grads[step]]), (0, shard * n - numel)
        ).view(n, shard)[r]
        got = getattr(getattr(opt, "master", None), "grad", None)
        state = sum(
            t.numel()
            for s in opt.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        problem = first(
            [
                used != dict.fromkeys(("reduce_scatter", "all_gather"), (1, flat_bytes))
                and (
                    f"used {', '.join(others) or used}: ZeRO-1 needs only a reduce-scatter of the "
                    f"gradients and an all-gather of the parameters, one each of {flat_bytes:,} B"
                ),
                (d := differs(got, want, n))
                and f"self.master.grad is not my shard of the global-batch average gradient: {d}",
                first_wrong(
                    dict(model.named_parameters()),
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
