"""ZeRO-3 / fully sharded data parallel (FSDP), from scratch: `hplab.fully_shard`.

Data parallel keeps the whole training state on every rank. With Adam in mixed precision one
parameter costs 2 bytes (half-precision weight) + 2 (its gradient) + K = 12 (fp32 master,
exp_avg, exp_avg_sq) = 16 bytes on *each* of the N ranks, although they all hold the same
numbers. ZeRO stage 3 (Rajbhandari et al., 2020), which PyTorch calls FSDP, keeps only 1/N of
each on a rank and borrows the rest from the peers for the moment it is needed:

    per rank, Ψ parameters     DDP (2 + 2 + K)·Ψ        ZeRO-3 / FSDP (2 + 2 + K)·Ψ / N

(pure fp32: 4 + 4 + 8 bytes and no separate master.) The price is communication. Per step each
rank moves 3·(N−1)/N·Ψ elements, 1.5× DDP's all-reduce:

    forward     all-gather each layer's parameters just before it runs, free them after
    backward    all-gather them again just before the layer's backward (they were freed)
    gradients   reduce-scatter: each rank receives the average of its own 1/N only

Prefetch hides most of it: while layer i computes, layer i+1's all-gather is already in
flight (in backward, layer i−1's). At any moment a rank holds its shards plus one or two
whole layers: the peak is Ψ/N + (a layer or two), not Ψ.

**Per-parameter shards, as in FSDP2.** `fully_shard(block)` cuts every parameter of the block
along dim 0 into N chunks (dim 0 padded with zeros up to a multiple of N); rank r owns chunk r.
The module's registered Parameter is *replaced* by that chunk, under the same name, in fp32, so
`model.parameters()` is what this rank owns and an ordinary optimizer steps only its shard:

    for block in model.transformer.h:
        fully_shard(block)                  # one unit per block: gathered together
    fully_shard(model)                      # the root: everything not yet in a unit
    opt = torch.optim.AdamW(model.parameters())
    loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()

PyTorch's FSDP2 does exactly this with each shard a `DTensor` (a tensor that knows it is
`Shard(0)` of a mesh); here a shard is a plain tensor and the few facts needed to undo the cut
(full shape, padding, its unit) sit beside it. A tied parameter (GPT's wte = lm_head) is one
Parameter: it goes to the outermost unit that holds it. Frozen parameters are sharded too (as in
FSDP2): they are gathered like the others and simply get no gradient.

**One unit, one message.** A unit's all-gather sends the concatenation of this rank's shards
(one message, not one per parameter); every rank receives the N concatenations and copies each
parameter's N chunks into its full-size buffer, which the module then uses (it is swapped in by
a forward-pre hook and swapped out by a forward hook). After forward the buffers' storage is
resized to 0 bytes: the tensors saved for backward still point at them, and the gather before
backward refills the same storage. Backward accumulates gradients into the full parameters;
when a unit has all its gradients (post-accumulate-grad hooks) they are packed the same way —
rank-major, each parameter's chunk r in row r — pre-divided by N and reduce-scattered
asynchronously; the result is *added* into each shard's fp32 `.grad` (so several backwards
accumulate, and any `zero_grad()` works). The first hook of a backward queues a callback that
autograd runs when backward ends: it sends what is left, waits for every reduce-scatter and
frees whatever is still gathered, so when `loss.backward()` returns every owned parameter's
`.grad` is the averaged gradient, shaped like the shard. A parameter that got no gradient keeps
`.grad` as it was (None), like one process and like FSDP2 — which, like FSDP2, assumes every
rank uses the same parameters in a step.

**Mixed precision** (`param_dtype=torch.bfloat16`/`float16`): shards are cast before they are
gathered, so the gather, the forward, the backward and the reduce-scatter all run in half
precision while the fp32 shards the optimizer steps are the master weights (no second copy).
Floating-point inputs of a unit are cast to `param_dtype` (FSDP2's default). **Offload**
(`offload=True`): the shards, their gradients and so the optimizer live in CPU memory; gathers
copy to the compute device. On a CPU-only machine it runs the same steps with identical results.

**Recompute.** With activation checkpointing a block's forward runs again inside backward: the
hooks see that a backward is in progress and only swap the (already gathered) parameters in
and out, without freeing them or hooking the output again.

The ranks hold one model between them: each chunk has exactly one owner, so no broadcast is
needed at wrap time (each rank takes its chunk from its own copy; seed them alike, as for
torch's `fully_shard`). Buffers stay replicated.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hplab.comm import communicator, copy_markers


class _BeforeBackward(torch.autograd.Function):
    """Identity in forward; in backward calls `callback` first — when the gradient reaches a
    unit's output, i.e. just before that unit's backward runs (it gathers there)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _Param:
    """One managed parameter: its owned shard (fp32 Parameter, registered in the module), its
    full-size Parameter for compute (storage freed between uses) and where it is registered."""

    def __init__(self, p: nn.Parameter, places, comm, dtype, device, shard_device):
        self.shape = p.shape
        full = p.detach().reshape(p.shape if p.dim() else (1,))
        n, self.d0, self.rest = comm.size, full.shape[0], full.shape[1:]
        self.rows = math.ceil(self.d0 / n)
        padded = torch.zeros((n * self.rows, *self.rest), dtype=torch.float32, device=full.device)
        padded[:self.d0] = full
        mine = padded[comm.rank * self.rows:(comm.rank + 1) * self.rows]
        self.shard = nn.Parameter(mine.to(shard_device, copy=True), requires_grad=p.requires_grad)
        copy_markers(p, self.shard)
        self.shard.dp_sharded = True
        self.buffer = torch.empty((n * self.rows, *self.rest), dtype=dtype, device=device)
        self.full = nn.Parameter(self.buffer[:self.d0].view(p.shape), requires_grad=p.requires_grad)
        self.buffer.untyped_storage().resize_(0)
        self.places = places  # [(module, attribute name)], two or more for a tied parameter
        self.numel = self.shard.numel()


