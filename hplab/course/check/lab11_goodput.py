"""Lab 11: goodput and the checkpoint interval (arithmetic: no processes)."""

from __future__ import annotations

import math

from hplab.course.check.report import Report, first
from hplab.plan.reliability import goodput, young_interval_s

# (interval, checkpoint, restart, MTBF) in seconds: a laptop, Llama 3's cluster, failures
# that eat everything, and a checkpoint that costs more than the interval
CASES = [
    (60.0, 1.0, 5.0, 3600.0),
    (817.0, 30.0, 60.0, 11135.0),
    (3600.0, 60.0, 600.0, 1800.0),
    (10.0, 30.0, 0.0, 86400.0),
    (1e5, 10.0, 0.0, 1e9),
]


def _goodput_hint(got: float, interval, checkpoint, restart, mtbf) -> str:
    """Name the usual slips: a whole interval lost per failure, no restart cost, no saving
    cost, or no floor at 0."""
    slips = {
        "a failure loses half an interval on average, not all of it": (
            interval / (interval + checkpoint) * (1 - (restart + interval + checkpoint) / mtbf)
        ),
        "each failure also costs the restart": goodput(interval, checkpoint, 0.0, mtbf),
        "saving stops training: multiply by τ/(τ+C)": max(
            0.0, 1 - (restart + (interval + checkpoint) / 2) / mtbf
        ),
        "goodput cannot be negative": interval
        / (interval + checkpoint)
        * (1 - (restart + (interval + checkpoint) / 2) / mtbf),
    }
    hint = next((h for h, v in slips.items() if math.isclose(got, v, rel_tol=1e-9)), "")
    return hint and f" — {hint}"


def _goodput_problem(module, case) -> str | None:
    got = float(module.goodput(*case))
    want = goodput(*case)
    if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
        return None
    where = "goodput(τ={}, C={}, R={}, MTBF={})".format(*(f"{x:g}" for x in case))
    return f"{where} = {got:.6g}, expected {want:.6g}{_goodput_hint(got, *case)}"


def _interval_problem(module, checkpoint: float, mtbf: float) -> str | None:
    got = float(module.best_interval(checkpoint, mtbf))
    want = young_interval_s(checkpoint, mtbf)
    if math.isclose(got, want, rel_tol=1e-9):
        return None
    hint = " — the factor 2: τ/(2·MTBF) is the loss" * math.isclose(
        got, math.sqrt(checkpoint * mtbf), rel_tol=1e-9
    )
    return f"best_interval(C={checkpoint:g}, MTBF={mtbf:g}) = {got:.6g}, expected {want:.6g}{hint}"


def check_goodput(module, report: Report) -> None:
    """goodput against hplab.plan.reliability's on five clusters; best_interval against Young's
    √(2·C·MTBF), and that it beats its neighbours under the learner's own goodput."""
    report.check(
        "goodput",
        (_goodput_problem(module, case) for case in CASES),
        f"{len(CASES)} clusters, from a laptop to failures that eat everything",
    )
    report.check(
        "best_interval",
        (_interval_problem(module, c, m) for _, c, _, m in CASES),
        f"Young's √(2·C·MTBF) for {len(CASES)} clusters",
    )
    with report.case("the best interval is the best"):
        c = 30.0
        r = 60.0
        m = 11135.0
        best = float(module.best_interval(c, m))
        worse = [
            f
            for f in (0.8, 1.25)
            if module.goodput(f * best, c, r, m) > module.goodput(best, c, r, m)
        ]
        report.add(
            first([worse and f"goodput at {worse[0]}× your best interval is higher"]),
            "neither 0.8× nor 1.25× it does better (C = 30 s, R = 60 s, MTBF 3.1 h)",
        )
