"""Lab 04 exercise (reference solution): column- and row-parallel linear layers with the
conjugate operators f and g.

Check it with `python -m hplab.check tp_linear labs/solutions/lab04_tp_linear.py`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CopyToTP(torch.autograd.Function):
    """f: forward identity; backward all-reduce (each rank's slice of the layer used the same X,
    so X's gradient is the sum of every rank's contribution)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce (sum the partial products); backward identity (the output is the
    same on every rank, so is its gradient)."""

    @staticmethod
    def forward(ctx, x, comm):
        x = x.clone()
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """Rank r keeps rows r·out/T ... of the weight [out, in] (and the bias): its slice of
    the outputs. Input: the full X. Output: this rank's slice of the last dimension."""

    def __init__(self, full: nn.Linear, comm):
        super().__init__()
        self.comm = comm
        rows = full.out_features // comm.size
        mine = slice(comm.rank * rows, (comm.rank + 1) * rows)
        self.weight = nn.Parameter(full.weight.detach()[mine].clone())
        self.bias = nn.Parameter(full.bias.detach()[mine].clone())

    def forward(self, x):
        return F.linear(CopyToTP.apply(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank r keeps columns r·in/T ... of the weight [out, in]; the bias stays whole and is
    added once, after the partial products are summed."""

    def __init__(self, full: nn.Linear, comm):
        super().__init__()
        self.comm = comm
        cols = full.in_features // comm.size
        mine = slice(comm.rank * cols, (comm.rank + 1) * cols)
        self.weight = nn.Parameter(full.weight.detach()[:, mine].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x_slice):
        return ReduceFromTP.apply(F.linear(x_slice, self.weight), self.comm) + self.bias
