"""The metrics file (`--metrics PATH`): what a run measured, for notebooks, tests and benchmarks.

Version 1, written by rank 0 (README, "The metrics file"): `config` (every flag), `world_size`,
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


def write(path: str | Path, metrics: dict) -> None:
    """Write `metrics` to `path` atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(metrics, indent=1))
    os.replace(tmp, path)


def summary_table(metrics: dict) -> str:
    """The end-of-run report: loss, validation loss, throughput; per rank its mesh coordinates,
    memory by kind, and communication by dimension (dp / tp / pp / world) as calls and MiB."""
    MiB, steps, memory, evals = 2**20, metrics["steps"], metrics["memory"], metrics.get("eval")
    mesh = metrics.get("mesh") or [{"dp_rank": 0, "tp_rank": 0, "pp_rank": 0}] * len(memory)
    where = "dp{dp_rank} tp{tp_rank} pp{pp_rank}" + (
        " cp{cp_rank}" if metrics.get("context_parallel") else ""
    )
    heads = [f"  rank {r} {where.format(**c):<15}" for r, c in enumerate(mesh)]
    lines = [
        f"loss {steps[0]['loss']:.4f} → {steps[-1]['loss']:.4f} over {len(steps)} steps; "
        f"{metrics['tokens_per_s']:,.0f} tokens/s on {metrics['world_size']} processes "
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
    for family in ("dp", "cp", "ep", "edp", "tp", "pp", "world", "all"):
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
