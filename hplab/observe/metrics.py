"""The metrics file (`--metrics PATH`): what a run measured, for notebooks, tests and benchmarks.

Version 1, written by rank 0 (docs/metrics.md): `config` (every flag), `world_size`,
`backend`, `device`, `model`, `steps` (`[{step, loss, time_s, tokens, lr}]`), `eval`,
`tokens_per_s`, and per rank `memory`, `comm`, `comm_by_group`, `mesh`, with `experts`,
`pipeline` and `context_parallel` where the run has them. Keys are only ever added.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_VERSION = 1


def columns(rows: list[dict]) -> dict:
    """One dict per rank -> one list per key: [{"a": 1}, {"a": 2}] -> {"a": [1, 2]}."""
    return {key: [row[key] for row in rows] for key in rows[0]}


def is_metrics_file(path: Path) -> bool:
    try:
        return "version" in json.loads(path.read_text()) and path.suffix == ".json"
    except (ValueError, TypeError, OSError):
        return False


def collect(
    args, model, layout, backend: str, device: str, steps: list, evals: list, per_rank: list[dict]
) -> dict:
    """The metrics file of a run (rank 0), from its flags, the steps it took and every rank's
    observations (`observe.Observers.per_rank`, gathered in rank order)."""
    ranks = columns(per_rank)  # {key: [rank 0's, rank 1's, ...]}
    timed = steps[1:] or steps  # the first step pays one-time costs (allocations, warm-up)
    return {
        "version": METRICS_VERSION,
        "config": vars(args),
        "world_size": len(per_rank),
        "backend": backend,
        "device": device,
        "model": {"num_params": model.num_params(), **vars(model)},
        "steps": steps,
        "eval": evals,  # the validation loss after `step` training steps (--eval-every)
        "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["time_s"] for s in timed),
        "experts": experts(model, layout, ranks["experts"]) if model.n_experts else None,
        **{key: ranks[key] for key in ("memory", "comm", "comm_by_group", "mesh")},
        "pipeline": None
        if layout.pp == 1
        else {
            "schedule": layout.schedule,
            "stages": layout.pp,
            "microbatches": layout.microbatches,
            "virtual_stages": layout.virtual_stages,
            "receives_ahead": layout.receives_ahead,
            **columns(ranks["pipeline"]),  # the last step's trace, per rank
        },
        "context_parallel": None
        if layout.cp == 1
        else {  # per rank (lists), per step
            "cp": layout.cp,
            "style": layout.cp_style,
            "split": layout.cp_split,
            **columns(ranks["context_parallel"]),
        },
    }


def recovery(metrics: dict, first_step: int, earlier: list, saves: list) -> dict:
    """What a run spent on safety and on failures: `checkpoints`, each save's step, seconds and
    bytes; `resumed`, the step it resumed from and the losses before it (from the checkpoint);
    `restarts`, the attempts `train.py --nproc --max-restarts` lost (HPLAB_RESTARTS): why, at
    which step, after how many seconds, and the step the next resumed from."""
    restarts = json.loads(os.environ.get("HPLAB_RESTARTS") or "[]")
    resumed = {"step": first_step, "losses": earlier} if first_step else None
    return {**metrics, "checkpoints": saves, "resumed": resumed, "restarts": restarts}


def experts(model, layout, per_rank: list[list[dict]]) -> dict:
    """Per rank (its tokens), step and layer: the token-slots each expert took, those dropped,
    all slots and the balance loss."""
    keys = ("tokens_per_expert", "dropped", "slots", "aux_loss")
    by_key = {key: [[s[key] for s in per_step] for per_step in per_rank] for key in keys}
    return {"n_experts": model.n_experts, "top_k": model.moe_top_k, "ep": layout.ep, **by_key}


def write(path: str | Path, metrics: dict) -> None:
    """Write `metrics` to `path` atomically: a reader never sees half a file."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a folder, a device: never replaced
        raise ValueError(f"{path} exists and is not a file: the metrics were not written there")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(metrics, indent=1))
    os.replace(tmp, path)


def summary_table(metrics: dict) -> str:
    """The end-of-run report: loss, validation loss, throughput; per rank its mesh coordinates,
    memory by kind, and communication by dimension (dp / tp / pp / world) as calls and MiB."""
    MiB = 2**20
    steps = metrics["steps"]
    memory = metrics["memory"]
    evals = metrics.get("eval")
    mesh = metrics.get("mesh") or [{"dp_rank": 0, "tp_rank": 0, "pp_rank": 0}] * len(memory)
    where = "dp{dp_rank} tp{tp_rank} pp{pp_rank}" + (
        " cp{cp_rank}" if metrics.get("context_parallel") else ""
    )
    heads = [f"  rank {r} {where.format(**c):<15}" for r, c in enumerate(mesh)]
    n = len(steps)
    world = metrics["world_size"]
    lines = [
        f"loss {steps[0]['loss']:.4f} → {steps[-1]['loss']:.4f} over {n} step{'s' * (n != 1)}; "
        f"{metrics['tokens_per_s']:,.0f} tokens/s on {world} process{'es' * (world != 1)} "
        f"({metrics['backend']})",
        "",
        "memory per rank (MiB)   params    grads    optim   master  activ.     peak",
    ]
    if evals:  # the first and the last evaluation
        lines.insert(
            1,
            "validation loss "
            + " → ".join(
                f"{e['loss']:.4f} after {e['step']} steps" for e in evals[:1] + evals[1:][-1:]
            ),
        )
    lines += [
        head
        + "".join(
            f"{m[k + '_bytes'] / MiB:9.2f}"
            for k in ("params", "grads", "optim", "master", "activation", "peak")
        )
        for head, m in zip(heads, memory)
    ]
    by_group = metrics.get("comm_by_group") or [{"all": c} for c in metrics["comm"]]
    for family in ("dp", "cp", "dp_cp", "ep", "edp", "edp_cp", "tp", "tp_kv", "pp", "world", "all"):
        rows = [g.get(family, {}) for g in by_group]
        ops = sorted({op for row in rows for op in row})
        if ops:
            lines += [
                "",
                f"communication over {family} (calls / MiB)".ljust(25)
                + "".join(f"{op:>22}" for op in ops),
            ]
            lines += [
                head
                + " "
                + " ".join(
                    f"{c[op]['calls']:>8} / {c[op]['bytes'] / MiB:10.2f}"
                    if op in c
                    else f"{'-':>21}"
                    for op in ops
                )
                for head, c in zip(heads, rows)
            ]
    return "\n".join(lines)
