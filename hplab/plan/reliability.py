"""How often to save a checkpoint, and what failures cost: Young's interval and goodput.

A cluster of N GPUs, each failing on its own once every M₁ hours on average, fails once every
M = M₁ / N (its mean time between failures, MTBF). A checkpoint stops training for C seconds;
a failure costs R seconds to restart (notice it, stop and start every process, load the
checkpoint) and the training since the last checkpoint, on average half an interval. Saving
after every τ seconds of training, the share of wall-clock time that trains (the *goodput*) is,
to first order in 1/M:

    goodput(τ) = τ / (τ + C) · (1 − (R + (τ + C) / 2) / M)

Too short an interval spends the time saving, too long a one re-trains it after each failure;
the best is Young's τ ≈ √(2·C·M) (Young 1974; Daly 2006 refines it when C is not small
beside M). Meta's Llama 3 report counts 419 unexpected interruptions in 54 days of training
on 16,384 GPUs: M₁ ≈ 50,700 hours per GPU, M ≈ 3.1 hours for the cluster. Torch-free.
"""

from __future__ import annotations

import math

#: hours between failures of one GPU (and its share of host, network, ...), from Llama 3 405B
LLAMA3_GPU_MTBF_H = 16384 * 54 * 24 / 419
INTERVAL_FACTORS = (0.25, 0.5, 1, 2, 4)  # the table around Young's interval


def cluster_mtbf_s(gpus: int, gpu_mtbf_h: float = LLAMA3_GPU_MTBF_H) -> float:
    """Seconds between failures of a cluster of `gpus` GPUs that fail independently."""
    return gpu_mtbf_h * 3600 / gpus


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """The interval between checkpoints that maximises goodput, to first order: √(2·C·M)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of wall-clock time spent training (the formula above; 0 when failures eat it
    all)."""
    lost = (restart_s + (interval_s + checkpoint_s) / 2) / mtbf_s
    return max(0.0, interval_s / (interval_s + checkpoint_s) * (1 - lost))


def checkpoint_plan(
    gpus: int, checkpoint_s: float, restart_s: float, gpu_mtbf_h: float = LLAMA3_GPU_MTBF_H
) -> dict:
    """The cluster's MTBF, Young's interval and its goodput, and goodput at intervals around
    it (`INTERVAL_FACTORS`)."""
    mtbf = cluster_mtbf_s(gpus, gpu_mtbf_h)
    best = young_interval_s(checkpoint_s, mtbf)
    return {
        "gpus": gpus,
        "gpu_mtbf_hours": gpu_mtbf_h,
        "checkpoint_s": checkpoint_s,
        "restart_s": restart_s,
        "cluster_mtbf_s": mtbf,
        "failures_per_day": 86400 / mtbf,
        "interval_s": best,
        "goodput": goodput(best, checkpoint_s, restart_s, mtbf),
        "by_interval": [
            {"interval_s": f * best, "goodput": goodput(f * best, checkpoint_s, restart_s, mtbf)}
            for f in INTERVAL_FACTORS
        ],
    }


def format_checkpoint_plan(p: dict) -> str:
    hours = p["cluster_mtbf_s"] / 3600
    out = [
        f"{p['gpus']:,} GPUs, each failing once every {p['gpu_mtbf_hours']:,.0f} h: the cluster "
        f"fails every {hours:.3g} h ({p['failures_per_day']:.3g} a day)",
        f"a checkpoint stops training {p['checkpoint_s']:g} s, a restart costs "
        f"{p['restart_s']:g} s and half an interval of training",
        f"save every √(2·C·MTBF) = {p['interval_s'] / 60:.3g} min of training (Young): "
        f"goodput {p['goodput']:.1%}",
        "  interval      goodput   τ/(τ+C)·(1 − (R + (τ+C)/2)/MTBF)",
    ]
    for row in p["by_interval"]:
        out.append(f"  {row['interval_s'] / 60:8.3g} min   {row['goodput']:7.1%}")
    return "\n".join(out)
