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
holds between layers; it lives in `hplab/parallel/fsdp.py` as `fully_shard`, like PyTorch's FSDP2.

    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    for x, y in data:                      # each rank its own slice of the global batch
        loss = model(x, y)[1]
        loss.backward()                    # stage 2: gradients reduce-scattered right here
        opt.step()                         # average + shard grads, step 1/n, all-gather params
        opt.zero_grad()

**Communication.** No DDP is needed around the model. DDP's all-reduce is a reduce-scatter
then an all-gather, 2(n−1)/n·Ψ elements per rank per step; ZeRO-1 and 2 do those two halves
in a useful order: *reduce-scatter* the gradients (each rank receives the sum of its own 1/n:
that *is* the averaging), step the optimizer on that 1/n, *all-gather* the new parameters.

**The layout: flat buckets.** Each param group's trainable parameters are cut into buckets of
at most `bucket_mb` MiB, in reverse definition order (the order backward produces gradients).
A bucket's parameters lie end to end in one flat buffer, **padded with zeros to a multiple of
n elements**, so it splits into n equal shards; rank r owns shard r of every bucket. Each
parameter becomes a *view* into that buffer, so the model runs unchanged and sees every
all-gather at once. A shard never mixes two param groups, so per-group hyperparameters stay
exact. Measured bytes follow the formulas with Ψ = Σ_buckets ceil(numel / n)·n. Per bucket:

    flat        the whole bucket's params (param dtype); p.data are views of it
    master      this rank's fp32 slice, which the inner optimizer steps: *the slice of flat
                itself* in fp32 on the device (no extra byte), else a separate fp32 copy
    grad_shard  this rank's slice of the averaged gradient (param dtype)

**Stage 1** leaves backward alone; `step()` packs each bucket's p.grad into a flat buffer,
divides by n (so the sum is the average) and reduce-scatters it. **Stage 2** does this during
backward: when a hook has seen every gradient of a bucket, its reduce-scatter starts
(asynchronously, overlapping the rest of backward) and its p.grad are freed. A callback at the
end of backward sends the buckets only partly filled (unused parameters count as zeros) and
waits for all. Gradient accumulation: stage 1 accumulates in p.grad, stage 2 in grad_shard.

