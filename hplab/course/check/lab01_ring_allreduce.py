"""Lab 01: ring all-reduce from send/recv (4 processes)."""

from __future__ import annotations

import torch

from hplab import formulas
from hplab.course.check.report import Report, collectives, differs, first
from hplab.dist import Mesh


def check_ring(module, report: Report, mesh: Mesh) -> None:
    """On every rank, for tensors of several shapes and dtypes: the result is the sum over the
    ranks, only send and recv were used, and each rank sent 2(n-1) chunks of S/n bytes."""
    n, r = mesh.world.size, mesh.world.rank
    for shape, dtype in [
        ((1000,), "float32"),
        ((7, 13), "float32"),
        ((3,), "float32"),
        ((64, 64), "float32"),
        ((10,), "float64"),
    ]:
        report.label = f"{'×'.join(map(str, shape))} {dtype}"  # an exception ends the file
        inputs = torch.randn(
            (n, *shape),
            dtype=getattr(torch, dtype),
            generator=torch.Generator().manual_seed(len(shape)),
        )  # [rank]
        expected, tensor = inputs.sum(0), inputs[r].clone()
        _, used = collectives(mesh, module.ring_all_reduce, tensor, mesh.world)
        others, sent = sorted(set(used) - {"send", "recv"}), used.get("send", (0, 0))[1]
        ideal = formulas.bus_factor("all_reduce", n) * tensor.nbytes  # 2(n-1)/n·S
        per_element = 2 * (n - 1) * tensor.element_size()  # chunks: ⌊S/n⌋ to ⌈S/n⌉ numbers
        report.add(
            first(
                [
                    others and f"used {', '.join(others)}: build it from send and recv only",
                    (d := differs(tensor, expected))
                    and f"the result is not the sum over the ranks: {d}",
                    not tensor.numel() // n <= sent / per_element <= -(-tensor.numel() // n)
                    and (
                        f"sent {sent:,} bytes; a ring all-reduce sends 2(n-1) chunks of S/n = "
                        f"{ideal:,.0f} bytes: one chunk per step, not the whole tensor"
                    ),
                ]
            ),
            f"sum correct, {sent:,} bytes sent (2(n-1)/n·S = {ideal:,.0f})",
        )
