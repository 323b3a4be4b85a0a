"""ZeRO-3 / fully sharded data parallel (FSDP), from scratch: `hplab.fully_shard`.

ZeRO stage 3 (Rajbhandari et al., 2020), PyTorch's FSDP, keeps 1/N of the parameters, the
gradients and the optimizer state on each of the N ranks, (2 + 2 + K)·Ψ/N bytes instead of
DDP's (2 + 2 + K)·Ψ (the table in `hplab/parallel/zero.py`), and borrows the rest from the peers for
the moment it is needed. Forward all-gathers each layer's parameters just before it runs and
frees them after; backward gathers them again; the gradients are reduce-scattered (each rank
receives the average of its own 1/N): 3·(N−1)/N·Ψ elements per rank per step, 1.5× DDP's
all-reduce. Prefetch hides most of it: while layer i computes, layer i+1's all-gather is in
flight (in backward, layer i−1's). A rank holds its shards plus a layer or two, not Ψ.
By default a unit prefetches the unit that ran after it in the first forward (in backward: the
one before it). FSDP2's `set_modules_to_forward_prefetch([...])` and
`set_modules_to_backward_prefetch([...])` replace that with an explicit list; `[]` gathers each
unit only when it is about to run, so the rank waits out each of those gathers.

**Per-parameter shards, as in FSDP2.** `fully_shard(block)` cuts every parameter of the block
along dim 0 into N chunks (dim 0 zero-padded to a multiple of N); rank r owns chunk r. The
module's registered Parameter is *replaced* by that chunk, under the same name, in fp32, so
`model.parameters()` is what this rank owns and an ordinary optimizer steps only its shard:

    for block in model.transformer.h:
        fully_shard(block)                  # one unit per block: gathered together
    fully_shard(model)                      # the root: everything not yet in a unit
    opt = torch.optim.AdamW(model.parameters())
    loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()

As FSDP2 does, `fully_shard` turns the module into an `FSDPModule` (its class becomes a
subclass of both: a GPT is now an `FSDPGPT`), which adds the methods that steer it:
`set_requires_gradient_sync`, `set_modules_to_forward_prefetch`, `set_modules_to_backward_prefetch`.

FSDP2 makes each shard a `DTensor` (`Shard(0)` of a mesh); here it is a plain tensor whose
placement record says `Shard(0)` over the group (hplab/parallel/placement.py). A tied
parameter (GPT's wte = lm_head) goes to the outermost unit that holds it. Frozen parameters
are sharded and gathered too, without grads.

**One unit, one message.** A unit's all-gather sends the concatenation of this rank's shards;
every rank copies each parameter's N chunks into its full-size buffer, which a forward-pre hook
swaps into the module (a forward hook swaps the shards back). After forward the buffers' storage
is resized to 0 bytes (tensors saved for backward still point at it; the gather before backward
refills it). When a unit has all its gradients (post-accumulate-grad hooks) they are packed the
same way (chunk r of every parameter in row r), pre-divided by N, reduce-scattered asynchronously
and *added* into each shard's fp32 `.grad` (so backwards accumulate and any `zero_grad()` works).
A callback at the end of backward sends what is left, waits for every reduce-scatter and frees
what is still gathered, so each owned `.grad` is averaged when `loss.backward()` returns. Like
FSDP2, every rank must use the same parameters in a step (unused ones keep `.grad` None).

**Gradient accumulation.** `model.set_requires_gradient_sync(False)` (FSDP2's, like DDP's
`no_sync`): backward keeps each unit's full-size gradients on this rank, summed over the
microbatches, and reduce-scatters nothing; the first backward after
`set_requires_gradient_sync(True)` reduce-scatters their sum: one reduce-scatter per step, not
one per microbatch, for a full gradient's memory in between.

**Keeping the gathered parameters** (`reshard_after_forward=False`): a unit's full-size
parameters stay gathered from its forward to its backward, so backward gathers nothing for it
(one all-gather per step instead of two, ZeRO-2's traffic for that unit, at the memory of its
full parameters in between); a forward without grad still frees them.

**Mixed precision** (`mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)`, torch's
own dataclass): shards are cast before they are gathered, so gather, forward, backward and
reduce-scatter run in half precision (in `reduce_dtype` if it is set) while the fp32 shards are
the master weights (no second copy); a unit's floating-point inputs are cast to `param_dtype`
unless `cast_forward_inputs=False`. **Offload** (`offload_policy=CPUOffloadPolicy()`): shards,
gradients and so the optimizer live on the CPU; gathers copy to the compute device (memory is
not pinned). **Recompute**: a block's forward that runs again inside backward only swaps the
(already gathered) parameters in and out.

No broadcast at wrap time: each chunk has one owner, taken from that rank's copy (seed the
ranks alike, as for torch's `fully_shard`). Buffers stay replicated.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from hplab.parallel import grad_hooks, placement
from hplab.parallel.collectives import communicator
from hplab.parallel.sync import claim_gradient_sync

_MANAGED = WeakIdKeyDictionary()  # an owned shard → its _Param (how to gather it, cut it again)


class _Param:
    """One managed parameter: its owned shard (fp32 Parameter, registered in the module), its
    full-size Parameter for compute (storage freed between uses; it carries the original's
    gradient hooks) and where it is registered."""

    def __init__(self, p: nn.Parameter, places, comm, dtype, device, shard_device):
        self.shape = p.shape
        self.comm = comm
        self.d0, *self.rest = p.shape if p.dim() else (1,)
        self.rows = math.ceil(self.d0 / comm.size)
        mine = self.mine(p.detach().float())
        self.shard = nn.Parameter(mine.to(shard_device, copy=True), requires_grad=p.requires_grad)
        placement.derive(p, self.shard, dp=placement.Shard(0), sharded_over=comm.name)
        _MANAGED[self.shard] = self  # (`is_shard`, `managed`)
        self.buffer = torch.empty((comm.size * self.rows, *self.rest), dtype=dtype, device=device)
        self.full = nn.Parameter(
            self.buffer[: self.d0].view(p.shape), requires_grad=p.requires_grad
        )
        if self.full.requires_grad:
            grad_hooks.carry(p, self.full)  # (tensor parallel's sums run on what computes)
        self.buffer.untyped_storage().resize_(0)
        self.places = places  # [(module, attribute name)], two or more for a tied parameter

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """`full` (shaped like the parameter), dim 0 zero-padded to N·rows: chunk r is rank r's."""
        padded = full.new_zeros((self.comm.size * self.rows, *self.rest))
        padded[: self.d0] = full.reshape(padded[: self.d0].shape)
        return padded

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        return self.pad(full).chunk(self.comm.size)[self.comm.rank]