class _Unit:
    """The parameters one `fully_shard` call manages: gathered, freed and reduced together."""

    def __init__(self, module: nn.Module, comm, param_dtype, offload: bool):
        self.module, self.comm = module, comm
        places: dict[nn.Parameter, list] = {}
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is not None and not is_shard(p):
                    places.setdefault(p, []).append((mod, name))
        first = next(iter(places), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.dtype = param_dtype or (first.dtype if first is not None else torch.float32)
        self.param_dtype = param_dtype
        shard_device = torch.device("cpu") if offload else self.device
        self.params = [_Param(p, where, comm, self.dtype, self.device, shard_device)
                       for p, where in places.items()]
        for i, e in enumerate(self.params):
            e.shard._fsdp = (self, i)
            self._swap(e, e.shard)
            if e.full.requires_grad:
                e.full.register_post_accumulate_grad_hook(self._on_grad)
        self.trainable = sum(e.full.requires_grad for e in self.params)
        self.family: _Family = _Family([self])
        self.gathering, self.gathered, self.ready, self.reducing = None, False, 0, []
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    @staticmethod
    def _swap(e: _Param, tensor: nn.Parameter) -> None:
        for mod, name in e.places:
            mod._parameters[name] = tensor

    # -- parameters: gather, free ---------------------------------------------------------
    @torch.no_grad()
    def start_gather(self) -> None:
        """All-gather every rank's shards of this unit, concatenated: one message (async)."""
        if self.gathered or self.gathering is not None or not self.params:
            return
        send = torch.cat([e.shard.detach().reshape(-1) for e in self.params])
        send = send.to(self.device, self.dtype)
        out = torch.empty(send.numel() * self.comm.size, dtype=self.dtype, device=self.device)
        self.gathering = (out, send, self.comm.all_gather(out, send, async_op=True))

    @torch.no_grad()
    def wait_gather(self) -> None:
        self.start_gather()
        if self.gathering is None:
            return
        out, _, pending = self.gathering
        pending.wait()
        rows, offset = out.view(self.comm.size, -1), 0
        for e in self.params:
            e.buffer.untyped_storage().resize_(e.buffer.numel() * e.buffer.element_size())
            # `.data`: a write autograd does not version, so tensors saved for backward stay valid
            e.buffer.data.view(self.comm.size, -1).copy_(rows[:, offset:offset + e.numel])
            offset += e.numel
        self.gathering, self.gathered = None, True

    def release(self) -> None:
        if self.gathering is not None:  # a prefetch never used: finish the collective first
            self.gathering[2].wait()
            self.gathering = None
        for e in self.params:
            self._swap(e, e.shard)  # (a recompute stopped early may have left `full` in place)
            e.buffer.untyped_storage().resize_(0)
        self.gathered = False

    # -- gradients: reduce-scatter, add into the shards' .grad ---------------------------------
    @torch.no_grad()
    def reduce(self) -> None:
        """Pack the full gradients rank-major (chunk r of every parameter in row r), divide by
        N and reduce-scatter them asynchronously; drop the full gradients."""
        self.ready = 0
        with_grad = [e for e in self.params if e.full.grad is not None]
        if not with_grad:
            return
        n, rows = self.comm.size, []
        for e in with_grad:
            padded = e.full.grad.new_zeros((n * e.rows, *e.rest))
            padded[:e.d0] = e.full.grad.reshape(padded[:e.d0].shape)
            rows.append(padded.view(n, -1))
            e.full.grad = None
        flat = torch.cat(rows, dim=1).div_(n)
        out = flat.new_empty(flat.shape[1])
        self.reducing.append((with_grad, flat, out,
                              self.comm.reduce_scatter(out, flat.view(-1), async_op=True)))

    @torch.no_grad()
    def finish_reduce(self) -> None:
        for with_grad, _, out, pending in self.reducing:
            pending.wait()
            for e, piece in zip(with_grad, out.split([e.numel for e in with_grad])):
                g = piece.view(e.shard.shape).to(e.shard.device, torch.float32, copy=True)
                if e.shard.grad is None:
                    e.shard.grad = g
                else:
                    e.shard.grad.add_(g)
        self.reducing = []

    # -- the hooks --------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        family = self.family
        if not family.in_backward:
            family.record(self, family.forward_order)
        self.wait_gather()
        for e in self.params:
            self._swap(e, e.full)
        if not family.in_backward and (nxt := family.after(self, family.forward_order)):
            nxt.start_gather()  # prefetch: overlaps with this unit's compute
        if self.param_dtype is None:
            return None
        cast = lambda t: t.to(self.param_dtype) \
            if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tree_map(cast, (args, kwargs))

    def _post_forward(self, module, args, output):
        if self.family.in_backward:  # recompute inside backward: keep the parameters gathered
            for e in self.params:
                self._swap(e, e.shard)
            return None
        self.family.record(self, self.family.done_order)
        self.release()  # (swaps the shards back in)
        if not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten(output)
        needs = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
        if not needs:
            return None
        wrapped = _BeforeBackward.apply(self._before_backward, *[leaves[i] for i in needs])
        for i, t in zip(needs, wrapped):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _before_backward(self) -> None:
        family = self.family
        family.start_backward()
        self.wait_gather()
        if nxt := family.after(self, family.done_order[::-1]):
            nxt.start_gather()

    def _on_grad(self, param: nn.Parameter) -> None:
        self.family.start_backward()
        self.ready += 1
        if self.ready == self.trainable:  # this unit's backward is over
            self.reduce()
            self.release()


class _Family:
    """The units of one model (a root and the units inside it): the order the first forward
    ran them in (for prefetch), and the end-of-backward work they share."""

    def __init__(self, units: list[_Unit]):
        self.units = units
        self.forward_order: list[_Unit] = []  # pre-forward order: prefetch in forward
        self.done_order: list[_Unit] = []  # post-forward order, reversed: prefetch in backward
        self.in_backward = False
        self.callback_queued = False

    @staticmethod
    def record(unit: _Unit, order: list) -> None:
        if unit not in order:
            order.append(unit)

    @staticmethod
    def after(unit: _Unit, order: list) -> _Unit | None:
        i = order.index(unit) + 1 if unit in order else len(order)
        return order[i] if i < len(order) else None

    def start_backward(self) -> None:
        self.in_backward = True
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """Send the units whose gradients did not all arrive, wait for every reduce-scatter,
        free whatever is still gathered. Runs at the end of each backward; harmless again."""
        for u in self.units:  # the same order on every rank
            if u.ready > 0:
                u.reduce()
        for u in self.units:
            u.finish_reduce()
            u.release()
        self.in_backward = self.callback_queued = False


# --- the API ------------------------------------------------------------------------------

def fully_shard(module: nn.Module, group=None, param_dtype: torch.dtype | None = None,
                offload: bool = False) -> nn.Module:
    """Shard the parameters of `module` not already managed by an inner `fully_shard` call
    over `group` (a torch ProcessGroup, an hplab Communicator or None for the world), and hook
    its forward to gather them just in time. Call it on the blocks first, then on the root.
    Returns `module`, whose parameters are now this rank's fp32 shards."""
    unit = _Unit(module, communicator(group, "dp"), param_dtype, offload)
    inner = [m._hplab_fsdp for m in module.modules() if hasattr(m, "_hplab_fsdp")]
    units = [unit] + [u for f in dict.fromkeys(i.family for i in inner) for u in f.units]
    family = _Family(units)
    for u in units:
        u.family = family
    module._hplab_fsdp = unit
    return module


def is_shard(p) -> bool:
    """Whether `p` is a parameter shard owned by a `fully_shard` unit."""
    return getattr(p, "_fsdp", None) is not None


@torch.no_grad()
def gather_full(shard_param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor (on the CPU, unpadded, original shape) of `tensor`, which is shaped like
    the owned shard `shard_param` (the shard itself, or optimizer state such as exp_avg).
    A collective over the unit's group: every rank calls it, every rank gets the result."""
    if tensor.dim() == 0:  # e.g. Adam's step count: the same on every rank
        return tensor.detach().cpu().clone()
    unit, i = shard_param._fsdp
    e, comm = unit.params[i], unit.comm
    send = tensor.detach().to(comm.device).contiguous()
    out = send.new_empty((comm.size * e.rows, *e.rest))
    comm.all_gather(out, send)
    return out[:e.d0].reshape(e.shape).cpu()


@torch.no_grad()
def local_shard(shard_param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` (a tensor shaped like the unsharded parameter), padded and
    placed like `shard_param`: the inverse of `gather_full`."""
    unit, i = shard_param._fsdp
    e, comm = unit.params[i], unit.comm
    padded = full.new_zeros((comm.size * e.rows, *e.rest))
    padded[:e.d0] = full.reshape(padded[:e.d0].shape)
    return padded[comm.rank * e.rows:(comm.rank + 1) * e.rows].to(shard_param.device).clone()


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor on the CPU} for every parameter of `module`, named as in the
    single-device model (a tied parameter once, under its first name). A collective: every
    rank calls it (outside forward/backward) and every rank gets the whole model."""
    return {name: (gather_full(p, p) if is_shard(p) else p.detach().cpu().clone()).float()
            for name, p in module.named_parameters()}


def finish_gradient_sync(module: nn.Module) -> None:
    """Wait for the pending reduce-scatters of the units in `module`: an explicit point for
    callers that want one (the end of backward already does it; calling again does nothing)."""
    families = dict.fromkeys(m._hplab_fsdp.family for m in module.modules()
                             if hasattr(m, "_hplab_fsdp"))
    for family in families:
        family.finish()


def memory_tensors(module: nn.Module) -> dict[str, list[torch.Tensor]]:
    """What `module` holds on this rank, for `hplab.memory`: owned shards, buffers and any
    full-size parameters currently gathered (0 bytes between uses); the shards' gradients.
    "master" is empty: with `param_dtype` the fp32 shards *are* the master weights (counted as
    params); "optim" is the caller's (`hplab.memory.optimizer_state_tensors(optimizer)`)."""
    params = list(module.parameters())
    gathered = [e.buffer for m in module.modules() if hasattr(m, "_hplab_fsdp")
                for e in m._hplab_fsdp.params]
    return {"params": params + list(module.buffers()) + gathered,
            "grads": [p.grad for p in params], "optim": [], "master": []}