**Offload** (ZeRO-Offload): masters, their grads and the optimizer state live on the CPU; each
step copies the gradient shard there and the updated shard back (frees K·Ψ/n device bytes).
**Two sharding groups** (Megatron's distributed optimizer keeps two buffers): a param group
may name its own `shard_over` group and `average_over` count. Under expert parallel an expert
lives only on its expert-data-parallel ranks (dp/ep of them), so its shards are cut over those;
its gradient already sums the tokens of its whole ep group, so it is divided by dp's size, not
by its group's. Without these keys a group is sharded over `group` and divided by its size.

A bucket holding a pipeline's tied embedding (whose gradient the first and last stage sum
after backward, `pp.sum_tied_gradient`) keeps its gradients until `step()` under stage 2 too
(hplab's trainer gives that weight a param group, so a bucket, of its own).

Any element-wise `torch.optim` optimizer works (SGD, Adam, AdamW); LAMB or Adafactor, which
look at whole tensors, would not. A parameter that got no gradient in a step (unused, or frozen
after the optimizer was built) is left alone, as torch's optimizers skip one whose `.grad` is
None: its elements of the shard and of the optimizer state are put back after the inner step
(no weight decay, no moment update). One difference remains: Adam's step count is the
shard's, so a parameter that sits out some steps and trains again later resumes with the
shard's bias correction, not its own. Frozen parameters are broadcast and left out. Every rank
must run the same graph (the same buckets complete in the same order). Checkpoints: its shards
made whole and cut again are the run's business (hplab/sharded_state.py, a mixin).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn as nn

from hplab.parallel import placement
from hplab.parallel.buckets import bucket_params
from hplab.parallel.collectives import Communicator, communicator
from hplab.parallel.optim import WrappedOptimizer
from hplab.parallel.sync import claim_gradient_sync
from hplab.sharded_state import ShardedState

DDP_OK = {1: ("hplab.DDP",), 2: ()}  # ZeRO-1 reduces at step(), after DDP's average: right


class ZeroError(ValueError):
    """A ZeRO configuration that cannot work; the message says how to fix it."""


class FlatBucket:
    """Parameters laid end to end in one flat buffer of `padded` elements (a multiple of n),
    cut into n shards of `shard_numel`; this rank owns elements [lo, hi)."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, offload: bool, divisor: int):
        self.params = params
        self.comm = comm
        self.divisor = divisor
        ends = [0, *itertools.accumulate(p.numel() for p in params)]
        self.slices = [(p, slice(a, b)) for p, a, b in zip(params, ends, ends[1:])]
        self.padded = math.ceil(ends[-1] / comm.size) * comm.size
        self.shard_numel = self.padded // comm.size
        self.lo = comm.rank * self.shard_numel
        self.hi = (comm.rank + 1) * self.shard_numel
        dtype = params[0].dtype
        device = params[0].device
        self.flat = torch.zeros(self.padded, dtype=dtype, device=device)
        self.flat[: ends[-1]] = torch.cat([p.detach().reshape(-1) for p in params])
        comm.broadcast(self.flat, src=0)  # replicas start equal: rank 0's values
        for p, where in self.slices:
            p.data = self.flat[where].view(p.shape)  # the model now reads the flat buffer

        # The fp32 master shard: the param shard itself when there is nothing to convert.
        self.master = nn.Parameter(
            self.flat[self.lo : self.hi].to(
                "cpu" if offload else device, torch.float32, copy=dtype != torch.float32 or offload
            )
        )
        shard = placement.FlatShard(comm.name, comm.size)
        for p in params:  # the params stay whole; their optimizer state lives in flat shards
            placement.update(p, zero=shard)
        # the master: disjoint over comm (a global norm counts it on every rank), of the bucket
        whole = dict(dp=shard, sharded_over=comm.name, zero=None, global_shape=(self.padded,))
        placement.derive(params[0], self.master, **whole)
        self.grad_shard: torch.Tensor | None = None
        self.ready: set = set()  # stage 2: params whose gradient arrived since the last send
        self.arrived: set = set()  # params with a gradient this step (the others sit it out)
        self.reducing: list = []  # (input, output, Pending) of in-flight reduce-scatters

    @torch.no_grad()
    def start_reduce_scatter(self, free_grads: bool) -> None:
        """Pack the params' gradients (None → zeros) into one padded buffer, pre-divided by n
        (`divisor`) so the sum is the average, and reduce-scatter it asynchronously."""
        flat = torch.zeros_like(self.flat)
        for p, where in self.slices:
            if p.grad is not None:
                flat[where].copy_(p.grad.reshape(-1))
                self.arrived.add(p)
                if free_grads:
                    p.grad = None
        flat.div_(self.divisor)
        out = torch.empty(self.shard_numel, dtype=flat.dtype, device=flat.device)
        self.reducing.append((flat, out, self.comm.reduce_scatter(out, flat, async_op=True)))
        self.ready.clear()

    def finish_reduce_scatter(self) -> None:
        for _, out, pending in self.reducing:
            pending.wait()
            self.grad_shard = out if self.grad_shard is None else self.grad_shard.add_(out)
        self.reducing = []

    def idle(self) -> list[slice]:
        """The pieces of this rank's shard whose parameters got no gradient this step, on this
        rank or any other (their averaged gradient is all zeros)."""
        pieces = []
        for p, where in self.slices:
            lo = max(where.start, self.lo) - self.lo
            hi = min(where.stop, self.hi) - self.lo
            if p not in self.arrived and lo < hi and not self.master.grad[lo:hi].any():
                pieces.append(slice(lo, hi))
        return pieces

    def start_all_gather(self):
        """Every rank's new master shard into the flat param buffer (rounded to its dtype)."""
        mine = self.master.detach().to(self.flat.device, self.flat.dtype, copy=True)
        return mine, self.comm.all_gather(self.flat, mine, async_op=True)

    # -- checkpoints: a shard made whole, and cut again --
    def gather_full(self, shard: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """{param: its full tensor (cpu)} from every rank's `shard` (a collective)."""
        full = torch.empty(self.padded, dtype=shard.dtype, device=self.flat.device)
        self.comm.all_gather(full, shard.detach().to(self.flat.device, copy=True))
        return {p: full[where].view(p.shape).cpu().clone() for p, where in self.slices}

    def pack(self, full: dict[nn.Parameter, torch.Tensor], dtype) -> torch.Tensor:
        """The whole padded bucket from {param: full tensor} (absent → 0), on the CPU."""
        flat = torch.zeros(self.padded, dtype=dtype)
        for p, where in self.slices:
            if p in full:
                flat[where] = full[p].reshape(-1).to(dtype)
        return flat


def holds_tied_embedding(bucket: FlatBucket) -> bool:
    return any(placement.of(p).pipeline_ends for p in bucket.params)


class ZeroOptimizer(ShardedState, WrappedOptimizer):
    """ZeRO-1/2: `optimizer_class` steps only this rank's fp32 shard of each bucket. `group`:
    the dp group (an hplab Communicator, a torch ProcessGroup or None for the world), which a
    param group's `shard_over` and `average_over` may replace; the rest goes to
    `optimizer_class`. `self.inner`, that optimizer over the master shards, mirrors
    `self.param_groups` and takes their hyperparameters before each step (so an LR scheduler
    on this optimizer works)."""

    def __init__(
        self,
        params,
        optimizer_class,
        group=None,
        stage: int = 1,
        bucket_mb: float = 25,
        offload: bool = False,
        **optimizer_kwargs,
    ):
        if stage not in (1, 2):
            raise ZeroError(
                f"ZeroOptimizer stage must be 1 or 2, got {stage} (stage 0 is "
                "plain DDP; stage 3 is hplab.fully_shard)"
            )
        if bucket_mb < 0:
            raise ZeroError(f"bucket_mb must be at least 0, got {bucket_mb}")
        super().__init__(params, optimizer_kwargs)
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        claim_gradient_sync(
            trainable, f"hplab.ZeroOptimizer(stage={stage})", DDP_OK[stage], stage == 2
        )
        self.comm = communicator(group, "dp")
        self.stage = stage
        self.offload = offload
        self.frozen = []
        self.buckets = []
        inner_groups = []
        for g in self.param_groups:
            if "shard_over" not in g and any(
                placement.of(p).expert_parallel > 1 for p in g["params"]
            ):
                raise ZeroError(
                    "ZeroOptimizer: a param group holds experts that expert parallel shares out "
                    "(E/ep on each rank), which a shard over the whole group would mix: give "
                    "them a group of their own with shard_over=<their edp group> and "
                    "average_over=<the dp size>"
                )
            comm = communicator(g.get("shard_over", self.comm), "dp")
            divisor = g.get("average_over", comm.size)
            frozen = [p for p in g["params"] if not p.requires_grad]
            with torch.no_grad():
                for p in frozen:  # not stepped, but the replicas must start equal too
                    comm.broadcast(p.detach(), src=0)
            mine = [
                FlatBucket(ps, comm, offload, divisor)
                for ps in bucket_params([p for p in g["params"] if p.requires_grad], bucket_mb)
            ]
            self.frozen, self.buckets = self.frozen + frozen, self.buckets + mine
            inner_groups.append({**g, "params": [b.master for b in mine]})
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.wrap(optimizer_class, inner_groups, **optimizer_kwargs)
        self.callback_queued = False
        # a bucket holding a pipeline's tied embedding waits for step(), as under stage 1: the
        # pipeline sums its two copies' gradients after backward, and needs them whole
        self.at_step = [b for b in self.buckets if stage == 1 or holds_tied_embedding(b)]
        for p, b in self.bucket_of.items():
            if b not in self.at_step:
                p.register_post_accumulate_grad_hook(self._grad_ready)

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

    # -- the step: reduce-scatter, step the shard, all-gather ---------------------------------
    def _sync_gradients(self) -> None:
        """Every master shard's fp32 `.grad` := this rank's 1/n of the averaged gradient."""
        for b in self.buckets:
            if b in self.at_step:
                b.start_reduce_scatter(free_grads=False)  # p.grad stay, as torch keeps them
            elif b.ready or any(p.grad is not None for p in b.params):  # still owed
                b.start_reduce_scatter(free_grads=True)
        for b in self.buckets:  # fp32 where the master lives (no copy when it already is)
            b.finish_reduce_scatter()
            b.master.grad = (
                torch.zeros_like(b.master)
                if b.grad_shard is None
                else b.grad_shard.to(b.master.device, torch.float32)
            )

    @torch.no_grad()
    def _step_inner(self) -> None:
        """`inner.step()`, then the pieces of parameters without a gradient put back as they
        were: the master shard and each optimizer state of its shape (Adam's moments)."""
        kept = []
        for b in self.buckets:
            if idle := b.idle():
                state = self.inner.state.get(b.master, {})
                tensors = [b.master] + [t for t in state.values() if torch.is_tensor(t) and t.dim()]
                kept += [(t, piece, t[piece].clone()) for t in tensors for piece in idle]
        self.inner.step()
        for t, piece, before in kept:
            t[piece] = before  # (state born in this step starts at zeros: zero grads keep it so)
        for b in self.buckets:
            b.arrived.clear()

    def _write_back(self) -> None:
        """Every rank's new shards into every rank's flat buffers, all in flight at once."""
        for _, pending in [b.start_all_gather() for b in self.buckets]:
            pending.wait()
        for b in self.buckets:  # the fp32 master grads exist only during the step
            b.master.grad = None
            if b in self.at_step:  # recomputed from p.grad by the next step
                b.grad_shard = None

    def _zero_stepped_grads(self) -> None:
        for b in self.buckets:
            b.master.grad = None
            b.grad_shard = None
            b.ready.clear()
            b.arrived.clear()
