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
        opt.step()

`__init__` is written for you: the parameters laid end to end in one flat buffer of
`padded_numel` elements (zeros at the end), cut into n equal shards of `shard_numel`; rank r
owns shard r, and `self.master` is its fp32 copy — the only tensor the AdamW optimizer knows,
so Adam's state is 8 bytes × shard_numel instead of 8 bytes × all parameters.

What `step` must achieve: afterwards every rank's parameters are what one AdamW step on the
whole global batch gives, while this rank's optimizer only ever sees its shard (the global
batch's loss is the mean over the ranks' halves). The ranks talk only through `comm`, an
hplab Communicator (hplab/parallel/collectives.py: collectives, as torch.distributed's, on tensors).

How it is checked, after each of 3 steps: every parameter against the single-process AdamW
(fp32, 1e-5 relative); `self.master.grad` against this rank's shard of the global-batch
average gradient; Adam's state holds 2 × shard_numel numbers; and the CommLedger: exactly one
reduce-scatter and one all-gather of the padded flat buffer (4 × padded_numel bytes) per step,
nothing else — 2(n−1)/n · 4Ψ bus bytes, the same as DDP's all-reduce.
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
        """One AdamW step of the whole model, this rank stepping only its shard."""
        raise NotImplementedError("ZeRO1.step")
