"""Lab 02 exercise: gradient all-reduce in buckets, overlapped with backward.

Implement `BucketedAllReduce`, then check it on 2 real processes against the gradient of the
whole global batch computed by one process:

    python -m hplab.check buckets                 # checks this file
    python -m hplab.check buckets path/to/yours.py

How the checker uses it, on every rank (each rank has a different half of the batch):

    sync = BucketedAllReduce(list(model.parameters()), comm, bucket_bytes)
    for step in range(2):
        model.zero_grad()                 # PyTorch's default: every .grad becomes None
        loss = model(x_mine, y_mine)[1]
        loss.backward()                   # your hooks launch all-reduces in here
        sync.wait()                       # afterwards: p.grad = average over the ranks

It checks (with bucket_bytes = infinity, 0 and a size in between):
  * every p.grad equals the single-process gradient of the global batch (fp32, 1e-5);
  * the all-reduces you have started — how many, how many bytes — each time a gradient
    arrives, when backward returns and after wait(), against the rule below: bucket j starts
    from the gradient hook that completes it (once buckets 0 ... j-1 have started), so it
    overlaps with the rest of backward; each gradient is sent exactly once;
  * that backward goes on while they run: the check runs under an emulated link (hplab.runtime.link;
    every all-reduce takes at least 1 ms there, as on a network), and a hook that waits for
    an all-reduce — however it waits — stops backward until the link has carried it.

The bucket rule (the same as hplab/parallel/ddp.py): walk the parameters in *reverse* order
(backward produces the last layers' gradients first); start a new bucket when adding the next
parameter would make the current one larger than `bucket_bytes`; a parameter larger than that gets a
bucket of its own. So bucket_bytes = 0 means one bucket per parameter, infinity one bucket.

Tools:
  * `p.register_post_accumulate_grad_hook(fn)`: autograd calls fn(p) once p.grad is complete.
  * `comm.all_reduce(flat, async_op=True)` sums `flat` over the ranks in place and returns a
    handle; `handle.wait()` blocks until it is done. `comm.size` is the number of ranks.
  * `torch.cat([g.reshape(-1) for g in grads])` packs gradients into one flat tensor.
Buckets must be launched in the same order on every rank: collectives match by call order.
"""

import torch


class BucketedAllReduce:
    def __init__(self, params: list[torch.nn.Parameter], comm, bucket_bytes: float):
        self.comm = comm
        self.buckets = []  # lists of parameters, in the order backward fills them
        # 1. make the buckets with the rule above
        # 2. register a post-accumulate-grad hook on every parameter that notes its gradient
        #    is ready and, when its bucket is complete (and the buckets before it have started),
        #    packs the bucket's gradients into one flat tensor, divides it by comm.size and
        #    starts an asynchronous all-reduce
        raise NotImplementedError("make the buckets and register the gradient hooks")

    def wait(self) -> None:
        """Wait for every bucket's all-reduce and write the averages back into each p.grad;
        then get ready for the next step."""
        raise NotImplementedError("wait for the all-reduces and unpack them into p.grad")
