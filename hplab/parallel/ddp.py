"""Data parallel (DDP), from scratch: `hplab.DDP`, used like `DistributedDataParallel`.

Every rank holds a full copy of the model and processes a different slice of the global batch.
Copies that start equal and apply the *same* update stay equal forever, and the average of all
ranks' gradients is exactly the gradient of the whole global batch (the loss is a mean over
samples). So data parallel is three steps:

1. **Start equal**: broadcast rank 0's parameters *and buffers* to everyone — frozen ones
   included: a frozen layer that differs between ranks would never be brought back together.
2. **Average gradients**: during backward, all-reduce every gradient and divide by n.
3. **Step**: every rank runs the same optimizer on the same gradients.

    model = DDP(model)                         # broadcast from rank 0
    opt = torch.optim.AdamW(model.parameters())
    for x, y in batches:                       # this rank's slice of the global batch
        loss = model(x, y); loss.backward()    # gradients are averaged by the time it returns
        opt.step(); opt.zero_grad()

Step 2 done naively waits for the whole backward pass, then sends everything. Two tricks make
it fast, and they are what `torch.nn.parallel.DistributedDataParallel` does too:

* **Buckets.** Gradients are packed into a few flat buffers ("buckets", 25 MiB by default), so
  the network sees a few large messages rather than hundreds of small ones (each message pays
  a fixed latency α; see lab 01's α-β model). Each parameter's `.grad` is a *view* into its
  bucket, so autograd accumulates gradients straight into the message.
* **Overlap.** Backward produces gradients from the last layer to the first. A hook on each
  parameter (`register_post_accumulate_grad_hook`) counts the gradients of its bucket; the
  moment a bucket is complete its all-reduce starts asynchronously while autograd keeps
  computing the earlier layers' gradients. Only the last bucket's communication is exposed.
  Collectives match by order, so a ready bucket waits until every bucket before it is sent.

**The sync finishes by itself.** The first hook of a backward queues a callback that autograd
runs when the whole backward ends (`queue_callback`): it sends the buckets that never completed
(parameters unused in this step) and waits for every all-reduce: a sync left to the caller is
one forgotten call away from a stale step.

**Any `zero_grad()`.** By default `zero_grad()` sets `.grad` to None, so the next backward makes
fresh gradients that are *not* bucket views (averaging the buckets regardless would let replicas
drift apart): such a gradient is copied into its slot, and `.grad` becomes the view again.

Gradient accumulation: inside `with ddp.no_sync():` backward only accumulates locally; the
next synchronised backward (or `finish_gradient_sync()`) communicates the sum. Parameters
without a gradient keep `.grad = None` (the optimizer skips them) and their slots are sent as
zeros; like PyTorch's DDP, every rank must use the same parameters in a step. A tied parameter
(GPT's embedding and LM head) is reduced once; frozen ones (requires_grad=False) have no slot.

**Experts.** Under expert parallel (hplab/parallel/moe.py) each rank holds E/ep experts; an
expert's replicas are the dp/ep ranks with the same ones (its *edp* group). Its gradient
already sums the tokens its whole ep group sent it, so its buckets are all-reduced over edp
and divided by dp's size, like every other bucket: `DDP(model, dp, expert_group=edp)`.

**One wrapper averages a gradient.** DDP's hooks and ZeRO-2's (or fully_shard's) would both
reduce the same gradient in the same backward, the second reading a half-reduced or already
averaged one: `hplab.parallel.sync` refuses the second wrapper when it is built, in one line. DDP
with ZeRO-1 is correct (ZeRO-1 reduces at `step()`, after DDP has averaged), only wasteful.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn as nn
from torch._utils import _unflatten_dense_tensors

from hplab.parallel.buckets import bucket_params
from hplab.parallel.collectives import communicator
from hplab.parallel.sync import check_expert_group, claim_gradient_sync, shared_out


class Bucket:
    """A flat gradient buffer for a few parameters, and the state of its all-reduce over
    `comm` (the dp group; for experts, their replicas')."""

    def __init__(self, params: list[nn.Parameter], comm):
        self.params = params
        self.comm = comm
        self.buffer = params[0].new_zeros(sum(p.numel() for p in params))
        self.views = _unflatten_dense_tensors(self.buffer, params)  # each param's slot: a view
        self.ready: set[int] = set()  # ids of its params whose gradient is in for this backward
        self.pending = None  # the in-flight all-reduce


def move_grad_in(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make a gradient live in its slot (None: a zero slot, `.grad` stays None)."""
    if p.grad is None:
        view.zero_()
    elif p.grad is not view:
        view.copy_(p.grad)
        p.grad = view


class DDP(nn.Module):
    """Data parallel over `group` (a torch ProcessGroup, an hplab Communicator such as
    `mesh.dp`, or None for the world), with gradient buckets of `bucket_mb` MiB (0: one
    message per parameter). Experts that expert parallel shared out (`moe.parallelize`) are
    averaged over `expert_group`, their replicas (edp: the dp ranks with this rank's experts).
    `.module` is the wrapped model."""

    def __init__(self, module: nn.Module, group=None, bucket_mb: float = 25, expert_group=None):
        super().__init__()
        self.comm = communicator(group, "dp")
        experts = communicator(expert_group, "edp") if expert_group is not None else None
        check_expert_group(module, self.comm, experts)
        claim_gradient_sync(module.parameters(), "hplab.DDP", expert_group=expert_group)
        self.module = module
        comm_of = {id(p): experts if shared_out(p) else self.comm for p in module.parameters()}
        for t in [*module.parameters(), *module.buffers()]:  # start equal: rank 0's values
            comm_of.get(id(t), self.comm).broadcast(t.data, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]  # tied: listed once
        # buckets in backward's order (`bucket_params`), each of one group's parameters
        runs = [list(run) for _, run in itertools.groupby(self.params, lambda p: comm_of[id(p)])]
        self.buckets = [
            Bucket(params, comm_of[id(run[0])])
            for run in reversed(runs)
            for params in bucket_params(run, bucket_mb)
        ]
        self.slot_of = {
            id(p): (b, view) for b in self.buckets for p, view in zip(b.params, b.views)
        }
        self.next_to_launch = 0  # buckets before next_to_launch: sent
        self.sync_enabled = True
        self.started = False  # a synchronised backward has begun (its callback is queued)
        self.unsynced = False  # gradients were accumulated under no_sync()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- during backward --
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """`param.grad` is complete: into its slot; launch the buckets this completes, in order."""
        if not self.sync_enabled:
            self.unsynced = True
            return
        if not self.started:
            self.started = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_sync)
        bucket, view = self.slot_of[id(param)]
        move_grad_in(param, view)
        bucket.ready.add(id(param))
        self._launch_ready_buckets()

    def _launch_ready_buckets(self, force: bool = False) -> None:
        while self.next_to_launch < len(self.buckets):
            b = self.buckets[self.next_to_launch]
            if not force and len(b.ready) < len(b.params):
                return
            b.buffer.div_(self.comm.size)  # average = sum of (grad / n), n = dp (experts too)
            b.pending = b.comm.all_reduce(b.buffer, async_op=True)
            self.next_to_launch += 1

    # -- when backward ends (by itself), or when the caller says so --
    def finish_gradient_sync(self) -> None:
        """Send the buckets not sent yet (unused parameters, `no_sync()` or hand-written grads),
        wait for every all-reduce, reset for the next step. Does nothing with nothing to sync."""
        if not (self.started or self.unsynced):
            return
        for b in self.buckets[self.next_to_launch :]:
            for p, view in zip(b.params, b.views):
                move_grad_in(p, view)
        self._launch_ready_buckets(force=True)
        for b in self.buckets:
            b.pending.wait()
            b.pending = None
            b.ready.clear()
        self.next_to_launch = 0
        self.started = False
        self.unsynced = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication (gradient accumulation)."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True
