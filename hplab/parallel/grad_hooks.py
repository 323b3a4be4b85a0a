"""Hooks on a parameter's gradient that follow it to the tensor computing in its place.

Tensor parallel sums some gradients over the ranks that each computed a part of them, in
backward, with a hook on the parameter (`tp.sum_gradient_in_backward`). fully_shard computes
with a full-size parameter of its own, gathered from the shards, so a hook left on the original
would never run; it takes the original's hooks along (`carry`). The original is left as it was:
the user's reference to it stays readable.
"""

from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

_HOOKS = WeakIdKeyDictionary()  # parameter → the hooks `add` put on its gradient


def add(p, hook) -> None:
    """`p.register_hook(hook)`, remembered so that a stand-in for `p` can have it too."""
    p.register_hook(hook)
    _HOOKS.setdefault(p, []).append(hook)


def carry(source, target) -> None:
    """`target` computes in place of `source`: give it `source`'s gradient hooks."""
    for hook in _HOOKS.get(source, []):
        add(target, hook)
