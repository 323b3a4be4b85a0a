"""Optimizers that step other tensors than the model's parameters.

Mixed precision steps fp32 *master* copies of half-precision parameters
(`precision.MasterWeightOptimizer`); ZeRO-1/2 steps this rank's fp32 *shard* of each bucket
(`zero.ZeroOptimizer`). Each is a torch `Optimizer` over the model's parameters — so an lr
scheduler, `zero_grad()` and the loop's `step()` work as with any optimizer — that hands the
arithmetic to `self.inner`, an ordinary torch optimizer (AdamW, SGD, ...) over the tensors it
really steps. `WrappedOptimizer` is what the two share:

    sync_gradients()   the stepped tensors' fp32 `.grad` (ZeRO: reduce-scattered shards),
                         once per step; a loop may call it first to unscale or clip there
    step()               sync_gradients(), this optimizer's hyperparameters (a scheduled lr)
                         handed to `inner`, `inner.step()`, then the new values written back
    stepped_groups       `inner`'s param groups: what the global-norm clip and the checkpoint
                         read, with the same extra keys (`tied`) as these (where each
                         tensor lives is its placement record: hplab/parallel/placement.py)
"""

from __future__ import annotations

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch Optimizer over the model's parameters whose `inner` optimizer steps other
    tensors (masters, shards). Subclasses build `inner` with `wrap` and say how gradients
    reach the stepped tensors (`_sync_gradients`) and new values the parameters (`_write_back`).
    """

    def wrap(self, optimizer_class, stepped_groups: list[dict], **optimizer_kwargs) -> None:
        """`inner` := optimizer_class over `stepped_groups` (one per param group, same keys);
        its defaults show in these param groups too."""
        self.inner = optimizer_class(stepped_groups, **optimizer_kwargs)
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in inner.items():
                group.setdefault(key, value)
        self.synced = False  # sync_gradients has run for this step

    @property
    def stepped_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Every stepped tensor's fp32 `.grad` from the parameters' gradients (once a step)."""
        if not self.synced:
            self._sync_gradients()
            self.synced = True

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.sync_gradients()
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({k: v for k, v in group.items() if k != "params"})  # e.g. a new lr
        self._step_inner()
        self._write_back()
        self.synced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the parameters' own .grad
        self._zero_stepped_grads()
        self.synced = False

    def _sync_gradients(self) -> None:
        raise NotImplementedError

    def _step_inner(self) -> None:
        self.inner.step()

    def _write_back(self) -> None:
        raise NotImplementedError

    def _zero_stepped_grads(self) -> None:
        raise NotImplementedError


def stepped_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups of the tensors `optimizer` really steps (masters, shards, or its own)."""
    if isinstance(optimizer, WrappedOptimizer):
        return optimizer.stepped_groups
    return optimizer.param_groups
