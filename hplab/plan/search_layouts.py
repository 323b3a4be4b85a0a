"""Search: plan every layout of a number of GPUs, rank those that fit by step time, and say
from the numbers why the winner wins (`explain`). Sources: see `hplab.plan`."""

from __future__ import annotations

import itertools

from hplab.config import RECOMPUTE, Layout, LayoutError, ModelConfig, validate
from hplab.plan.estimate import PlanError, plan
from hplab.plan.formulas import model_state_bytes
from hplab.plan.presets import GB, GPU_PRESETS, Cluster, Efficiency, default_batch_size


def candidate_layouts(
    model: ModelConfig,
    gpus: int,
    batch_size: int,
    precision: str = "bf16",
    fixed: dict | None = None,
    allow_offload: bool = False,
    include_refused: bool = False,
):
    """Every layout of `gpus` GPUs that can run: dp·tp·pp = gpus (cp = ep = 1: the search
    splits neither sequences nor experts; plan() takes them), whole heads per tensor-
    parallel rank, a global batch that splits into whole microbatches of 1, 2, 4 or 8, and each
    ZeRO stage, recompute mode, sequence parallel and pipeline schedule (interleaved with 2 to 8
    chunks), that `config.validate` accepts: what train.py would run (`include_refused`: also
    what hplab refuses, priced all the same). `fixed` pins fields of Layout to a value or a
    tuple of allowed values (e.g. {"tp": 8, "schedule": ("1f1b", "gpipe")})."""
    fixed = {
        k: v if isinstance(v, (tuple, list, set, frozenset)) else (v,)
        for k, v in (fixed or {}).items()
    }
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, pp, b in itertools.product(divisors, divisors, (1, 2, 4, 8)):
        dp = gpus // (tp * pp)
        if gpus % (tp * pp) or model.n_head % tp or pp > model.n_layer or batch_size % (dp * b):
            continue
        m = batch_size // dp // b
        scheds = (
            [("1f1b", 1)]
            + [("gpipe", 1), ("zb-h1", 1)] * (pp > 1)
            + [
                ("interleaved", v)
                for v in (2, 3, 4, 6, 8)
                if pp > 1 and model.n_layer % (pp * v) == 0 and m % pp == 0
            ]
        )
        for (schedule, v), zero, rc, sp, off in itertools.product(
            scheds,
            (0, 1, 2, 3)[: 4 if dp > 1 else 1],
            RECOMPUTE,
            (False, True)[: 1 + (tp > 1)],
            (False, True)[: 1 + allow_offload],
        ):
            lay = Layout(
                dp=dp,
                tp=tp,
                pp=pp,
                zero=zero,
                schedule=schedule,
                virtual_stages=v,
                microbatches=m,
                batch_size=batch_size,
                precision=precision,
                recompute=rc,
                sequence_parallel=sp,
                offload=off,
            )
            if all(getattr(lay, k) in allowed for k, allowed in fixed.items()) and (
                include_refused or _runs(lay, model, gpus)
            ):
                yield lay


def _runs(layout: Layout, model: ModelConfig, gpus: int) -> bool:
    try:
        validate(layout, model, gpus)
    except LayoutError:
        return False
    return True


