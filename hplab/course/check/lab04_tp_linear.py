"""Lab 04: column- and row-parallel linear layers, f and g (2 processes)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from hplab.course.check.report import Report, collectives, differs, first_wrong
from hplab.parallel.mesh import Mesh

SHAPES = [(2, 8, 16), (3, 5, 24)]  # (b, s, h); the MLP is h → 4h → h


def whole_mlp(b: int, s: int, h: int) -> SimpleNamespace:
    """The whole MLP in one process on X (b, s, h) and its gradients for the loss sum(Z ·
    weights); `mine`: copies of its two layers, before any gradient, for the learner's layers."""
    g = torch.Generator().manual_seed(b * s * h)
    x = torch.randn(b, s, h, generator=g, requires_grad=True)
    weights = torch.randn(b, s, h, generator=g)  # the loss: this weighted sum of Z
    torch.manual_seed(h)
    fc = torch.nn.Linear(h, 4 * h)  # the whole MLP
    proj = torch.nn.Linear(4 * h, h)
    mine = copy.deepcopy((fc, proj))  # the learner's copies, before any gradient
    z_ref = proj(F.gelu(fc(x)))
    (z_ref * weights).sum().backward()
    z_ref, bias, x_grad, x.grad = z_ref.detach(), proj.bias.detach(), x.grad, None
    return SimpleNamespace(
        x=x, weights=weights, fc=fc, proj=proj, mine=mine, z=z_ref, bias=bias, x_grad=x_grad
    )


def _forward_problem(z, ref: SimpleNamespace, n: int) -> str | None:
    """How Z differs from the whole MLP's output, and the usual reason, or None."""
    wrong = differs(z, ref.z)
    z_ref = ref.z
    bias = ref.bias
    return wrong and "Z differs from the whole MLP: " + wrong + (
        " — every rank returns the full output"
        if z.shape != z_ref.shape
        else " — the bias, added before g's all-reduce, counts T times: add it once, after g"
        if not differs(z, z_ref + (n - 1) * bias)
        else " — only this rank's partial sum: g must all-reduce it"
        if abs(float((z.detach() - bias).norm() / (z_ref - bias).norm()) - 1) > 1e-3
        else ""
    )


def _x_grad_problem(x_grad, ref: SimpleNamespace, n: int) -> str | None:
    wrong = differs(x_grad, ref.x_grad)
    return wrong and f"X.grad is not the single-process gradient: {wrong} — " + (
        f"it is {n}× too large: only f's backward all-reduces, g's passes it through"
        if not differs(x_grad, n * ref.x_grad)
        else "f's backward must all-reduce: each rank holds only its slice's contribution"
    )


GRADIENTS = ("column.weight.grad", "column.bias.grad", "row.weight.grad", "row.bias.grad")


def _gradients_problem(grads: dict, ref: SimpleNamespace, rows: slice) -> str | None:
    return first_wrong(
        {k: grads.get(k) for k in GRADIENTS},
        [
            ref.fc.weight.grad[rows],
            ref.fc.bias.grad[rows],
            ref.proj.weight.grad[:, rows],
            ref.proj.bias.grad,
        ],
        "gradients are not this rank's slice of the single-process gradient",
    )


def _communication_problem(used: dict, z_bytes: int) -> str | None:
    bad = "; ".join(
        f"{phase}: {ops or 'nothing'}"
        for phase, ops in used.items()
        if ops != {"all_reduce": (1, z_bytes)}
    )
    return (
        bad
        and f"expected one all-reduce of b·s·h·4 = {z_bytes:,} B in forward (g) "
        f"and one in backward (f); saw (calls, bytes) {bad}"
    )


def layers_in_sandbox(env, fc, proj) -> None:
    """(In the learner's sandbox.) Their column- and row-parallel layers, cut from the whole
    MLP's two."""
    column = env.learner.ColumnParallelLinear(fc, env.comm)
    env.state.update(column=column, row=env.learner.RowParallelLinear(proj, env.comm))


def forward_in_sandbox(env, x):
    env.state["x"], column, row = x, env.state["column"], env.state["row"]
    env.state["z"] = z = row(F.gelu(column(x)))
    return z.detach()


def backward_in_sandbox(env, weights) -> tuple:
    """Backward of sum(Z · weights): X.grad and this rank's four parameter gradients."""
    (env.state["z"] * weights).sum().backward()
    column = env.state["column"]
    row = env.state["row"]
    layers = {"column.weight": column.weight, "column.bias": column.bias}
    layers.update({"row.weight": row.weight, "row.bias": row.bias})
    return env.state["x"].grad, {f"{k}.grad": p.grad for k, p in layers.items()}


def check_tp_linear(module, report: Report, mesh: Mesh) -> None:
    """Column → GeLU → row against the whole MLP in one process (same weights, same X): Z,
    X.grad (f's backward), this rank's slice of each gradient, one all-reduce of Z each way."""
    n = mesh.world.size
    r = mesh.world.rank
    for b, s, h in SHAPES:
        case = f"b={b} s={s} h={h}"
        ref = whole_mlp(b, s, h)
        rows = slice(r * 4 * h // n, (r + 1) * 4 * h // n)  # this rank's slice of the 4h
        report.label = case  # an exception ends the file's check (see Report)
        module.run(layers_in_sandbox, *ref.mine)
        z, forward = collectives(mesh, module.run, forward_in_sandbox, ref.x)
        (x_grad, grads), backward = collectives(mesh, module.run, backward_in_sandbox, ref.weights)
        z_bytes = ref.z.numel() * 4
        report.add(
            _forward_problem(z, ref, n), "Z equals the whole MLP's output", f"{case}: forward"
        )
        report.add(_x_grad_problem(x_grad, ref, n), "equals one process's", f"{case}: X.grad")
        report.add(
            _gradients_problem(grads, ref, rows),
            "this rank's slices of the single-process gradients",
            f"{case}: parameter gradients",
        )
        report.add(
            _communication_problem({"forward": forward, "backward": backward}, z_bytes),
            f"one all-reduce of {z_bytes:,} B each way",
            f"{case}: communication",
        )
