"""ZeRO stages 1 and 2 (and ZeRO-Offload) as an optimizer, from scratch.

Data parallel keeps a full copy of everything on every rank. With Adam in mixed precision a
parameter costs 2 (bf16 param) + 2 (bf16 grad) + K = 12 (fp32 master, exp_avg, exp_avg_sq)
= 16 bytes on *each* of the n ranks, although every rank computes the same update. ZeRO
(Rajbhandari et al., 2020) removes that redundancy: each rank owns 1/n of the model states
and gets the rest from its peers only when needed. Per rank, for Ψ parameters:

    stage 0  (DDP)                     (2 + 2 + K)·Ψ
    stage 1  optimizer state sharded    2Ψ + 2Ψ + K·Ψ/n
    stage 2  + gradients sharded        2Ψ + (2 + K)·Ψ/n
    stage 3  + parameters sharded       (2 + 2 + K)·Ψ/n

(pure fp32: params 4, grads 4, K = 8 and no separate master copy.) Stages 1 and 2 change only
what the *optimizer* holds, so here they are an optimizer: `ZeroOptimizer`, used like PyTorch's
`torch.distributed.optim.ZeroRedundancyOptimizer`. Stage 3 must also change what the *model*
holds between layers; it lives in `hplab/fsdp.py` as `fully_shard`, like PyTorch's FSDP2.

    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    for x, y in data:                      # each rank its own slice of the global batch
        loss = model(x, y)[1]
        loss.backward()                    # stage 2: gradients reduce-scattered right here
        opt.step()                         # average + shard grads, step 1/n, all-gather params
        opt.zero_grad()

No DDP is needed around the model: the reduce-scatter below *is* the gradient averaging (a
model wrapped in DDP works too: averaging averaged gradients changes nothing).

**Communication.** DDP all-reduces the gradients: 2(n−1)/n·Ψ elements per rank per step (a
reduce-scatter then an all-gather). ZeRO-1 and 2 do exactly those two halves, in a useful
order: *reduce-scatter* the gradients (each rank receives the sum of its own 1/n), step the
optimizer on that 1/n, *all-gather* the updated parameters: the same 2(n−1)/n·Ψ.

**The layout: flat buckets.** Each param group's trainable parameters are cut into *buckets*
of at most `bucket_mb` MiB, in reverse definition order (the order backward produces their
gradients). A bucket's parameters are laid end to end in one flat buffer, **padded with zeros
to a multiple of n elements**, so it splits into n equal shards; rank r owns shard r of every
bucket. Each model parameter becomes a *view* into its bucket's buffer, so the model runs
unchanged and sees every all-gather at once. A shard never mixes two param groups, so per-group
hyperparameters (weight decay on matrices only, say) stay exact. Every measured byte count is
the ZeRO formula with Ψ replaced by Σ_buckets ceil(numel / n)·n (Ψ itself for hplab's `tiny`
GPT on 2 or 4 ranks).

What a rank holds for each bucket (all flat, 1-D):

    flat        the whole bucket's params (param dtype); p.data are views of it
    master      this rank's fp32 slice, which the inner optimizer steps: *the slice of flat
                itself* when training in fp32 on the device (no extra byte), otherwise a
                separate fp32 copy (bf16/fp16 params; on the CPU with offload)
    grad_shard  this rank's slice of the averaged gradient (param dtype); stage 1 makes it in
                `step()`, stage 2 accumulates into it during backward

**Stage 1** leaves backward alone: each p.grad is the full local gradient. `step()` packs each
bucket's gradients into a flat buffer, divides by n (so the sum is the average) and
reduce-scatters it. **Stage 2** does this during backward: a hook on each parameter notes its
gradient has arrived; when a bucket is complete its reduce-scatter starts (asynchronously,
overlapping with the rest of backward) and its p.grad are freed, so no full gradient outlives
its bucket. A callback queued for the end of backward sends the buckets only partly filled
(unused parameters count as zeros) and waits for all of them. Gradient accumulation: stage 1
accumulates in p.grad (autograd does it); stage 2 adds each backward's shard into grad_shard.

**One step:** `reduce_gradients()` (the masters' fp32 grads := this rank's 1/n of the averaged
gradient; a training loop calls it first to unscale or clip there) → `self.inner.step()` on
the master shards only (1/n of the optimizer work and state) → all-gather the new values into
every bucket's flat buffer (rounded to bf16/fp16 where the params are).

**Offload** (ZeRO-Offload): masters, their grads and the optimizer state live on the CPU;
each step copies the gradient shard there and the updated parameter shard back. On a GPU this
frees K·Ψ/n bytes of device memory; on a CPU-only machine it runs the same copies.

Any element-wise `torch.optim` optimizer works (SGD, Adam, AdamW): each shard sees exactly the
numbers it would see in the whole tensor. Optimizers that look at whole tensors (LAMB,
Adafactor) would need per-parameter care. A trainable parameter that gets no gradient steps
with a zero gradient (as in DDP), where a single process would skip it: the same unless the
optimizer decays weights. Frozen parameters (requires_grad=False) are broadcast and left out.
Every rank must run the same graph (the same buckets complete in the same order).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from hplab.comm import Communicator, communicator, copy_markers
from hplab.memory import optimizer_state_tensors


class ZeroError(ValueError):
    """A ZeRO configuration that cannot work; the message says how to fix it."""


def bucket_params(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Cut params into buckets of at most `bucket_mb` MiB (a larger parameter gets one of its
    own; 0 gives one per parameter), in reverse definition order, one dtype/device each."""
    buckets, size = [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > bucket_mb * 2**20 or \
                (p.dtype, p.device) != (buckets[-1][0].dtype, buckets[-1][0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class FlatBucket:
    """Parameters laid end to end in one flat buffer of `padded` elements (a multiple of n),
    cut into n shards of `shard_numel`; this rank owns elements [lo, hi)."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, offload: bool):
        self.params, self.comm = params, comm
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / comm.size) * comm.size
        self.shard_numel = self.padded // comm.size
        self.lo, self.hi = comm.rank * self.shard_numel, (comm.rank + 1) * self.shard_numel
        dtype, device = params[0].dtype, params[0].device
        with torch.no_grad():
            self.flat = torch.zeros(self.padded, dtype=dtype, device=device)
            for p, where in self.slices():
                self.flat[where].copy_(p.detach().reshape(-1))
            comm.broadcast(self.flat, src=0)  # replicas start equal: rank 0's values
        for p, where in self.slices():
            p.data = self.flat[where].view(p.shape)  # the model now reads the flat buffer

        # The fp32 master shard: the param shard itself when there is nothing to convert.
        shard = self.flat[self.lo:self.hi]
        separate = dtype != torch.float32 or offload
        home = torch.device("cpu") if offload else device
        self.master = nn.Parameter(shard.to(home, torch.float32, copy=True) if separate
                                   else shard)
        copy_markers(params[0], self.master)
        self.master.dp_sharded = True  # disjoint over dp: a global norm counts it everywhere
        self.grad_shard: torch.Tensor | None = None
        self.ready: set = set()  # stage 2: params whose gradient arrived since the last send
        self.reducing: list = []  # (input, output, Pending) of in-flight reduce-scatters

    def slices(self):
        offset = 0
        for p in self.params:
            yield p, slice(offset, offset + p.numel())
            offset += p.numel()

    @torch.no_grad()
    def start_reduce_scatter(self, free_grads: bool) -> None:
        """Pack the params' gradients (None → zeros) into one padded buffer, pre-divided by n
        so the sum is the average, and reduce-scatter it asynchronously."""
        flat = torch.zeros_like(self.flat)
        for p, where in self.slices():
            if p.grad is not None:
                flat[where].copy_(p.grad.reshape(-1))
                if free_grads:
                    p.grad = None
        flat.div_(self.comm.size)
        out = torch.empty(self.shard_numel, dtype=flat.dtype, device=flat.device)
        self.reducing.append((flat, out, self.comm.reduce_scatter(out, flat, async_op=True)))
        self.ready.clear()

    def finish_reduce_scatter(self) -> None:
        for _, out, pending in self.reducing:
            pending.wait()
            self.grad_shard = out if self.grad_shard is None else self.grad_shard.add_(out)
        self.reducing = []

    def master_grad(self) -> torch.Tensor:
        """This rank's averaged gradient shard in fp32 where the master lives (no copy when
        it already is)."""
        if self.grad_shard is None:  # no gradient reached this bucket
            return torch.zeros_like(self.master)
        return self.grad_shard.to(self.master.device, torch.float32)

    @torch.no_grad()
    def start_all_gather(self):
        """Every rank's new master shard into the flat param buffer (rounded to its dtype)."""
        mine = self.master.detach().to(self.flat.device, self.flat.dtype, copy=True)
        return mine, self.comm.all_gather(self.flat, mine, async_op=True)

    # -- checkpoints: a shard made whole, and cut again --
    @torch.no_grad()
    def unshard(self, shard: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """{param: its full tensor (cpu)} from every rank's `shard` (a collective)."""
        full = torch.empty(self.padded, dtype=shard.dtype, device=self.flat.device)
        self.comm.all_gather(full, shard.detach().to(self.flat.device, copy=True))
        return {p: full[where].view(p.shape).cpu().clone() for p, where in self.slices()}

    def pack(self, full: dict[nn.Parameter, torch.Tensor], dtype) -> torch.Tensor:
        """The whole padded bucket from {param: full tensor} (absent → 0), on the CPU."""
        flat = torch.zeros(self.padded, dtype=dtype)
        for p, where in self.slices():
            if p in full:
                flat[where] = full[p].reshape(-1).to(dtype)
        return flat


class ShardedState:
    """Checkpoints of a ZeroOptimizer: its shards made whole (a collective), and cut again."""

    @torch.no_grad()
    def full_state(self) -> tuple[dict, dict]:
        """({param: full fp32 value}, {param: {state name: full tensor}}), all on the CPU and
        on every rank: a collective over the group. 0-dim state (Adam's step) is kept as is."""
        values = {p: p.detach().float().cpu().clone() for p in self.frozen}
        states = {p: {} for p in self.frozen}
        for b in self.buckets:
            values.update(b.unshard(b.master))
            state = self.inner.state.get(b.master, {})
            full = {k: b.unshard(t) for k, t in state.items() if torch.is_tensor(t) and t.dim()}
            for p in b.params:
                states[p] = {k: full[k][p] if k in full else
                             (t.cpu().clone() if torch.is_tensor(t) else t)
                             for k, t in state.items()}
        return values, states

    @torch.no_grad()
    def load_full_state(self, values: dict, states: dict) -> None:
        """The reverse of `full_state`: every rank gets the full dicts, keeps its shards (and
        the whole params, which every rank holds in stages 1 and 2). No communication."""
        for p in self.frozen:
            if p in values:
                p.copy_(values[p])
        for b in self.buckets:
            flat = b.pack(values, torch.float32)
            b.master.copy_(flat[b.lo:b.hi])
            b.flat.copy_(flat)  # (after the master: it may be a view of the flat buffer)
            saved = next((states[p] for p in b.params if states.get(p)), None)
            if saved is not None:
                self.inner.state[b.master] = {
                    k: b.pack({p: states[p][k] for p in b.params if k in states.get(p, {})},
                              t.dtype)[b.lo:b.hi].clone().to(b.master.device)
                    if torch.is_tensor(t) and t.dim() else
                    (t.clone() if torch.is_tensor(t) else t)
                    for k, t in saved.items()}

    # -- torch's state_dict, as ZeroRedundancyOptimizer has it ---------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state (a collective); rank `to` of the group keeps it
        for `state_dict()`."""
        _, states = self.full_state()
        params = [p for g in self.param_groups for p in g["params"]]
        index = iter(range(len(params)))
        self.consolidated = None if self.comm.rank != to else {
            "state": {i: states[p] for i, p in enumerate(params) if states.get(p)},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [next(index) for _ in g["params"]]}
                             for g in self.param_groups]}

    def state_dict(self) -> dict:
        """The whole state in torch's format (state keyed by parameter index, each tensor
        shaped like its parameter), on the rank `consolidate_state_dict` named."""
        if getattr(self, "consolidated", None) is None:
            raise RuntimeError("call consolidate_state_dict(to=rank) on every rank first; "
                               "state_dict() then returns the whole state on that rank")
        return self.consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (what `state_dict()` returned), given to every rank. The fp32
        masters are re-read from the params (exact in fp32; rounded for bf16/fp16 params)."""
        params = [p for g in self.param_groups for p in g["params"]]
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
        states = {params[int(i)]: s for i, s in state_dict["state"].items()}
        self.load_full_state({p: p.detach().float() for p in params}, states)


class ZeroOptimizer(ShardedState, torch.optim.Optimizer):
    """ZeRO-1/2: `optimizer_class` steps only this rank's fp32 shard of each bucket.

    `params`: parameters or param-group dicts, as for any torch optimizer. `group`: the dp
    group (an hplab Communicator, a torch ProcessGroup, or None for the world). `stage` 1 or
    2; `bucket_mb`: bucket size; `offload`: masters and optimizer on the CPU. The rest goes to
    `optimizer_class`. `self.inner` is that optimizer, over the master shards; its param groups
    mirror `self.param_groups` (extra keys included) and take their hyperparameters before
    each step, so an LR scheduler on this optimizer works.
    """

    def __init__(self, params, optimizer_class, group=None, stage: int = 1,
                 bucket_mb: float = 25, offload: bool = False, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ZeroError(f"ZeroOptimizer stage must be 1 or 2, got {stage} (stage 0 is "
                            "plain DDP; stage 3 is hplab.fully_shard)")
        if bucket_mb < 0:
            raise ZeroError(f"bucket_mb must be at least 0, got {bucket_mb}")
        super().__init__(params, optimizer_kwargs)
        self.comm, self.stage, self.offload = communicator(group, "dp"), stage, offload
        self.group_buckets: list[list[FlatBucket]] = []
        self.frozen = []
        for g in self.param_groups:
            trainable = [p for p in g["params"] if p.requires_grad]
            self.frozen += [p for p in g["params"] if not p.requires_grad]
            self.group_buckets.append([FlatBucket(ps, self.comm, offload)
                                       for ps in bucket_params(trainable, bucket_mb)])
        with torch.no_grad():
            for p in self.frozen:  # not stepped, but the replicas must start equal too
                self.comm.broadcast(p.detach(), src=0)
        self.buckets = [b for bs in self.group_buckets for b in bs]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}

        self.inner = optimizer_class(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": [b.master for b in bs]}
             for g, bs in zip(self.param_groups, self.group_buckets)], **optimizer_kwargs)
        for g, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in inner.items():  # show the inner optimizer's defaults here too
                g.setdefault(k, v)
        self.reduced = False  # reduce_gradients done for this step
        self.callback_queued = False
        if stage == 2:
            self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                          for p in self.bucket_of]

    # -- stage 2: each bucket reduce-scattered as soon as backward completes it --------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.bucket_of[param]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params):
            bucket.start_reduce_scatter(free_grads=True)

    def _end_of_backward(self) -> None:
        """Send the buckets this backward filled only in part; wait for every send."""
        self.callback_queued = False
        for b in self.buckets:  # the same order on every rank
            if b.ready:
                b.start_reduce_scatter(free_grads=True)
        for b in self.buckets:
            b.finish_reduce_scatter()

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Every master shard's fp32 `.grad` := this rank's 1/n of the averaged gradient.
        Harmless when already done for this step (`step()` calls it)."""
        if self.reduced:
            return
        for b in self.buckets:
            if self.stage == 1:
                b.start_reduce_scatter(free_grads=False)  # p.grad stay, as torch keeps them
            elif b.ready or any(p.grad is not None for p in b.params):  # still owed
                b.start_reduce_scatter(free_grads=True)
        for b in self.buckets:
            b.finish_reduce_scatter()
            b.master.grad = b.master_grad()
        self.reduced = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        for g, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({k: v for k, v in g.items() if k != "params"})  # e.g. a new lr
        self.inner.step()
        gathers = [b.start_all_gather() for b in self.buckets]
        for _, pending in gathers:
            pending.wait()
        for b in self.buckets:  # the fp32 master grads exist only during the step
            b.master.grad = None
            if self.stage == 1:  # recomputed from p.grad by the next step
                b.grad_shard = None
        self.reduced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the params' own .grad
        for b in self.buckets:
            b.master.grad, b.grad_shard = None, None
            b.ready.clear()
        self.reduced = False

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """For the MemoryLedger (storages counted once: a master that is a view of the params
        counts as params)."""
        return {"params": [b.flat for b in self.buckets] + self.frozen,
                "grads": [b.grad_shard for b in self.buckets]
                + [b.master.grad for b in self.buckets]
                + [p.grad for g in self.param_groups for p in g["params"]],
                "optim": optimizer_state_tensors(self.inner),
                "master": [b.master for b in self.buckets]}
