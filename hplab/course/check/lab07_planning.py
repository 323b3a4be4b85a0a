"""Lab 07: the planner's first formulas (no processes: these are formulas)."""

from __future__ import annotations

import itertools
import math

from hplab import formulas
from hplab.course.check.report import Report


def check_planning(module, report: Report) -> None:
    """The learner's ZeRO memory and bubble fraction against the planner's `hplab.formulas`."""

    def memory_problem(psi, dp, zero, precision):
        mine = module.model_state_bytes_per_gpu(psi, dp, zero, precision)
        ref = formulas.model_state_bytes(psi, dp, zero, precision)
        return not math.isclose(mine, ref["total_bytes"], rel_tol=1e-9) and (
            f"Ψ={psi:g}, dp={dp}: you say {mine:,.0f} bytes, the planner {ref['total_bytes']:,.0f}"
            " = "
            + " + ".join(
                f"{ref[f'{kind}_bytes'] / psi:.4g} ({kind})"
                for kind in ("params", "grads", "optim", "master")
            )
            + " bytes per parameter"
        )

    def bubble_problem(p, m):
        mine, ref = module.bubble_fraction(p, m), formulas.bubble_fraction("1f1b", p, m)
        return not math.isclose(mine, ref, rel_tol=1e-9, abs_tol=1e-12) and (
            f"pp={p}, m={m}: you say {mine:.4g}, the bubble fraction (p−1)/(m+p−1) is {ref:.4g}"
            + " — that is the bubble ratio (p−1)/m, idle relative to the useful time; the "
            "fraction is the idle share of the whole step"
            * math.isclose(mine, formulas.bubble_ratio("1f1b", p, m))
        )

    for precision, zero in itertools.product(("fp32", "bf16"), range(4)):
        report.check(
            f"model_state_bytes_per_gpu(zero={zero}, {precision})",
            (
                memory_problem(psi, dp, zero, precision)
                for psi, dp in itertools.product((1.5e9, 175e9, 335_232), (1, 3, 8, 64))
            ),
            "equal over Ψ and dp",
        )
    report.check(
        "bubble_fraction",
        itertools.starmap(bubble_problem, itertools.product((1, 2, 4, 8), (1, 4, 8, 32))),
        "equal for pp ≤ 8, m ≤ 32",
    )
