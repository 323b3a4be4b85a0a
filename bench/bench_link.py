"""DDP's buckets on an emulated link: the best bucket size against one bucket, 2 ranks.

    python bench/bench_link.py           # tiny; at --seq-len 512; 16 deep; bench/results/link.json
    python bench/bench_link.py --quick   # fewer steps
    python bench/bench_link.py --machine 'h100-80g node=1'   # at H100s' balance, across nodes

`--machine` sweeps at a real machine's balance (`hplab.runtime.balance`) instead of a calibrated
link: each rank a node of its own, data parallel's ring on the network cards, α and β the data
sheet's scaled by this machine's FLOP/s over the GPU's. There every bucket pays the machine's
2α, so a fourth setting joins the three: a model wide enough that its gradients dwarf α·β.

Issue 25's targets, under a link where communication is comparable to compute: the best bucket
size's tokens/s ≥ 1.3× one bucket's, and ≥ 50% of the all-reduce's time on the link hidden
behind backward. Per setting, one launch of `hplab/course/bucket_sweep.py` (one DDP model per
bucket size, stepped in turn, so the machine's load falls on every size alike):

1. **Calibrate**, with no link: one bucket's compute and backward's window W (its first
   gradient → its last). The link's β is then chosen so that the gradients backward produces
   during W — all but the tied embedding's (= the LM head), complete only when backward
   ends — take W on it: β = (S − S_tied) / W, the most the window can hide
   (`bucket_sweep.calibrated_link`); α is `--alpha`.
2. **Sweep** under that link, from a bucket per parameter to one bucket: the median step and
   tokens/s of each size; then two steps of the fastest size traced, and the share of the
   link's all-reduce time hidden behind backward (`timeline.hidden_fraction`, mean of ranks).

What no bucket size can hide bounds the gain (`formulas.ddp_bucket_speedup_bound`):

    best / one bucket  ≤  (C + X) / (C + max(X_tied, X − W))

with C the step's compute and W the window, both measured under the link with one bucket, X the
gradients' time on the link (two ranks' ring: 2α + S/β) and X_tied the tied embedding's
(S_tied/β). The benchmark prints and records the measured ratio beside this bound and says
whether the targets were met. The second setting, sequences of 512 tokens instead of 64, is
the same model with a longer context (the blocks' attention grows, the LM head does not):
labelled as such, it never replaces the first. The third is `tiny` 16 layers deep: its tied
embedding is 14% of the gradient bytes instead of 39%, so far more of them can hide under
backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hplab.course.bucket_sweep import sweep  # noqa: E402
from hplab.plan import formulas  # noqa: E402
from hplab.runtime.link import parse, parse_wire  # noqa: E402

SIZES = [0, 0.02, 0.05, 0.1, 0.15, 0.25, 0.5, 25]  # MiB: per parameter ... one bucket
SETTINGS = {  # name: model overrides and global batch (sequences)
    "tiny": dict(batch_size=32),
    "tiny, sequences of 512 tokens": dict(seq_len=512, batch_size=8),
    "tiny, 16 layers": dict(n_layer=16, batch_size=32),
}
TARGET_RATIO, TARGET_HIDDEN = 1.3, 0.5
# At a real machine's balance a bucket's 2α is the machine's (scaled): a model must carry
# gradients far above α·β (0.6 MB a ring step on H100s' cards) for buckets to pay. This one,
# 8 layers 512 wide (26M parameters, 105 MB of gradients, the tied embedding 4% of them), does;
# its buckets are sized for it, from 1 MiB up to one bucket.
WIDE = dict(n_layer=8, n_embd=512, batch_size=32, bucket_mb=[1, 4, 16, 400])
MACHINE_SETTINGS = {**SETTINGS, "8 layers 512 wide (26M parameters)": WIDE}


def measure(name: str, flags: dict, alpha: float, steps: int, machine: str | None) -> dict:
    """One setting, one launch: calibrate with no link, sweep under the link it picks (or at
    `machine`'s balance, no calibration), trace the fastest size."""
    from hplab.course.timeline import hidden_fraction, read_timeline

    flags = dict(flags)
    sizes = flags.pop("bucket_mb", SIZES)
    with tempfile.TemporaryDirectory(prefix="hplab-bench-link-") as trace:
        run = sweep(
            link=machine or f"auto,{alpha * 1e6:g}us",
            bucket_mb=sizes,
            steps=steps,
            no_link_too=not machine,
            trace=trace,
            progress=False,
            **flags,
        )
        hidden = [hidden_fraction(s, ops=("all_reduce",)) for s in read_timeline(trace)]
    link = run.data["config"]["link"]
    beta, alpha = ring_link(run, alpha)
    S, S_tied = run.data["gradient_bytes"], run.data["tied_bytes"]
    seq, batch = run.data["config"]["seq_len"], flags["batch_size"]
    step_s = run.median("step_s")
    rows = [
        dict(
            bucket_mb=mb,
            buckets=len(run.buckets(mb)),
            step_ms=1e3 * s,
            exposed_ms=1e3 * e,
            tokens_per_s=batch * seq / s,
        )
        for mb, s, e in zip(sizes, step_s, run.median("exposed_s"))
    ]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    one = rows[-1]
    C, W = run.median("compute_s")[-1], run.median("window_s")[-1]
    X = formulas.collective_time_s("all_reduce", S, 2, beta, alpha)
    X_tied = S_tied / beta
    ratio = best["tokens_per_s"] / one["tokens_per_s"]
    return dict(
        setting=name,
        seq_len=seq,
        global_batch=batch,
        link=link,
        gradient_bytes=S,
        link_balance=run.data.get("link_balance"),
        calibration=None
        if machine
        else dict(
            compute_ms=1e3 * run.median("compute_s", "none")[-1],
            window_ms=1e3 * run.median("window_s", "none")[-1],
            gradient_bytes=S,
            tied_bytes=S_tied,
            beta="(gradient bytes − tied bytes) / window, no link, one bucket",
        ),
        no_link_tokens_per_s=None
        if machine
        else [batch * seq / s for s in run.median("step_s", "none")],
        comm_over_compute=X / C,
        sizes=rows,
        best_bucket_mb=best["bucket_mb"],
        best_over_one_bucket=ratio,
        hidden_fraction_per_rank=hidden,
        hidden_fraction=statistics.mean(hidden),
        bound=dict(
            formula="(C + X) / (C + max(X_tied, X − W))",
            C_ms=1e3 * C,
            W_ms=1e3 * W,
            X_ms=1e3 * X,
            X_tied_ms=1e3 * X_tied,
            value=formulas.ddp_bucket_speedup_bound(C, W, X, X_tied),
        ),
        ratio_target_met=ratio >= TARGET_RATIO,
        hidden_target_met=statistics.mean(hidden) >= TARGET_HIDDEN,
    )


def ring_link(run, alpha: float) -> tuple[float, float]:
    """β and α of the links the 2 ranks' ring crosses: the calibrated link's, or those a
    machine's balance gave (its cards' when each rank is a node of its own)."""
    if not (balance := run.data.get("link_balance")):
        return parse(run.data["config"]["link"]).bandwidth, alpha
    network = parse_wire(balance["network"])
    tier = network.between if network.between is not None and network.node < 2 else network.inside
    return tier.bandwidth, tier.latency


def report(r: dict) -> None:
    """The setting's table and verdict on stdout."""
    b = r["bound"]
    print(f"\n### {r['setting']}: 2 ranks, global batch {r['global_batch']} × {r['seq_len']}")
    if r["calibration"] is None:
        balance = r["link_balance"]
        where = f"at the {balance['machine']}'s balance (r = {balance['scale']:.3g})"
        print(f"link {balance['network']} {where}")
    else:
        c = r["calibration"]
        print(
            f"link {r['link']} (β from calibration: no link, one bucket, compute "
            f"{c['compute_ms']:.1f} ms, window {c['window_ms']:.1f} ms);"
        )
    print(f"gradients on the link / compute = {r['comm_over_compute']:.2f}\n")
    print("| bucket MiB | buckets | step ms (median) | exposed ms | tokens/s |")
    print("|---|---|---|---|---|")
    for s in r["sizes"]:
        print(
            f"| {s['bucket_mb']:g} | {s['buckets']} | {s['step_ms']:.1f} | "
            f"{s['exposed_ms']:.1f} | {s['tokens_per_s']:,.0f} |"
        )

    def verdict(met):
        return "met" if met else "NOT met"

    print(
        f"\nbest ({r['best_bucket_mb']:g} MiB) / one bucket: {r['best_over_one_bucket']:.2f}× "
        f"(target ≥ {TARGET_RATIO}: {verdict(r['ratio_target_met'])}); bound {b['formula']} = "
        f"({b['C_ms']:.1f} + {b['X_ms']:.1f}) / ({b['C_ms']:.1f} + max({b['X_tied_ms']:.1f}, "
        f"{b['X_ms']:.1f} − {b['W_ms']:.1f})) = {b['value']:.2f}×"
    )
    print(
        f"all-reduce hidden behind backward ({r['best_bucket_mb']:g} MiB): "
        + ", ".join(f"{h:.0%}" for h in r["hidden_fraction_per_rank"])
        + f" (mean {r['hidden_fraction']:.0%}; target ≥ {TARGET_HIDDEN:.0%}: "
        f"{verdict(r['hidden_target_met'])})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per bucket size")
    p.add_argument("--alpha", type=float, default=0.5e-3, help="the link's α, seconds")
    p.add_argument("--quick", action="store_true", help="4 steps per size")
    p.add_argument(
        "--machine",
        help="sweep at a machine's balance instead of a calibrated link, e.g. 'h100-80g node=1' "
        "(each rank a node: data parallel across nodes); results in link_MACHINE.json",
    )
    p.add_argument("--results", help="default: bench/results/link.json (link_MACHINE.json)")
    args = p.parse_args()
    steps = 4 if args.quick else args.steps
    named = "_" + "_".join(args.machine.split()) if args.machine else ""
    args.results = args.results or str(ROOT / "bench" / "results" / f"link{named}.json")
    rows = []
    for name, flags in (MACHINE_SETTINGS if args.machine else SETTINGS).items():
        rows.append(measure(name, flags, args.alpha, steps, args.machine))
        report(rows[-1])
    machine = f" --machine '{args.machine}'" if args.machine else ""
    results = {
        "benchmark": "DDP buckets on an emulated link: best bucket size vs one bucket",
        "command": "python bench/bench_link.py" + " --quick" * args.quick + machine,
        "targets": dict(best_over_one_bucket=TARGET_RATIO, hidden_fraction=TARGET_HIDDEN),
        "steps_timed": steps,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores",
        "rows": rows,
    }
    Path(args.results).write_text(json.dumps(results, indent=1))
    print(f"\nwritten to {args.results}")


if __name__ == "__main__":
    main()
