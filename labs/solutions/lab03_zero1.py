"""Lab 03 exercise (reference solution): the ZeRO-1 optimizer step.

Check it with `python -m hplab.check zero1 labs/solutions/lab03_zero1.py`.
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
        n = self.comm.size
        # 1. every rank's local gradients in one padded flat buffer, pre-divided by n
        grads = torch.zeros(self.padded_numel, device=self.device)
        grads[: self.numel] = torch.cat([p.grad.reshape(-1) for p in self.params])
        grads /= n
        # 2. reduce-scatter: I receive the sum over ranks of my shard only = my shard of the
        #    global-batch average gradient
        my_grad = torch.empty(self.shard_numel, device=self.device)
        self.comm.reduce_scatter(my_grad, grads)
        self.master.grad = my_grad
        # 3. the optimizer touches my shard only: 1/n of the work and of the Adam state
        self.optimizer.step()
        # 4. all-gather the updated shards and write them back into the model's parameters
        flat = torch.empty(self.padded_numel, device=self.device)
        self.comm.all_gather(flat, self.master.detach().clone())
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