class _Unit:
    """The parameters one `fully_shard` call manages: gathered, freed and reduced together."""

    def __init__(self, module: nn.Module, comm, mp_policy, offload: bool, reshard: bool):
        self.module = module
        self.comm = comm
        self.reshard_after_forward = reshard
        self.cast_forward_inputs = mp_policy.cast_forward_inputs
        self.reduce_dtype = mp_policy.reduce_dtype  # None: the gradients' own (param_dtype)
        self.requires_gradient_sync = True  # False: backward accumulates, reduces nothing
        # the units to prefetch (set_modules_to_*_prefetch); None: the next in the first order
        self.forward_prefetch: list[_Unit] | None = None
        self.backward_prefetch: list[_Unit] | None = None
        param_dtype = mp_policy.param_dtype
        places: dict[nn.Parameter, list] = {}
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is not None and not is_shard(p):
                    places.setdefault(p, []).append((mod, name))
        first = next(iter(places), torch.empty(0))  # (no parameters at all: cpu, fp32)
        self.device = first.device
        self.dtype = param_dtype or first.dtype
        self.param_dtype = param_dtype
        shard_device = torch.device("cpu") if offload else self.device
        self.params = [
            _Param(p, where, comm, self.dtype, self.device, shard_device)
            for p, where in places.items()
        ]
        for e in self.params:
            self._swap(e, e.shard)
            if e.full.requires_grad:
                e.full.register_post_accumulate_grad_hook(self._on_grad)
        self.trainable = sum(e.full.requires_grad for e in self.params)
        self.family: _Family = _Family([self])
        self.gathering = None
        self.gathered = False
        self.ready = 0
        self.reducing = []
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
        send = torch.cat([e.shard.detach().flatten() for e in self.params])
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
        rows = out.view(self.comm.size, -1)
        offset = 0
        for e in self.params:
            e.buffer.untyped_storage().resize_(e.buffer.numel() * e.buffer.element_size())
            # `.data`: a write autograd does not version, so tensors saved for backward stay valid
            e.buffer.data.view(self.comm.size, -1).copy_(rows[:, offset : offset + e.shard.numel()])
            offset += e.shard.numel()
        self.gathering = None
        self.gathered = True

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
        """The full gradients packed rank-major, ÷N, reduce-scattered (async), then dropped.
        Without gradient sync they stay: the next backward adds into them."""
        self.ready = 0
        with_grad = [e for e in self.params if e.full.grad is not None]
        if not with_grad or not self.requires_gradient_sync:
            return
        n = self.comm.size
        flat = torch.cat([e.pad(e.full.grad).view(n, -1) for e in with_grad], dim=1)
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        flat.div_(n)
        for e in with_grad:
            e.full.grad = None
        out = flat.new_empty(flat.shape[1])
        self.reducing.append(
            (with_grad, flat, out, self.comm.reduce_scatter(out, flat.view(-1), async_op=True))
        )

    @torch.no_grad()
    def finish_reduce(self) -> None:
        for with_grad, _, out, pending in self.reducing:
            pending.wait()
            for e, piece in zip(with_grad, out.split([e.shard.numel() for e in with_grad])):
                g = piece.view(e.shard.shape).to(e.shard.device, torch.float32, copy=True)
                e.shard.grad = g if e.shard.grad is None else e.shard.grad.add_(g)
        self.reducing = []

    # -- the hooks --------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        family = self.family
        if not family.in_backward:
            family.forward_order.setdefault(self)
        self.wait_gather()
        for e in self.params:
            self._swap(e, e.full)
        if not family.in_backward:  # prefetch: overlaps with this unit's compute
            for unit in self.to_prefetch(self.forward_prefetch, list(family.forward_order)):
                unit.start_gather()
        if self.param_dtype is None or not self.cast_forward_inputs:
            return None
        return tree_map_only(
            torch.Tensor,
            lambda t: t.to(self.param_dtype) if t.is_floating_point() else t,
            (args, kwargs),
        )

    def _post_forward(self, module, args, output):
        if self.family.in_backward:  # recompute inside backward: keep the parameters gathered
            for e in self.params:
                self._swap(e, e.shard)
            return None
        self.family.done_order.setdefault(self)
        for e in self.params:
            self._swap(e, e.shard)  # outside its forward the module holds the shards
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.release()  # (else they stay gathered until this unit's backward)
        if not torch.is_grad_enabled():
            return None
        # the first gradient to reach an output comes just before this unit's backward
        outputs = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grad: self._before_backward(), mode="any"
            )
        return None

    def _before_backward(self) -> None:
        family = self.family
        family.start_backward()
        self.wait_gather()
        for unit in self.to_prefetch(self.backward_prefetch, list(family.done_order)[::-1]):
            unit.start_gather()

    def to_prefetch(self, chosen: list[_Unit] | None, order: list[_Unit]) -> list[_Unit]:
        """The units to gather while this one computes: those set by `set_modules_to_*_prefetch`
        or, by default, the one after this unit in `order` (the first step's)."""
        if chosen is not None:
            return chosen
        after = self.family.after(self, order)
        return [after] if after is not None else []

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
        self.forward_order: dict[_Unit, None] = {}  # pre-forward order: prefetch in forward
        self.done_order: dict[_Unit, None] = {}  # post-forward, reversed: prefetch in backward
        self.in_backward = self.callback_queued = False

    @staticmethod
    def after(unit: _Unit, order: list) -> _Unit | None:
        return dict(zip(order, order[1:])).get(unit)  # the unit next to `unit`, if any

    def start_backward(self) -> None:
        self.in_backward = True
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """The end of each backward: send what is left, wait, free (harmless when run again)."""
        for u in self.units:  # the same order on every rank
            if u.ready > 0:
                u.reduce()
        for u in self.units:
            u.finish_reduce()
            u.release()
        self.in_backward = self.callback_queued = False


