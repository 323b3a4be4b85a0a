"""Lab 04 exercise: column- and row-parallel linear layers with the conjugate operators f, g.

Implement the four classes below, then check them on 2 real processes against one process
that runs the whole MLP:

    python -m hplab.check tp_linear                 # checks this file
    python -m hplab.check tp_linear path/to/yours.py

How the checker uses them, on every rank (T = comm.size ranks, the same X on every rank):

    fc, proj = nn.Linear(h, 4h), nn.Linear(4h, h)          # the full layers, same seed
    column = ColumnParallelLinear(fc, comm)                 # keeps its slice of fc
    row = RowParallelLinear(proj, comm)                     # keeps its slice of proj
    Z = row(F.gelu(column(X)))                              # Z: the full output, every rank
    (Z * R).sum().backward()

The Megatron MLP: column parallel, then row parallel, nothing exchanged in between (GeLU acts
element by element on this rank's slice of the hidden units).

  * f = `CopyToTP`: forward identity; backward all-reduce of the gradient (every rank used X,
    so X's gradient is the sum of all ranks' contributions). Used on the column layer's input.
  * g = `ReduceFromTP`: forward all-reduce (sum of the partial products); backward identity.
    Used on the row layer's output, *before* adding the bias (add it once, not T times).
  * `ColumnParallelLinear`: `self.weight` = this rank's rows of fc.weight [out, in] (out/T of
    them, rank 0 the first), `self.bias` = the same slice of fc.bias.
  * `RowParallelLinear`: `self.weight` = this rank's columns of proj.weight (in/T of them),
    `self.bias` = the whole proj.bias.
  Make weights and biases `nn.Parameter`s (copies: `full.weight.detach()[...].clone()`).
  `comm.all_reduce(t)` sums `t` over the ranks in place; `comm.size`, `comm.rank`.
  Inside `torch.autograd.Function`: `forward(ctx, x, comm)` and `backward(ctx, grad)`, which
  returns one gradient per forward input (`None` for comm); keep comm in `ctx.comm`.

The checker compares (fp32, 1e-5): Z; X.grad; every weight and bias gradient with its slice of
the single-process gradient; and the CommLedger: exactly one all-reduce of Z's size in forward
and one in backward — 2 all-reduces of b·s·h per MLP, as in the Megatron paper.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401 (yours to use: F.linear)


class CopyToTP(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("f: forward is the identity (keep comm for backward)")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("f: backward all-reduces the gradient")


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("g: forward all-reduces the partial sums")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("g: backward is the identity")


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, comm):
        super().__init__()
        raise NotImplementedError("keep this rank's rows of full.weight and full.bias")

    def forward(self, x):
        raise NotImplementedError("f, then this rank's slice of the outputs")


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, comm):
        super().__init__()
        raise NotImplementedError("keep this rank's columns of full.weight, all of full.bias")

    def forward(self, x_slice):
        raise NotImplementedError("partial product, g, then the bias once")
