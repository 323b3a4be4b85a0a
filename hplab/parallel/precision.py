"""Mixed precision: compute in bf16 / fp16, keep the weights that learn in fp32.

Half-precision numbers (2 bytes) halve the memory of parameters, gradients and activations and
run matrix multiplies several times faster on GPUs. But a step's `lr · update` is often smaller
than the gap between neighbouring half-precision numbers (bf16 keeps 8 significant bits: the
number after 1 is 1 + 2⁻⁷): added to a bf16 weight it rounds away, and the model stops learning.

The recipe (Micikevicius et al., 2018), used by every large training run:

1. **Master weights.** The optimizer owns fp32 copies of the parameters and fp32 state (Adam:
   exp_avg, exp_avg_sq); the model holds bf16/fp16 copies.
2. **Forward and backward in half precision**: params, activations, gradients.
3. **Step in fp32**: gradients upcast, the optimizer updates the masters, which are rounded
   into the model's half-precision copy.

Bytes per parameter, as the ZeRO paper counts them for Adam: 2 (params) + 2 (grads) + K, with
K = 12 of fp32 "optimizer state" (master, exp_avg, exp_avg_sq): 16, as in pure fp32 (4 + 4 + 8).
Mixed precision alone saves activation memory and time, not model-state memory; ZeRO shards K.

**fp16 needs a loss scaler.** With 5 exponent bits, gradients under ~6e-8 underflow to zero.
Multiplying the loss by a large S scales every gradient by S (backward is linear); the step
divides by S again in fp32. Too large an S overflows to inf: the step is skipped and S halved;
after a run of good steps S doubles (a *dynamic* scaler). bf16 has fp32's 8 exponent bits.

`MixedPrecision` holds the choice and the scaler; `MasterWeightOptimizer` steps fp32 copies for
a strategy that keeps whole parameters (data parallel); ZeRO shards its masters (zero.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from hplab.parallel import placement
from hplab.parallel.optim import WrappedOptimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """Loss scale S for fp16: skip the step and halve S when a gradient is inf/nan; double S
    after `growth_interval` good steps in a row. The start, 2¹⁶, is PyTorch's GradScaler's and
    DeepSpeed's; a small model's first steps may overflow and be skipped while S finds its level.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.good_steps = 0  # steps without overflow since S last changed
        self.skipped_steps = 0  # total, for the summary

    def update(self, found_inf: bool) -> None:
        self.good_steps = 0 if found_inf else self.good_steps + 1
        if found_inf:
            self.scale *= 0.5
            self.skipped_steps += 1
        elif self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2.0, 0


class MixedPrecision:
    """The precision of a run: `param_dtype` for model params, grads and activations (fp32
    master weights whenever it is not fp32), and a loss scaler for fp16."""

    def __init__(self, name: str = "fp32"):
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}: choose fp32, bf16 or fp16")
        self.name = name
        self.param_dtype = DTYPES[name]
        self.mixed = name != "fp32"  # master weights needed
        self.compute_dtype = self.param_dtype if self.mixed else None  # for fully_shard
        self.scaler = DynamicLossScaler() if name == "fp16" else None

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 unless fp16)."""
        return self.scaler.scale if self.scaler else 1.0

    def found_overflow(self, grads: Iterable[torch.Tensor | None], comm=None) -> bool:
        """fp16 only: did any rank's (scaled) gradients overflow? All ranks of `comm` must
        agree, since they skip the step together; a rank holding a shard checks only its own
        shard, so the verdict is reduced (max) over the group."""
        if self.scaler is None:
            return False
        finite = [torch.isfinite(g).all() for g in grads if g is not None]
        local = float(not torch.stack(finite).all()) if finite else 0.0  # (one host sync)
        if comm is not None:
            local = comm.all_reduce_scalar(local, op=torch.distributed.ReduceOp.MAX)
        return local > 0

    def update(self, found_inf: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(found_inf)


class MasterWeightOptimizer(WrappedOptimizer):
    """Any torch optimizer, stepping fp32 master copies of half-precision parameters:
    `MasterWeightOptimizer(params, torch.optim.AdamW, lr=...)`. Each step puts the gradients on
    the masters in fp32 (`sync_gradients`, unless the caller did first, e.g. to unscale or clip
    them), steps them with `self.inner` (its param groups mirror these, extra keys included) and
    rounds the new values into the parameters. The fp32 gradients exist only during the step.
    """

    def __init__(self, params, optimizer_class, **optimizer_kwargs):
        super().__init__(params, optimizer_kwargs)
        self.masters = {
            p: nn.Parameter(p.detach().float().clone())
            for g in self.param_groups
            for p in g["params"]
        }
        for p, master in self.masters.items():
            placement.derive(p, master)  # a master lives where its parameter does
        masters = [
            {**g, "params": [self.masters[p] for p in g["params"]]} for g in self.param_groups
        ]
        self.wrap(optimizer_class, masters, **optimizer_kwargs)

    def _sync_gradients(self) -> None:
        """Every master's `.grad` := its parameter's gradient in fp32; None if it got none, so
        `inner` skips it, as torch's optimizers skip a parameter without a gradient."""
        for p, master in self.masters.items():
            master.grad = None if p.grad is None else p.grad.float()

    def _write_back(self) -> None:
        for p, master in self.masters.items():
            p.copy_(master)
            master.grad = None

    def _zero_stepped_grads(self) -> None:
        for master in self.masters.values():
            master.grad = None