# --- the API ------------------------------------------------------------------------------


class FSDPModule:
    """What `fully_shard` adds to the module it shards, as FSDP2's class of the same name: the
    module's class becomes a subclass of this one and of its own, so these are its methods."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """False: backward keeps adding into the full-size gradients on this rank and sends
        nothing; the first backward with True again reduce-scatters their sum (gradient
        accumulation, as DDP's `no_sync`). `recurse`: the units inside this module too."""
        units = [m._hplab_fsdp for m in self.modules() if isinstance(m, FSDPModule)]
        for unit in units if recurse else [self._hplab_fsdp]:
            unit.requires_gradient_sync = requires_gradient_sync

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In forward, start gathering `modules` (each fully sharded) as soon as this one's
        parameters have arrived, so that they travel while it computes. Replaces the default
        (the unit that ran after this one in the first forward); `[]`: prefetch none."""
        self._hplab_fsdp.forward_prefetch = [m._hplab_fsdp for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In backward, start gathering `modules` when this one's backward begins. Replaces the
        default (the unit that ran before this one in forward); `[]`: prefetch none."""
        self._hplab_fsdp.backward_prefetch = [m._hplab_fsdp for m in modules]


@functools.cache
def _fsdp_class(cls: type) -> type:
    """`FSDP<cls>`: `cls` with FSDPModule's methods, made once per class (FSDP2's way)."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def fully_shard(
    module: nn.Module,
    mesh=None,
    *,
    reshard_after_forward: bool = True,
    mp_policy=None,
    offload_policy=None,
) -> FSDPModule:
    """FSDP2's `fully_shard`: shard the parameters of `module` not already managed by an inner
    `fully_shard` call over `mesh` (a 1-D DeviceMesh, a torch ProcessGroup, an hplab
    Communicator or None for the world), and hook its forward to gather them just in time.
    Returns `module`, now an FSDPModule: its parameters are fp32 shards.
    `reshard_after_forward=False`: keep them gathered from forward to backward.
    `mp_policy`, `offload_policy`: torch's own dataclasses (param_dtype, reduce_dtype,
    cast_forward_inputs; CPUOffloadPolicy()), as in the module's docstring; None: their
    defaults (imported here, when needed: torch.distributed.fsdp takes 2.5 s to import)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if reshard_after_forward not in (True, False) or mp_policy.output_dtype is not None:
        raise ValueError(
            "hplab.fully_shard: reshard_after_forward takes True or False and "
            "MixedPrecisionPolicy.output_dtype None (the others are not built here)"
        )
    group = mesh.get_group() if isinstance(mesh, DeviceMesh) else mesh
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    claim_gradient_sync(module.parameters(), "hplab.fully_shard", ("hplab.fully_shard",), False)
    unit = _Unit(module, communicator(group, "dp"), mp_policy, offload, reshard_after_forward)
    inner = [m._hplab_fsdp for m in module.modules() if hasattr(m, "_hplab_fsdp")]
    units = [unit] + [u for f in dict.fromkeys(i.family for i in inner) for u in f.units]
    family = _Family(units)
    for u in units:
        u.family = family
    module._hplab_fsdp = unit
    if not isinstance(module, FSDPModule):
        module.__class__ = _fsdp_class(type(module))
    claim_gradient_sync(module.parameters(), "hplab.fully_shard", ("hplab.fully_shard",))
    return module


def is_shard(p) -> bool:
    """Whether `p` is a parameter shard owned by a `fully_shard` unit."""
    return p in _MANAGED


def managed(shard: nn.Parameter) -> _Param:
    """How an owned shard was cut (its group, rows and padding): what a checkpoint needs to
    make it whole and cut it again (hplab/sharded_state.py)."""
    return _MANAGED[shard]


def finish_gradient_sync(module: nn.Module) -> None:
    """Wait for the pending reduce-scatters of the units in `module` (the end of backward
    already does it; calling again does nothing)."""
    families = dict.fromkeys(
        m._hplab_fsdp.family for m in module.modules() if hasattr(m, "_hplab_fsdp")
    )
    for family in families:
        family.finish()
