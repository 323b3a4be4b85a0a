"""ZeRO stages 1, 2 and 3 (and ZeRO-Offload), from scratch.

Data parallel keeps a full copy of everything on every rank. With Adam in mixed precision a
parameter costs 2 (bf16 param) + 2 (bf16 grad) + K = 12 (fp32 master, exp_avg, exp_avg_sq)
= 16 bytes on *each* of the N ranks, although every rank computes the same update. ZeRO
(Rajbhandari et al., 2020) removes that redundancy: each rank owns 1/N of the model states
and gets the rest from its peers only when needed. Per rank, for Ψ parameters:

    stage 0  (DDP)                     (2 + 2 + K)·Ψ
    stage 1  optimizer state sharded    2Ψ + 2Ψ + K·Ψ/N
    stage 2  + gradients sharded        2Ψ + (2 + K)·Ψ/N
    stage 3  + parameters sharded       (2 + 2 + K)·Ψ/N

(pure fp32: params 4, grads 4, K = 8 and no separate master copy.)

**Communication.** DDP all-reduces the gradients: 2(N−1)/N·Ψ elements per rank per step (a
reduce-scatter then an all-gather). ZeRO-1 and 2 do exactly those two halves, in a useful
order: *reduce-scatter* the gradients (each rank receives the sum of its own 1/N), step the
optimizer on that 1/N, *all-gather* the updated parameters — the same 2(N−1)/N·Ψ. ZeRO-3
holds no full parameters, so it all-gathers each layer before its forward and again before
its backward: 3(N−1)/N·Ψ, 1.5× DDP.

**The layout: flat units.** The parameters are grouped into *units*: one per layer the caller
names (GPT: each transformer block), plus a *root* unit with every other parameter (GPT:
embeddings, final layer norm, and the LM head tied to the embedding — a tied parameter is
one parameter and lives in one unit). A unit's parameters are laid end to end in one flat
buffer, **padded with zeros to a multiple of N elements**, so it splits into N equal shards;
rank r owns shard r of every unit. Each model parameter becomes a *view* into its unit's flat
buffer, so the model runs unchanged. So every measured byte count is the ZeRO formula with Ψ
replaced by Σ_units ceil(numel / N)·N (equal to Ψ when every unit's size is a multiple of N,
as for the `tiny` GPT on 2 or 4 ranks).

What a rank holds for each unit, by stage (all tensors below are flat 1-D):

    full        the whole unit's params (param dtype)     stages 1, 2; in stage 3 only while
                                                         the layer runs (storage freed after)
    shard       this rank's slice of the params           stage 3 (in 1/2 it is full[slice])
    grad_full   the whole unit's grads; p.grad are views  stage 1
    grad_shard  this rank's slice of the summed grads     stages 2, 3
    master      fp32 slice the optimizer updates          every stage (the shard itself when
                                                         training in fp32 on the device)

**One step** (`ZeRO.step` wires them together for a caller without a training engine):

    forward / backward      stage 3 gathers each layer on demand (hooks below); stages 2 and
                            3 reduce-scatter each unit as soon as backward has produced all
                            of its gradients, overlapping with the rest of backward
    shard_gradients()       stage 1 reduce-scatters now; → fp32 master grads (unscaled)
    optimizer.step()        on the master shards only: 1/N of the optimizer work and state
    update_params()         stages 1, 2: all-gather the new params; stage 3: keep the shard

Gradient accumulation: stage 1 accumulates into `grad_full` (no communication until the
step); stages 2 and 3 reduce-scatter after every backward and add into `grad_shard` (they hold
no full gradient to accumulate in). Clipping by global norm: each rank sums the squares of its
shard's gradients and the sums are all-reduced (the caller does this with the shard grads).

**Offload** (ZeRO-Offload): the master weights, optimizer state and the optimizer step live on
the CPU; each step copies the gradient shard there and the updated parameter shard back. On a
GPU this frees the K·Ψ/N bytes of device memory; on a CPU-only machine it runs the same copies
and gives identical results.

Any `torch.optim` optimizer works, because every rank steps a plain tensor (its master
shard). The update equals the unsharded one when the optimizer is element-wise (SGD, Adam,
AdamW: the sharded slices see exactly the numbers they would see in the whole tensor);
optimizers that look at whole tensors (LAMB, Adafactor) would need per-parameter care. A
parameter that gets no gradient in a step steps with a zero gradient (as in DDP), where a
single process would skip it: the same unless the optimizer decays weights.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn as nn

from hplab.comm import Communicator
from hplab.memory import optimizer_state_tensors


class ZeroError(ValueError):
    """A ZeRO configuration that cannot work; the message says how to fix it."""


# --- the flat unit ----------------------------------------------------------------------------

class FlatUnit:
    """A group of parameters flattened into one buffer of `padded` elements, cut into N shards
    of `shard_numel`; this rank owns elements [lo, hi)."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter],
                 comm: Communicator, stage: int, param_dtype: torch.dtype, offload: bool):
        self.name, self.module, self.params, self.comm = name, module, params, comm
        self.stage = stage
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / comm.size) * comm.size
        self.shard_numel = self.padded // comm.size
        self.lo, self.hi = comm.rank * self.shard_numel, (comm.rank + 1) * self.shard_numel
        device = params[0].device

        # The starting values, in fp32, equal on every rank (broadcast from rank 0).
        flat32 = torch.zeros(self.padded, dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            flat32[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        comm.broadcast(flat32, src=0)

        # Every parameter becomes a view into the flat, full buffer (in the param dtype).
        self.full = flat32.to(param_dtype) if param_dtype != torch.float32 else flat32
        offset = 0
        for p in params:
            p.data = self.full[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

        # Stage 3 keeps its own copy of its shard of the params (stages 1, 2: a view).
        self.shard = self.full[self.lo:self.hi].clone() if stage == 3 else self.full[self.lo:self.hi]

        # The fp32 master shard the optimizer steps. It *is* the param shard when there is
        # nothing to convert (fp32, not offloaded); otherwise a separate fp32 copy (on the CPU
        # when offloaded), made from the fp32 starting values so no precision is lost.
        separate = param_dtype != torch.float32 or offload
        optim_device = torch.device("cpu") if offload else device
        self.master = nn.Parameter(flat32[self.lo:self.hi].to(optim_device, copy=True)
                                   if separate else self.shard)
        self.master_is_shard = not separate
        del flat32

        # Stage 3 releases the full buffer's memory (its storage resized to 0 bytes) until a
        # layer needs it.
        if stage == 3:
            self.release()

        # Gradients: stage 1 keeps the full gradient (each p.grad a view into it); stages 2
        # and 3 keep only this rank's summed shard.
        if stage == 1:
            self.grad_full = torch.zeros(self.padded, dtype=param_dtype, device=device)
            self.attach_grad_views()
        else:
            self.grad_full = None
            self.grad_shard = torch.zeros(self.shard_numel, dtype=param_dtype, device=device)

        self.ready = 0  # params whose gradient backward has finished since the last send
        self.reducing = []  # (input, output, Pending) of in-flight reduce-scatters (a
        #                     pipeline runs several microbatches' backwards before waiting)
        self.gathering = None  # the in-flight all-gather (stage 3)
        self.gathered = stage != 3

    def attach_grad_views(self) -> None:
        offset = 0
        for p in self.params:
            p.grad = self.grad_full[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    # -- stage 3: gather a unit's parameters, release them --
    def start_gather(self) -> None:
        """Allocate the full buffer again and all-gather every rank's shard into it (async)."""
        if self.gathered or self.gathering is not None:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        self.gathering = self.comm.all_gather(self.full, self.shard, async_op=True)

    def wait_gather(self) -> None:
        self.start_gather()
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
        self.gathered = True

    def release(self) -> None:
        """Free the full parameters (the params' views stay, pointing at 0 bytes)."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    # -- stages 2 and 3: reduce-scatter this unit's gradients --
    def start_reduce_scatter(self) -> None:
        """Pack the params' gradients into one padded flat buffer, pre-divided by N (so the sum
        is the average), and reduce-scatter it asynchronously; drop the full gradients."""
        flat = torch.zeros(self.padded, dtype=self.grad_shard.dtype, device=self.grad_shard.device)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
            offset += p.numel()
        flat.div_(self.comm.size)
        out = torch.empty_like(self.grad_shard)
        self.reducing.append((flat, out, self.comm.reduce_scatter(out, flat, async_op=True)))
        self.ready = 0

    def finish_reduce_scatter(self) -> None:
        for flat, out, pending in self.reducing:
            pending.wait()
            self.grad_shard.add_(out)
        self.reducing = []


# --- ZeRO ---------------------------------------------------------------------------------------

class _BeforeBackward(torch.autograd.Function):
    """Identity in forward; in backward calls `callback` first — when the gradient reaches a
    layer's output, i.e. just before that layer's backward runs (stage 3 gathers there)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        ctx.set_materialize_grads(False)  # an output backward never reaches stays None
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class ZeRO:
    """Shard `module`'s training state over the ranks of `comm` (the dp group).

    `layers`: submodules forming one unit each, **in the order the forward runs them** (stage 3
    gathers one and prefetches the next); every other parameter goes to the root unit.
    `make_optimizer(params)` builds the optimizer over the master shards. `param_dtype`:
    bf16/fp16 for mixed precision (fp32 masters are kept). `offload`: optimizer on the CPU.
    The module's parameters must be equal on every rank (rank 0's are broadcast anyway).
    """

    def __init__(self, module: nn.Module, comm: Communicator, stage: int,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 layers: Iterable[nn.Module] = (), param_dtype: torch.dtype = torch.float32,
                 offload: bool = False):
        if stage not in (1, 2, 3):
            raise ZeroError(f"ZeRO stage must be 1, 2 or 3, got {stage} (stage 0 is plain DDP)")
        self.module, self.comm, self.stage = module, comm, stage
        self.param_dtype, self.offload = param_dtype, offload
        self.optim_device = torch.device("cpu") if offload else next(module.parameters()).device

        # Assign each parameter to one unit: a layer's own parameters, unless another layer
        # uses it too (tied) — then it goes to the root, which is gathered around everything.
        layers = list(layers)
        owners: dict[nn.Parameter, list[int]] = {}
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                owners.setdefault(p, []).append(i)
        groups = [[] for _ in layers]
        root = []
        for p in module.parameters():  # each (tied) parameter once, in definition order
            if not p.requires_grad:
                continue
            (groups[owners[p][0]] if len(owners.get(p, [])) == 1 else root).append(p)
        self.layers = [FlatUnit(f"layer{i}", layer, g, comm, stage, param_dtype, offload)
                       for i, (layer, g) in enumerate(zip(layers, groups)) if g]
        self.root = FlatUnit("root", module, root, comm, stage, param_dtype, offload) \
            if root else None
        self.units = ([self.root] if self.root else []) + self.layers
        self.unit_of = {p: u for u in self.units for p in u.params}
        for b in module.buffers():  # e.g. running statistics follow the params' precision
            if b.is_floating_point():
                b.data = b.data.to(param_dtype)

        self.optimizer = make_optimizer([u.master for u in self.units])
        if stage >= 2:
            for p in self.unit_of:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if stage == 3:
            self.in_backward = False
            for u in self.units:
                u.module.register_forward_pre_hook(lambda m, args, u=u: self._before_forward(u))
                u.module.register_forward_hook(
                    lambda m, args, out, u=u: self._after_forward(u, out))

    # -- stage 3: parameters gathered just in time -------------------------------------------
    def _next(self, unit: FlatUnit, step: int) -> FlatUnit | None:
        """The layer after `unit` in forward order (step=+1) or backward order (step=-1)."""
        if unit is self.root:
            index = 0 if step > 0 else len(self.layers) - 1
        else:
            index = self.layers.index(unit) + step
        return self.layers[index] if 0 <= index < len(self.layers) else None

    def _before_forward(self, unit: FlatUnit) -> None:
        if unit is self.root:
            self.in_backward = False  # a new forward pass
        unit.wait_gather()
        if not self.in_backward and (nxt := self._next(unit, +1)):
            nxt.start_gather()  # prefetch: overlaps with this layer's compute

    def _after_forward(self, unit: FlatUnit, output):
        if self.in_backward:  # recompute (activation checkpointing) inside backward: keep
            return None
        unit.release()
        if not torch.is_grad_enabled():
            return None
        # Gather again when backward reaches this layer's output.
        outputs = output if isinstance(output, tuple) else (output,)
        needs = [i for i, t in enumerate(outputs) if torch.is_tensor(t) and t.requires_grad]
        if not needs:
            return None
        wrapped = _BeforeBackward.apply(lambda: self._before_backward(unit),
                                        *[outputs[i] for i in needs])
        out = list(outputs)
        for i, t in zip(needs, wrapped):
            out[i] = t
        return tuple(out) if isinstance(output, tuple) else out[0]

    def _before_backward(self, unit: FlatUnit) -> None:
        self.in_backward = True
        unit.wait_gather()
        if nxt := self._next(unit, -1):
            nxt.start_gather()

    # -- stages 2 and 3: gradients reduce-scattered unit by unit during backward -------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        unit = self.unit_of[param]
        unit.ready += 1
        if unit.ready == len(unit.params):
            unit.start_reduce_scatter()  # (resets unit.ready: the next microbatch counts anew)
            if self.stage == 3:  # this layer's backward is over: free its parameters
                unit.release()

    def backward_done(self) -> None:
        """Call after each backward: finish this backward's reduce-scatters (a unit whose
        parameters got no gradient is sent now, as zeros) and release gathered layers."""
        if self.stage == 1:
            return
        for u in self.units:  # the same order on every rank
            if not u.reducing or u.ready > 0:  # never sent, or some gradients not yet sent
                u.start_reduce_scatter()
        for u in self.units:
            u.finish_reduce_scatter()
            if self.stage == 3 and u.gathered:
                u.release()
        self.in_backward = False

    # -- the optimizer step on the shards ------------------------------------------------------
    @torch.no_grad()
    def shard_gradients(self, unscale: float = 1.0) -> list[torch.Tensor]:
        """Give every master shard its fp32 gradient — this rank's 1/N of the averaged global
        gradient, multiplied by `unscale` (1 / loss scale) — and return them."""
        if self.stage == 1:  # reduce-scatter the accumulated full gradients now
            pending = []
            for u in self.units:
                u.grad_full.div_(self.comm.size)
                out = torch.empty(u.shard_numel, dtype=u.grad_full.dtype, device=u.grad_full.device)
                pending.append((u, out, self.comm.reduce_scatter(out, u.grad_full, async_op=True)))
            for u, out, p in pending:
                p.wait()
                u.reduced = out
        for u in self.units:
            grad = u.reduced if self.stage == 1 else u.grad_shard
            grad = grad.to(self.optim_device, torch.float32)  # no copy if it already is
            u.master.grad = grad.mul(unscale) if unscale != 1.0 else grad
            if self.stage == 1:
                u.reduced = None
        return [u.master.grad for u in self.units]

    @torch.no_grad()
    def update_params(self) -> None:
        """After `optimizer.step()`: bring the new master values into the model's params.
        Stages 1 and 2 all-gather the full params; stage 3 only updates its shard."""
        pending = []
        for u in self.units:
            if self.stage == 3:
                if not u.master_is_shard:
                    u.shard.copy_(u.master)
                continue
            mine = u.master.detach().to(u.full.device, u.full.dtype, copy=True)
            pending.append(self.comm.all_gather(u.full, mine, async_op=True))
        for p in pending:
            p.wait()

    def zero_grad(self) -> None:
        for u in self.units:
            u.master.grad = None
            if self.stage == 1:
                u.grad_full.zero_()
                u.attach_grad_views()
            else:
                u.grad_shard.zero_()
                for p in u.params:
                    p.grad = None

    def step(self, unscale: float = 1.0) -> None:
        """The whole step for a caller that does its own forward/backward: shard the
        gradients, step the optimizer, update the params, zero the gradients."""
        self.backward_done()
        self.shard_gradients(unscale)
        self.optimizer.step()
        self.update_params()
        self.zero_grad()

    # -- what this rank holds -------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """For the MemoryLedger. Storages are counted once, so a master that *is* the param
        shard counts as params, and a released stage-3 buffer (0 bytes) counts nothing."""
        units = self.units
        grads = [u.grad_full for u in units] if self.stage == 1 else \
            [u.grad_shard for u in units] + [p.grad for p in self.unit_of]
        return {"params": [u.full for u in units] + [u.shard for u in units],
                "grads": grads,
                "optim": optimizer_state_tensors(self.optimizer),
                "master": [u.master for u in units]}

    # -- unified checkpoints: every unit back in one piece, and cut again ---------------------
    def _param_slices(self, unit: FlatUnit):
        offset = 0
        for p in unit.params:
            yield p, slice(offset, offset + p.numel())
            offset += p.numel()

    @torch.no_grad()
    def _gather(self, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(unit.padded, dtype=shard.dtype, device=unit.full.device)
        self.comm.all_gather(full, shard.detach().to(unit.full.device), async_op=False)
        return full

    @torch.no_grad()
    def full_state(self) -> tuple[dict, dict]:
        """({param: full fp32 value}, {param: {state name: full tensor}}), gathered from the
        master shards and their optimizer state (a collective over the dp group)."""
        values, states = {}, {}
        for u in self.units:
            flat = self._gather(u, u.master)
            state = self.optimizer.state.get(u.master, {})
            flat_state = {k: (self._gather(u, t) if t.dim() else t) for k, t in state.items()}
            for p, where in self._param_slices(u):
                values[p] = flat[where].view(p.shape).cpu()
                states[p] = {k: (t[where].view(p.shape).cpu() if t.dim() else t.cpu())
                             for k, t in flat_state.items()}
        return values, states

    @torch.no_grad()
    def load_full_state(self, values: dict, states: dict) -> None:
        """The reverse of `full_state`: each rank keeps its shard of every unit."""
        for u in self.units:
            flat = torch.zeros(u.padded, dtype=torch.float32)
            for p, where in self._param_slices(u):
                flat[where] = values[p].reshape(-1).float().cpu()
            if self.stage == 3:
                u.shard.copy_(flat[u.lo:u.hi])
            else:
                u.full.copy_(flat)
            if not u.master_is_shard:
                u.master.copy_(flat[u.lo:u.hi])
            saved = [states[p] for p in u.params if states.get(p)]
            if saved:
                state = {}
                for k, t in saved[0].items():
                    if t.dim() == 0:  # e.g. Adam's step count, kept where the optimizer had it
                        state[k] = t.clone()
                        continue
                    flat_t = torch.zeros(u.padded, dtype=t.dtype)
                    for p, where in self._param_slices(u):
                        flat_t[where] = states[p][k].reshape(-1)
                    state[k] = flat_t[u.lo:u.hi].clone().to(u.master.device)
                self.optimizer.state[u.master] = state

    def grad_pieces(self):
        """(param, the part of its gradient inside this rank's master shard) pairs: what a
        global gradient norm needs, where parameters of different kinds share one shard."""
        for u in self.units:
            for p, where in self._param_slices(u):
                lo, hi = max(where.start, u.lo), min(where.stop, u.hi)
                if lo < hi:
                    yield p, u.master.grad[lo - u.lo:hi - u.lo]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters by name, as fp32 copies (gathers in stage 3; every
        rank gets the same). For tests, checkpoints and inspection."""
        out = {}
        for u in self.units:
            was_gathered = u.gathered
            if self.stage == 3 and not was_gathered:
                u.wait_gather()
            for name, p in self.module.named_parameters():
                if p in self.unit_of and self.unit_of[p] is u:
                    out[name] = p.detach().float().clone()
            if self.stage == 3 and not was_gathered:
                u.release()
        return out
