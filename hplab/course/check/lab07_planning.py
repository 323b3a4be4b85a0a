"""Lab 07: the planner's first formulas (no processes: these are formulas)."""

from __future__ import annotations

import itertools
import math

from hplab.course.check.report import Report
from hplab.plan import formulas

#: Each kind of model state: what the lab calls it, and the ZeRO stage that starts sharding it.
KINDS = {
    "params": ("the parameters", 3),
    "grads": ("the gradients", 2),
    "optim": ("Adam's two moments", 1),
    "master": ("the fp32 master weights", 1),
}


def which_kind(mine: float, psi: float, dp: int, zero: int, precision: str) -> str:
    """' — ...' naming the one kind whose bytes would make the planner's total equal `mine`:
    sharded where the stage does not shard it (or the reverse), or left out; else ''."""
    ref = formulas.model_state_bytes(psi, dp, zero, precision)
    whole = formulas.model_state_bytes(psi, 1, 0, precision)
    for kind, (name, stage) in KINDS.items():
        full = whole[f"{kind}_bytes"]
        now = ref[f"{kind}_bytes"]
        per = f"{full / psi:g} B per parameter"
        other = full if zero >= stage else full / dp  # this kind sharded the other way
        rest = ref["total_bytes"] - now
        if dp > 1 and math.isclose(mine, rest + other, rel_tol=1e-9):
            return (
                f" — {name} ({per}) are not divided by dp: ZeRO-{stage} and up shard them"
                if zero >= stage
                else f" — {name} ({per}) are divided by dp: only ZeRO-{stage} and up shard them"
            )
        if full and math.isclose(mine, rest, rel_tol=1e-9):
            return f" — {name} ({per}) are missing: {precision} training keeps them"
    return ""


def check_planning(module, report: Report) -> None:
    """The learner's ZeRO memory and bubble fraction against the planner's `hplab.plan.formulas`."""

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
            + which_kind(mine, psi, dp, zero, precision)
        )

    def bubble_problem(p, m):
        mine = module.bubble_fraction(p, m)
        ref = formulas.bubble_fraction("1f1b", p, m)
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
