"""Lab 05: the 1F1B action order (simulated: a schedule is data)."""

from __future__ import annotations

from collections import Counter

from hplab.course.check.report import Report, first
from hplab.parallel import schedule
from hplab.plan.simulate import DeadlockError, simulate


def _one_f_one_b_problem(module, p: int, m: int) -> str | None:
    where = f"p={p}, m={m}"
    mine = module.one_f_one_b(p, m)
    if not isinstance(mine, (list, tuple)) or len(mine) != p:
        return f"{where}: expected a list of {p} per-rank orders, got {mine!r:.80}"
    orders = [[(*a, r) for a in mine[r]] for r in range(p)]  # (kind, microbatch, chunk r)
    reference = schedule.one_f_one_b_order(p, m)
    for r, (order, work) in enumerate(zip(orders, map(Counter, reference))):
        wrong = {"missing": work - Counter(order), "extra": Counter(order) - work}  # or unknown
        if any(wrong.values()):
            return (
                f"{where}, rank {r}: every rank runs F and B of each microbatch exactly "
                "once;"
                + "".join(f" {k} {sorted(a[:2] for a in v)[:4]}" for k, v in wrong.items() if v)
            )
    try:
        run = simulate(schedule.add_communication(orders, p, 1), f=1, b=1, w=0)
    except DeadlockError as err:
        return f"{where}: {err}"
    best = simulate(schedule.add_communication(reference, p, 1), f=1, b=1, w=0)
    held = [run.in_flight_max(r) for r in range(p)]
    limit = [min(p - r, m) for r in range(p)]
    warm = [next((k for k, a in enumerate(o) if a[0] == "B"), m) for o in orders]
    counts = (
        f" — forwards before the first backward: {warm}, 1F1B {limit} (p-1-r warm-up "
        "forwards and one more)"
    ) * (warm != limit)
    return first(
        [
            run.makespan > best.makespan
            and f"{where}: the step takes {run.makespan:g} time units, "
            f"1F1B {best.makespan:g} (= 2(m+p-1)): too few forwards in flight"
            + counts,
            held != limit
            and f"{where}: ranks hold at most {held} microbatches' activations, 1F1B "
            f"{limit} (min(p-r, m)) — too many forwards before their backwards: warm up with p-1-r",
            *(
                f"{where}, rank {r}: action {k} is {a[0]}{a[1]}, 1F1B runs {b[0]}{b[1]} (same step "
                "time and memory, another order)"
                for r in range(p)
                for k, (a, b) in enumerate(zip(orders[r], reference[r]))
                if a != b
            ),
        ]
    )


def check_one_f_one_b(module, report: Report) -> None:
    """The orders, run by `hplab.plan.simulate.simulate` with their sends and receives, against
    1F1B over (p, m): the work once, no deadlock, step 2(m+p-1), min(p-r, m) held, 1F1B's order."""
    for name, ps in (("p=2", (2,)), ("p=3, 4", (3, 4)), ("p=8", (8,))):
        report.check(
            name,
            (_one_f_one_b_problem(module, p, m) for p in ps for m in (1, 2, 3, 4, 8, 12)),
            "as 1F1B for m ≤ 12: step 2(m+p-1), rank r holds min(p-r, m)",
        )
