"""Two lessons about time on the emulated wire, 2 ranks, each run several times (labs 04, 05).

    python bench/bench_wire_lessons.py          # bench/results/wire_lessons.json, a table
    python bench/bench_wire_lessons.py --quick  # one repeat
    python bench/bench_wire_lessons.py --machine h100-80g   # both at an H100's balance

1. **The pipeline's four schedules** (p = 2, m = 4, 7 layers; tiny at h = 128 on lab 05's
   old link 50MB/s,100us, or at h = 256 at a machine's balance, as lab 05 now runs; receives
   posted a computation ahead): each schedule's measured bubble (the median of each rank's
   steps after the first, mean of the ranks), beside the schedule simulated with the run's
   own median F, B, W and every message c = α + n/β
   (`viz.replayed_bubbles(run, latency=c)`: the formula with the link's message time added)
   and the textbook formula. Issue 37's targets: ranked as the formulas rank them (ZB-H1 <
   interleaved < 1F1B ≤ GPipe) and each within 20% of its simulated bubble.
2. **Tensor parallel's tiers** (tp = 2, tiny): the same run with both ranks inside one node
   and across nodes of a two-tier wire, and under a free wire (β = 1 PB/s, α = 0:
   the wire's own costs, no transfer time) for C. Target: across ÷ inside within 20% of
   (C + X_across) ÷ (C + X_inside), X = calls·2α + S/β on each tier (`collective_time_s`).

Every number is what this machine measured in this run, or the formula named beside it. On
two shared cores each message also costs host time (a send's launch, a wait), which no
formula here counts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hplab import lab, viz  # noqa: E402
from hplab.plan import formulas  # noqa: E402
from hplab.runtime.link import parse_wire  # noqa: E402

PIPELINE_LINK = "50MB/s,100us"
PIPELINE_MODEL = dict(n_layer=7, n_embd=128, batch_size=16, microbatches=4, steps=6)
# At a machine's balance one message costs the machine's α, scaled (about 4 ms here for an
# H100's 5 µs inside a node): a stage must compute far longer than that per microbatch, or
# every schedule is latency-bound. 256 wide, a stage's F takes about 25 ms on one core.
MACHINE_PIPELINE_MODEL = {**PIPELINE_MODEL, "n_embd": 256}
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved": {"virtual_stages": 2}, "zb-h1": {}}
TIERS = "inside=200MB/s,20us between=20MB/s,200us"
PLACED = {"inside": f"node=2 {TIERS}", "across": f"node=1 {TIERS}"}
FREE = "node=1 inside=1000GB/s,0us between=1000GB/s,0us"
TARGET = 0.2


def pipeline_row(name: str, link: str = PIPELINE_LINK, model: dict = PIPELINE_MODEL) -> dict:
    """One run of schedule `name` under the link: measured, simulated with c, formula."""
    run = lab.train(
        nproc=2, pp=2, dp=1, schedule=name, link=link, progress=False,
        **model, **SCHEDULES[name],
    )  # fmt: skip
    c = viz.message_seconds(run)
    v = run.metrics["pipeline"]["virtual_stages"]
    return dict(
        measured=statistics.mean(viz.measured_bubbles(run)),
        with_messages=statistics.mean(viz.replayed_bubbles(run, latency=c)),
        formula=formulas.bubble_fraction(name, 2, model["microbatches"], v),
        message_ms=1e3 * c,
    )


def step_s(run) -> float:
    return statistics.median(step["time_s"] for step in run.metrics["steps"][1:])


def tp_row(placed: dict = PLACED) -> dict:
    """The tp = 2 run inside a node, across nodes, and on a free wire (C)."""
    runs = {
        where: lab.train(nproc=2, tp=2, dp=1, steps=6, batch_size=8, link=net, progress=False)
        for where, net in {**placed, "free": FREE}.items()
    }
    steps = len(runs["inside"].losses)
    calls = runs["inside"].comm_bytes("all_reduce", key="calls") / steps
    payload = runs["inside"].comm_bytes("all_reduce") / steps
    wire = {where: parse_wire(viz.wire_of(runs[where])) for where in placed}  # (a machine's too)
    tier = {"inside": wire["inside"].inside, "across": wire["across"].between}
    X = {
        where: formulas.collective_time_s(
            "all_reduce", payload, 2, link.bandwidth, link.latency, calls=calls
        )
        for where, link in tier.items()
    }
    C = step_s(runs["free"])
    measured = step_s(runs["across"]) / step_s(runs["inside"])
    formula = (C + X["across"]) / (C + X["inside"])
    return dict(
        C_ms=1e3 * C,
        step_ms={where: 1e3 * step_s(runs[where]) for where in placed},
        wire={where: str(network) for where, network in wire.items()},
        link_ms={where: 1e3 * x for where, x in X.items()},
        across_over_inside=measured,
        formula="(C + X_across) / (C + X_inside)",
        formula_value=formula,
        within_target=abs(measured / formula - 1) <= TARGET,
    )


def in_formula_order(bubble: dict) -> bool:
    """ZB-H1 < interleaved < 1F1B ≤ GPipe, as the formulas rank them (1F1B and GPipe equal)."""
    return bubble["zb-h1"] < bubble["interleaved"] < bubble["1f1b"] <= bubble["gpipe"]


def summarize(
    pipeline: list[dict], tp: list[dict], link=PIPELINE_LINK, placed=PLACED, model=PIPELINE_MODEL
) -> dict:
    """Medians over the repeats, and whether each target holds."""
    schedules = {
        name: {
            key: statistics.median(run[name][key] for run in pipeline)
            for key in ("measured", "with_messages", "formula", "message_ms")
        }
        for name in SCHEDULES
    }
    for row in schedules.values():
        row["measured_over_with_messages"] = row["measured"] / row["with_messages"]
        row["within_target"] = abs(row["measured_over_with_messages"] - 1) <= TARGET
    by_formula = ["zb-h1", "interleaved", "1f1b", "gpipe"]
    measured = sorted(schedules, key=lambda name: schedules[name]["measured"])
    ratios = [row["across_over_inside"] / row["formula_value"] for row in tp]
    return dict(
        pipeline=dict(
            link=link,
            model=model,
            schedules=schedules,
            ranked_by_measurement=measured,
            ranked_by_formula=by_formula,
            ranking_met=in_formula_order({n: row["measured"] for n, row in schedules.items()}),
            repeats=pipeline,
        ),
        tensor_parallel=dict(
            wire=placed,
            measured_over_formula=statistics.median(ratios),
            within_target=abs(statistics.median(ratios) - 1) <= TARGET,
            repeats=tp,
        ),
    )


def table(summary: dict) -> str:
    p = summary["pipeline"]
    lines = [
        f"pipeline, p = 2, m = 4, link {p['link']}, {p['model']['n_layer']} layers "
        f"{p['model']['n_embd']} wide (median of repeats)",
        f"{'schedule':<12}{'formula':>8}{'+ messages':>12}{'measured':>10}{'÷':>6}",
    ]
    for name, row in p["schedules"].items():
        lines.append(
            f"{name:<12}{row['formula']:>8.0%}{row['with_messages']:>12.0%}"
            f"{row['measured']:>10.0%}{row['measured_over_with_messages']:>6.2f}"
            f"{'' if row['within_target'] else '  (target ±20%: NOT met)'}"
        )
    lines.append(
        "least idle first: " + " < ".join(p["ranked_by_measurement"])
        + f"  (formula's order: {' < '.join(p['ranked_by_formula'])};"
        f" {'met' if p['ranking_met'] else 'NOT met'})"
    )  # fmt: skip
    t = summary["tensor_parallel"]
    for row in t["repeats"]:
        lines.append(
            f"tp = 2: across ÷ inside measured {row['across_over_inside']:.2f}, "
            f"{row['formula']} = {row['formula_value']:.2f} (C = {row['C_ms']:.1f} ms)"
        )
    lines.append(
        f"tp = 2: measured ÷ formula, median {t['measured_over_formula']:.2f} "
        f"(target ±20%: {'met' if t['within_target'] else 'NOT met'})"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat instead of three")
    parser.add_argument(
        "--machine",
        help="both lessons at a machine's balance instead, e.g. h100-80g: the pipeline inside "
        "one node, tensor parallel in nodes of 2 and of 1; results in wire_lessons_MACHINE.json",
    )
    parser.add_argument("--out", help="default: bench/results/wire_lessons[_MACHINE].json")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    link, placed, model = PIPELINE_LINK, PLACED, PIPELINE_MODEL
    if args.machine:
        link, model = args.machine, MACHINE_PIPELINE_MODEL
        placed = {"inside": f"{args.machine} node=2", "across": f"{args.machine} node=1"}
    named = f"_{args.machine}" if args.machine else ""
    args.out = args.out or str(ROOT / "bench" / "results" / f"wire_lessons{named}.json")
    pipeline = [
        {name: pipeline_row(name, link, model) for name in SCHEDULES} for _ in range(repeats)
    ]
    tp = [tp_row(placed) for _ in range(repeats)]
    summary = dict(
        benchmark=__doc__.split("\n")[0],
        command="python bench/bench_wire_lessons.py" + (f" --machine {args.machine}" * bool(named)),
        date=datetime.date.today().isoformat(),
        machine="2 CPU cores",
        **summarize(pipeline, tp, link, placed, model),
    )
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