def search(
    model: ModelConfig,
    gpus: int,
    cluster: Cluster | None = None,
    eff: Efficiency | None = None,
    batch_size: int | None = None,
    precision: str = "bf16",
    fixed: dict | None = None,
    allow_offload: bool = False,
    include_refused: bool = False,
    tie: float = 0.02,
    comfortable_memory: float = 0.8,
) -> dict:
    """Plan every candidate layout; rank the ones that fit by step time. The planner is good
    to a few percent (tests/test_plan.py), so layouts within `tie` of the fastest count as
    equally fast. Among those the simplest wins, preferring one that leaves headroom (memory
    at most `comfortable_memory` of what is usable): fewer model-parallel ranks (the model stays
    whole on more GPUs), less ZeRO sharding, no recompute, no sequence parallel, no offload,
    the plain 1F1B schedule, bigger microbatches."""
    cluster, eff = cluster or Cluster(GPU_PRESETS["a100-80g"]), eff or Efficiency()
    batch_size = batch_size or default_batch_size(model)
    plans = [
        plan(model, lay, cluster, eff)
        for lay in candidate_layouts(
            model, gpus, batch_size, precision, fixed, allow_offload, include_refused
        )
    ]
    if not plans:
        raise PlanError(
            f"no layout of {gpus} GPUs splits a batch of {batch_size} sequences and "
            f"{model.n_head} heads evenly: change --gpus or --batch-size"
        )
    feasible = sorted((p for p in plans if p["fits"]), key=lambda p: p["step_time_s"])
    winner = _winner(feasible, tie, comfortable_memory)
    feasible.sort(key=lambda p: p is not winner)  # the winner first, the rest by time
    return {
        "model": model.name,
        "params": model.num_params(),
        "gpus": gpus,
        "gpu": cluster.gpu.name,
        "gpus_per_node": cluster.gpus_per_node,
        "batch_size": batch_size,
        "precision": precision,
        "evaluated": len(plans),
        "feasible": len(feasible),
        "winner": winner,
        "ranking": feasible,
        "explanation": explain(winner, plans, gpus, batch_size),
        "_all": plans,
    }


def simplicity(p: dict) -> tuple:
    """What the winner has least of, in this order: model-parallel ranks (the model stays
    whole on more GPUs), ZeRO sharding, recompute, sequence parallel, offload, a schedule other
    than plain 1F1B, model chunks per rank; and the most of: sequences per microbatch."""
    return (
        p["tp"] * p["pp"],
        p["zero"],
        RECOMPUTE.index(p["recompute"]),
        p["sequence_parallel"],
        p["offload"],
        p["schedule"] != "1f1b",
        p["virtual_stages"],
        -p["micro_batch_size"],
    )


def _winner(feasible: list[dict], tie: float, comfortable_memory: float) -> dict | None:
    """The simplest of the plans within `tie` of the fastest (`feasible`, sorted by time),
    among those that leave headroom if any do."""
    if not feasible:
        return None
    fastest = feasible[0]["step_time_s"]
    ties = [p for p in feasible if p["step_time_s"] <= fastest * (1 + tie)]
    roomy = [
        p
        for p in ties
        if p["memory_bytes_per_gpu"] <= comfortable_memory * p["usable_bytes_per_gpu"]
    ]
    return min(roomy or ties, key=simplicity)


TIME_PARTS = {
    "compute_s": "compute",
    "tp_comm_s": "tensor-parallel comm",
    "cp_comm_s": "context-parallel comm",
    "ep_comm_s": "expert all-to-all",
    "bubble_s": "pipeline bubble",
    "pp_comm_s": "pipeline sends",
    "dp_comm_exposed_s": "data-parallel/ZeRO comm",
    "offload_s": "offload",
}
KNOBS = {
    "zero": "ZeRO stage",
    "tp": "tensor parallel",
    "pp": "pipeline parallel",
    "recompute": "recompute",
    "sequence_parallel": "sequence parallel",
    "schedule": "schedule",
    "micro_batch_size": "micro-batch size",
}
FAMILIES = {
    "plain DDP": lambda p: p["tp"] == p["pp"] == 1 and p["zero"] == 0,
    "ZeRO only (no TP/PP)": lambda p: p["tp"] == p["pp"] == 1 and p["zero"] > 0,
    "TP + DP (no PP)": lambda p: p["tp"] > 1 and p["pp"] == 1,
    "PP + DP (no TP)": lambda p: p["pp"] > 1 and p["tp"] == 1,
    "PP + TP + DP": lambda p: p["pp"] > 1 and p["tp"] > 1,
}


