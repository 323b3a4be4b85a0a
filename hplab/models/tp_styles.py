"""Styles the models' tensor-parallel plans share, beside the layers of hplab/parallel/tp.py.

A plan maps module names to styles: a callable (module, comm, sequence_parallel) that returns
the module taking its place, or changes it in place. tp.py's layers are the styles that cut
weights; these are the ones that fix what the cut leaves (a count of heads), and the plan of a
mixture of experts derived from a dense one.
"""

from __future__ import annotations

from hplab.parallel import placement
from hplab.parallel.tp import ReplicatedSequence


def divide(*names: str):
    """A fix: counts of what is now split (heads, widths) become this rank's share."""

    def style(module, comm, sequence_parallel=False):
        for name in names:
            setattr(module, name, getattr(module, name) // comm.size)
        return module

    return style


def experts_see_every_token(moe, comm, sequence_parallel=False):
    """Under sequence parallel a mixture of experts routes all s tokens on every rank (gathered
    first; this rank keeps its s/T of the output): its gradients are whole (Replicate)."""
    if sequence_parallel:
        moe.register_forward_pre_hook(lambda _, a: (ReplicatedSequence.apply(a[0], comm, True),))
        moe.register_forward_hook(lambda _, a, out: ReplicatedSequence.apply(out, comm, False))
        for p in moe.parameters():
            placement.update(p, tp_grad=placement.Replicate())
    return moe


def with_experts(plan: dict, blocks: str) -> dict:
    """`plan` where each `blocks.*.mlp` is a mixture of experts: every expert's MLP cut as the
    dense one, without sequence parallel inside (the layer sees every token)."""

    def each(cut):
        return lambda m, c, _: cut(m, c, False)

    return {
        p.replace(".mlp.", ".mlp.experts.*."): each(cut) if ".mlp." in p else cut
        for p, cut in plan.items()
    } | {f"{blocks}.*.mlp": experts_see_every_token}
