"""Lab 03 exercise: the ZeRO-1 optimizer step.

Implement `ZeRO1.step`, then check it on 2 real processes against one process that trains the
same model on the whole global batch with an ordinary AdamW:

    python -m hplab.check zero1                 # checks this file
    python -m hplab.check zero1 path/to/yours.py

How the checker uses it, on every rank (each rank has a different half of the batch):

    opt = ZeRO1(list(model.parameters()), comm, lr=1e-2)
    for step in range(3):
        model.zero_grad()
        model(x_mine, y_mine)[1].backward()   # p.grad: the gradient of MY half only
        opt.step()                            # afterwards: every rank has the same new params

`__init__` is written for you: the parameters laid end to end in one flat buffer, padded with
zeros to n equal shards of `shard_numel` elements; rank r owns shard r, and `self.master` is
its fp32 copy — the only tensor the AdamW optimizer knows, so its state (exp_avg, exp_avg_sq)
is 8 bytes × shard_numel instead of 8 bytes × all parameters. That is ZeRO stage 1.

`step` does the three moves of ZeRO-1:
  1. pack every p.grad into one flat buffer of `padded_numel` elements (zeros in the padding)
     and divide it by n (the loss is a mean over the global batch);
  2. `comm.reduce_scatter(out, flat)`: `out` (shard_numel elements) receives the sum over
     the ranks of slice r of `flat` — my shard of the global-batch gradient; make it
     `self.master.grad` and call `self.optimizer.step()`;
  3. `comm.all_gather(full, self.master.detach().clone())`: `full` (padded_numel elements)
     receives every rank's updated shard in rank order; copy it back into each p
     (under torch.no_grad(): `p.copy_(full[offset:offset + p.numel()].view_as(p))`).

The checker compares, after each of 3 steps: every parameter with the single-process AdamW
(fp32, 1e-5 relative), `self.master.grad` with your shard of the global-batch gradient, the
optimizer state size (shard only), and the CommLedger: one reduce-scatter and one all-gather of
the padded flat buffer per step and no all-reduce — 2(n−1)/n · 4Ψ bus bytes, as DDP.
"""

import math

import torch


class ZeRO1:
    """AdamW whose state is split over the ranks: rank r keeps and updates only its 1/n of
    the parameters (its *shard*), and the ranks exchange gradients and parameters."""

    def __init__(self, params: list[torch.nn.Parameter], comm, lr: float):
        self.params, self.comm = list(params), comm
        n, r = comm.size, comm.rank
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = math.ceil(self.numel / n)  # pad the flat buffer to n equal shards
        self.padded_numel = self.shard_numel * n
        self.device = self.params[0].device
        flat = torch.zeros(self.padded_numel, device=self.device)
        flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        mine = slice(r * self.shard_numel, (r + 1) * self.shard_numel)
        self.master = torch.nn.Parameter(flat[mine].clone())  # my shard, what the optimizer steps
        self.optimizer = torch.optim.AdamW([self.master], lr=lr, weight_decay=0.0, foreach=False)

    @torch.no_grad()
    def step(self) -> None:
        # 1. pack the gradients into a padded flat buffer and divide by n
        # 2. reduce-scatter it into my shard's gradient; step the optimizer on self.master
        # 3. all-gather the updated shards and copy them back into the parameters
        raise NotImplementedError("reduce-scatter the gradients, step my shard, all-gather")