def _why_slower(alt: dict, best: dict) -> str:
    if not alt["fits"]:
        return (
            f"does not fit: {alt['memory_bytes_per_gpu'] / GB:.0f} GB > "
            f"{alt['usable_bytes_per_gpu'] / GB:.0f} GB usable"
        )
    delta = alt["step_time_s"] - best["step_time_s"]
    if delta <= best["step_time_s"] * 0.005:
        return f"as fast ({alt['memory_bytes_per_gpu'] / GB:.0f} GB)"
    grew = max(TIME_PARTS, key=lambda k: alt[k] - best[k])
    return (
        f"+{delta / best['step_time_s']:.0%} ({TIME_PARTS[grew]} +{alt[grew] - best[grew]:.2g} s)"
    )


def _best(plans: list[dict]) -> dict | None:
    """The fastest that fits, else the one closest to fitting."""
    fits = [p for p in plans if p["fits"]]
    return (
        min(fits, key=lambda p: p["step_time_s"])
        if fits
        else min(plans, key=lambda p: p["memory_bytes_per_gpu"], default=None)
    )


def explain(winner: dict | None, plans: list[dict], gpus: int, batch_size: int) -> list[str]:
    """Why the winner wins, from the numbers: where its step time goes, then for each family
    and each knob the best layout with another setting and what makes it slower (or not fit).
    Without a winner: what the smallest layout would need."""
    w = winner or _best(plans)
    mem = w["memory_bytes_per_gpu"] / GB
    usable = w["usable_bytes_per_gpu"] / GB
    if winner is None:
        return [
            f"no layout fits: the smallest needs {mem:.1f} GB per GPU ({w['layout']}) but "
            f"only {usable:.1f} GB are usable; add GPUs, use a bigger GPU, or --offload"
        ]
    links = [
        f"{g} group {'crosses nodes' if w[f'{g}_crosses_nodes'] else 'stays in a node'}"
        for g in ("tp", "dp", "pp")
        if w[g] > 1
    ]
    lines = [
        f"winner: {w['layout']}: {w['step_time_s']:.3g} s/step, {w['tflops_per_gpu']:.0f} "
        f"TFLOP/s per GPU, MFU {w['mfu']:.0%}, {mem:.1f} GB of {usable:.0f} GB usable",
        "  step = "
        + ", ".join(f"{name} {w[k]:.3g} s" for k, name in TIME_PARTS.items() if w[k] > 0),
    ]
    lines += ["  " + "; ".join(links)] * bool(links) + ["best of each family:"]
    for name, member in FAMILIES.items():
        best = _best([p for p in plans if member(p)])
        if best is not None:
            tag = "winner" if best["layout"] == w["layout"] else _why_slower(best, w)
            lines.append(f"  {name:22s} {best['layout']:44s} {tag}")
        elif name == "plain DDP":
            states = model_state_bytes(w["params"], gpus, 0, w["precision"])["total_bytes"]
            lines.append(
                f"  {name:22s} dp={gpus} cannot split the batch of {batch_size}; "
                f"its model states alone would need {states / GB:.0f} GB per GPU"
            )
    lines.append("changing one choice of the winner (the rest kept where possible):")
    for knob, name in KNOBS.items():
        alts = [
            f"{val}: {_why_slower(_best(_neighbours(w, plans, knob, val)), w)}"
            for val in sorted({p[knob] for p in plans})
            if val != w[knob]
        ]
        lines += [f"  {name} = {w[knob]}: " + "; ".join(alts)] * bool(alts)
    return lines


def _neighbours(w: dict, plans: list[dict], knob: str, value) -> list[dict]:
    """Plans with `knob` = value that keep the most of the winner's other choices (dp and the
    number of microbatches follow from tp, pp and the micro-batch size)."""
    keys = [k for k in (*KNOBS, "virtual_stages", "offload") if k != knob]
    changed = {id(p): sum(p[k] != w[k] for k in keys) for p in plans if p[knob] == value}
    fewest = min(changed.values(), default=0)
    return [p for p in plans if changed.get(id(p)) == fewest]
