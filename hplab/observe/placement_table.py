"""Where a model's parameters live on this rank, as a table a learner reads:

    print(hplab.placement(model))

One row per parameter: its name, its shape here and in the whole model, and its placement
along dp, cp and tp in DTensor's short names (S(dim): a slice along dim, R: a replica; a
gradient that is still a part of the whole, P) or ZeRO's Flat(1/n); then what DTensor has no
word for (shared K/V heads, ZeRO's flat shards of the optimizer state, experts, the
pipeline's tied copies, no weight decay, which wrapper averages the gradient). It reads the
records of hplab/parallel/placement.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hplab.parallel.placement import of


def _also(record) -> str:
    """What DTensor's placements do not say, in a few words."""
    notes = []
    if record.kv_replicas > 1:
        notes.append(f"K/V on {record.kv_replicas} ranks")
    if record.zero is not None:
        notes.append(f"ZeRO {record.zero} over {record.zero.over}")
    if record.expert:
        notes.append("expert: E/ep here, R over edp")
    if record.pipeline_ends:
        notes.append("tied: a copy on the first and last stage, grad P over the two")
    if record.no_decay:
        notes.append("no decay")
    if record.synced_by:
        notes.append(f"synced by {record.synced_by}")
    return ", ".join(notes)


def _row(name: str, p: torch.Tensor) -> list[str]:
    record = of(p)
    dp = str(record.dp)  # DTensor's short names: S(0), R; ZeRO's Flat(1/n)
    cp = dp if "cp" in record.sharded_over.split("_") else "R"  # (a shard over dp × cp)
    tp = str(record.tp)
    if {"tp", "tp_kv"} & set(record.partial_grad_over):
        tp += " (grad P)"
    whole = record.global_shape or tuple(p.shape)
    return [name, str(tuple(p.shape)), str(tuple(whole)), dp, cp, tp, _also(record)]


class PlacementTable:
    """Every parameter of a model on this rank: its name, its shape here and in the whole
    model, and where it lives along dp, cp and tp (DTensor's S(dim), R, P; ZeRO's Flat)."""

    HEADER = ["name", "shape here", "global shape", "dp", "cp", "tp", "also"]

    def __init__(self, model: nn.Module):
        self.rows = [_row(name, p) for name, p in model.named_parameters()]

    def __str__(self) -> str:
        rows = [self.HEADER, *self.rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.HEADER))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        note = "(a pipeline stage holds its own layers: no parameter is cut over pp)"
        return "\n".join([line.rstrip() for line in lines] + [note])

    __repr__ = __str__


def placement(model: nn.Module) -> PlacementTable:
    """The table of where `model`'s parameters live on this rank: `print(hplab.placement(m))`."""
    return PlacementTable(model)
