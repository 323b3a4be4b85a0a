"""Data parallel (DDP), from scratch.

The idea: every rank holds a full copy of the model and processes a different slice of the
global batch. If the copies start equal and every rank applies the *same* update, they stay
equal forever. The update is the same when every rank uses the average of all ranks'
gradients — which is exactly the gradient of the whole global batch, because the loss is a
mean over samples. So data parallel is three steps:

1. **Start equal**: broadcast rank 0's parameters to everyone.
2. **Average gradients**: after backward, all-reduce every gradient and divide by n.
3. **Step**: every rank runs the same optimizer on the same gradients.

Step 2 done naively waits for the whole backward pass, then sends everything. Two tricks make
it fast, and they are what `torch.nn.parallel.DistributedDataParallel` does too:

* **Buckets.** Gradients are packed into a few flat buffers ("buckets", ~25 MB by default), so
  the network sees a few large messages rather than hundreds of small ones (each message pays
  a fixed latency α; see lab 01's α-β model). Each parameter's `.grad` is a *view* into its
  bucket, so autograd writes gradients straight into the message — no copy.
* **Overlap.** Backward produces gradients from the last layer to the first. Buckets are filled
  in that order, and the moment a bucket is complete its all-reduce starts asynchronously while
  autograd keeps computing the earlier layers' gradients. Only the last bucket's communication
  is left exposed at the end.

Buckets must be all-reduced in the same order on every rank (collectives match by order), so a
ready bucket waits until every bucket before it has been launched.

Gradient accumulation: inside `with ddp.no_sync():` backward only accumulates into the buckets;
the next backward outside it communicates the sum. Parameters that get no gradient in a step
(unused by the forward) still take part: their slots hold zeros, and their bucket is sent when
backward ends. Tied parameters (GPT's embedding and LM head) are one parameter and are reduced
once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from hplab.comm import Communicator

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class Bucket:
    """A flat gradient buffer for a few parameters, and the state of its all-reduce."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = 0  # how many of its params have their gradient for this backward
        self.pending = None  # the in-flight all-reduce

    def attach_grads(self) -> None:
        """Make each parameter's `.grad` the view of its slot in the buffer."""
        for p, view in zip(self.params, self.views):
            p.grad = view


def make_buckets(params: list[nn.Parameter], bucket_bytes: float) -> list[Bucket]:
    """Group parameters into buckets of at most `bucket_bytes` (a single parameter larger than
    that gets a bucket of its own), in reverse order of definition: roughly the order in which
    backward produces their gradients. `bucket_bytes=0` gives one bucket per parameter;
    `math.inf` one bucket for everything (the naive all-reduce after backward)."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(current))
    return buckets


class DataParallel(nn.Module):
    """Wrap `module` for data parallel training over the ranks of `comm` (the mesh's dp group).

    Use it like the module; after `loss.backward()`, call `finish_gradient_sync()` before the
    optimizer step, and `zero_grad()` instead of the optimizer's (the grads live in buckets).
    """

    def __init__(self, module: nn.Module, comm: Communicator,
                 bucket_bytes: float = DEFAULT_BUCKET_BYTES):
        super().__init__()
        self.module, self.comm = module, comm
        self.params = [p for p in module.parameters() if p.requires_grad]  # tied: listed once
        self._broadcast_from_rank0()
        self.buckets = make_buckets(self.params, bucket_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        self.sync_enabled = True
        for b in self.buckets:
            b.attach_grads()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        for t in list(self.params) + list(self.module.buffers()):
            self.comm.broadcast(t.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- during backward --
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Autograd has finished accumulating `param.grad`: if that completes its bucket, launch
        every bucket that is now ready, in order."""
        if not self.sync_enabled:
            return
        self.bucket_of[param].ready += 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self, force: bool = False) -> None:
        while self.next_to_launch < len(self.buckets):
            b = self.buckets[self.next_to_launch]
            if not force and b.ready < len(b.params):
                return
            b.buffer.div_(self.comm.size)  # average = sum of (grad / n)
            b.pending = self.comm.all_reduce(b.buffer, async_op=True)
            self.next_to_launch += 1

    # -- after backward --
    def finish_gradient_sync(self) -> None:
        """Send the buckets that never completed (unused parameters) and wait for all."""
        if not self.sync_enabled:
            return
        self._launch_ready_buckets(force=True)
        for b in self.buckets:
            b.pending.wait()
            b.pending, b.ready = None, 0
        self.next_to_launch = 0

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication (gradient accumulation)."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
            b.attach_grads()  # in case someone set a .grad to None

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params, "grads": [b.buffer for b in self.buckets]}

