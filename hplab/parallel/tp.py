"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019), from scratch.

Data parallel copies the whole model to every rank. Tensor parallel cuts every weight matrix
across the T ranks of a group: each rank holds and multiplies 1/T of it, and the ranks exchange
activations inside every layer (so TP groups live on the fastest links, one node's GPUs).

**Two ways to cut a linear layer** Y = X·Aᵀ (A stored [out, in] as in `nn.Linear`):

* *Column parallel*: split the **outputs**. Rank r holds the rows A_r of A and computes
  Y_r = X·A_rᵀ, the r-th slice of Y's last dimension. It needs the whole X.
* *Row parallel*: split the **inputs**. Rank r holds the columns B_r of B and the r-th slice
  Y_r of its input; Y_r·B_rᵀ is a *partial sum*, and Z = Σ_r Y_r·B_rᵀ needs an all-reduce.

**Column then row: one all-reduce.** In the MLP Z = GeLU(X·Aᵀ)·Bᵀ, GeLU acts element by
element, so each rank applies it to its own Y_r: exactly the input a row-parallel B needs.
Nothing is exchanged between the matmuls: one all-reduce of Z (b·s·h numbers) in forward,
and its mirror image in backward, one all-reduce of X's gradient. Megatron names the pair

    f:  forward identity,    backward all-reduce    (before the column-parallel layer)
    g:  forward all-reduce,  backward identity      (after the row-parallel layer)

**Attention splits by heads**, independent until the output projection: rank r computes heads
r·H/T ... (r+1)·H/T - 1 completely (c_attn column parallel, c_proj row parallel: one
all-reduce). c_attn fuses [q | k | v] along its outputs, so a rank takes *its heads' rows of
each block*, not a contiguous third (which would hand rank 0 all of Q and none of V).

**The vocabulary is split too.** The embedding table [V, h] is cut by rows (each rank looks
up the ids in its range, an all-reduce adds the slices); the tied LM head is that matrix used
column parallel, so each rank ends with the logits of its V/T words, and the loss comes from
those slices with three all-reduces of b·s numbers, never gathering b·s·V logits. V is padded
up to a multiple of T; padding rows are never looked up, their logits masked out of the loss.

**Sequence parallel** (Korthikanti et al. 2022). Between the TP regions, layer norms (and
dropout) run replicated on the full activations: T copies of the same work and memory. Sequence
parallel cuts those along the *sequence*: each rank keeps s/T tokens of the residual stream; g
becomes a reduce-scatter (sum, keep my tokens), f an all-gather (everyone's tokens, before the
column-parallel matmul): together what one all-reduce moves, with T times less activation
memory. Parameters left whole (layer norms, row-parallel biases, position embeddings) see s/T
tokens per rank, so each rank's gradient is a partial sum: `parallelize` records it as Partial
over tp (`placement`) and a hook adds each backward's part over the group (section 3).

Collectives per transformer block, every payload b·s·h (b sequences of s tokens, hidden h):

                         forward                       backward
    tensor parallel      2 all-reduce                  2 all-reduce
    + sequence parallel  2 all-gather, 2 reduce-scatter 4 all-gather, 2 reduce-scatter

Every collective goes through the group's `Communicator` (`mesh.tp`), so the ledger counts it.
This file knows nothing of data parallel; `hplab.parallel.compose` composes the two."""

from __future__ import annotations

import fnmatch
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hplab.config import check_tensor_parallel
from hplab.parallel import grad_hooks, placement
from hplab.parallel.collectives import Communicator, communicator
from hplab.parallel.placement import Split
from hplab.runtime.group import new_group


class TensorParallelError(ValueError):
    """A model that cannot be split over this many tensor-parallel ranks, or a wrong plan."""


# --- 1. Moving tensors across the group (activations are [batch, sequence, hidden]) ----------


def _split(x: torch.Tensor, comm: Communicator, dim: int = -1, replicas: int = 1) -> torch.Tensor:
    """This rank's 1/T slice of `x` along `dim` (1/(T/replicas): `replicas` ranks hold each)."""
    if x.shape[dim] % (parts := comm.size // replicas):
        raise TensorParallelError(
            f"a dimension of {x.shape[dim]} does not split over {parts}"
            f" tensor-parallel ranks: make it a multiple of {parts}"
        )
    return x.chunk(parts, dim)[comm.rank // replicas].contiguous()


def _along(gather: bool, x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    """`_all_gather`: every rank's `x`, joined along `dim` (default: the sequence) in rank order.
    `_reduce_scatter`: the sum over ranks of `x`, of which this rank keeps its 1/T along `dim`."""
    first = x.movedim(dim, 0).contiguous()
    rows = first.shape[0] * comm.size if gather else first.shape[0] // comm.size
    out = first.new_empty((rows, *first.shape[1:]))
    (comm.all_gather if gather else comm.reduce_scatter)(out, first)
    return out.movedim(0, dim).contiguous()


_all_gather = functools.partial(_along, True)
_reduce_scatter = functools.partial(_along, False)
sequence_slice = _split  # this rank's s/T tokens of a [b, s] batch (sequence-parallel HF GPT-2)


def _all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out)
    return out


# --- 2. The conjugate operators: each backward is the other's forward ------------------------


class CopyToTensorParallel(torch.autograd.Function):
    """f: forward the identity, backward an all-reduce. Every rank multiplies the same X by its
    own column slice, so X's gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward an all-reduce, backward the identity. It sums a row-parallel layer's partial
    outputs; what follows is replicated on every rank, and so is its gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSequence(torch.autograd.Function):
    """Sequence parallel's f: forward gathers every rank's s/T tokens into all s; backward sums
    the gradients over the ranks and keeps this rank's s/T (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm), None


class ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel's g: forward sums the partial outputs and keeps this rank's s/T tokens
    (a reduce-scatter); backward gathers the gradient of all s."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm), None


class ReplicatedSequence(torch.autograd.Function):
    """Around a computation every rank repeats on all s tokens: `gather` joins the ranks' s/T
    tokens, else this rank keeps its s/T; backward does the other (its gradient is replicated)."""

    @staticmethod
    def forward(ctx, x, comm, gather: bool):
        ctx.comm = comm
        ctx.gather = gather
        return _all_gather(x, comm) if gather else _split(x, comm, 1)

    @staticmethod
    def backward(ctx, grad):
        grad = _split(grad, ctx.comm, 1) if ctx.gather else _all_gather(grad, ctx.comm)
        return grad, None, None


class LinearWithSequenceGather(torch.autograd.Function):
    """`GatherSequence` then a linear layer, saving only this rank's s/T tokens: autograd would
    keep the *gathered* input (all s tokens) for the weight gradient, undoing sequence parallel's
    saving. Backward gathers them again: one more all-gather for T times less activations."""

    @staticmethod
    def forward(ctx, x_slice, weight, bias, comm):
        ctx.save_for_backward(x_slice, weight)
        ctx.comm = comm
        ctx.has_bias = bias is not None
        return F.linear(_all_gather(x_slice, comm), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_slice, weight = ctx.saved_tensors
        x = _all_gather(x_slice, ctx.comm).flatten(0, -2)  # the tokens again, not kept
        grad_x = _reduce_scatter(grad_out @ weight, ctx.comm)
        grad_2d = grad_out.flatten(0, -2)  # [tokens, out]: dW = dYᵀ X
        return grad_x, grad_2d.t() @ x, grad_2d.sum(0) if ctx.has_bias else None, None


# --- 3. How a parameter is cut, and glued back -----------------------------------------------
# A `Split` (dim, fused blocks, vocabulary padding, K/V replicas) is kept in the parameter's
# placement record (hplab/parallel/placement.py), where the clip and the checkpoint read it.


def piece_of(full: torch.Tensor, split: Split, comm: Communicator) -> torch.Tensor:
    """This rank's piece of `full` (padded with zeros first if `split` says so): no message."""
    if split.full_size is not None:  # F.pad's pairs run from the last dimension back
        after = full.dim() - 1 - split.dim % full.dim()
        full = F.pad(full, (0, 0) * after + (0, -full.shape[split.dim] % comm.size))
    blocks = full.chunk(split.fused, split.dim)
    dim = split.dim
    return torch.cat([_split(b, comm, dim, split.replicas) for b in blocks], dim).clone()


def gather_full(local: torch.Tensor, split: Split, comm: Communicator) -> torch.Tensor:
    """The full tensor, rebuilt on every rank from every rank's piece (one all-gather)."""
    per_rank = _all_gather(local.detach(), comm, split.dim).chunk(comm.size, split.dim)
    per_rank = per_rank[:: split.replicas]  # one of each piece
    blocks = [
        torch.cat([r.chunk(split.fused, split.dim)[b] for r in per_rank], split.dim)
        for b in range(split.fused)
    ]
    full = torch.cat(blocks, split.dim)
    return full.narrow(split.dim, 0, split.full_size or full.shape[split.dim]).contiguous()


def is_split(p: torch.Tensor) -> bool:
    """Whether `p` is a piece of a bigger parameter (its placement record has a tp Split)."""
    return placement.of(p).split is not None


def cut(p: nn.Parameter | None, split: Split, comm: Communicator) -> nn.Parameter | None:
    """Keep only this rank's piece of parameter `p`, in place: the Parameter object stays the
    same, so a module tied to it (the LM head holds the embedding's) holds the piece too."""
    if p is not None and not is_split(p):
        placement.update(p, split=split, global_shape=tuple(p.shape))  # read by gather_full, clip
        p.data = piece_of(p.data, split, comm)
    return p


def sum_gradient_in_backward(p: nn.Parameter | None, comm: Communicator) -> None:
    """`p` is held alike by every rank of `comm`, but each rank's backward sees only part of its
    use (sequence parallel: its s/T tokens; a K/V head shared by several ranks: their query
    heads), so each rank's gradient is a partial sum. A hook adds every backward's part over
    `comm` before it accumulates into `p.grad`: the gradient is whole when `backward()` returns,
    in any loop, under DDP, ZeRO or fully_shard alike (each sees the whole gradient)."""
    if p is not None and p.requires_grad:  # (fully_shard's full-size parameter gets it too)
        grad_hooks.add(p, functools.partial(_all_reduce, comm=comm))


_REPLICA_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}  # ranks → their group, made once


def replica_comm(comm: Communicator, replicas: int) -> Communicator:
    """The `replicas` consecutive ranks of `comm` that hold this rank's piece alike (a K/V head
    shared by several ranks), as a Communicator named "tp_kv". Only those ranks create its
    group (`use_local_synchronization`): a tp group inside a bigger mesh needs no one else."""
    first = comm.rank // replicas * replicas
    ranks = comm.ranks[first : first + replicas]
    if len(ranks) == comm.size:  # every rank holds the same heads: the tp group itself
        return Communicator(comm.group, "tp_kv", comm.ledger, ranks, comm.device)
    group = _REPLICA_GROUPS.get(tuple(ranks))
    if group is None or not _registered(group):  # (a new process group since: make it again)
        group = _REPLICA_GROUPS[tuple(ranks)] = new_group(ranks, local=True)
    return Communicator(group, "tp_kv", comm.ledger, ranks, comm.device)


def _registered(group) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError):  # destroyed with the process group it belonged to
        return False
    return True


# --- 4. The parallel layers: `Layer(full_module, comm, sequence_parallel)` keeps my pieces ---
# Hugging Face's `Conv1D` stores its weight [in, out], not [out, in]: cut along the other dim.


class ColumnParallelLinear(nn.Module):
    """Splits the *outputs*: takes the full activations (with `sequence_parallel`, this rank's
    tokens, gathered here), returns my slice of the last dim; `fused` blocks (Q|K|V) cut each."""

    def __init__(self, linear, comm: Communicator, sequence_parallel=False, fused=1, replicas=1):
        super().__init__()
        self.in_out = type(linear).__name__ == "Conv1D"
        self.weight = cut(linear.weight, Split(int(self.in_out), fused, None, replicas), comm)
        self.bias = cut(linear.bias, Split(0, fused, None, replicas), comm)
        self.comm = comm
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.in_out else self.weight
        if self.sequence_parallel:
            return LinearWithSequenceGather.apply(x, weight, self.bias, self.comm)
        return F.linear(CopyToTensorParallel.apply(x, self.comm), weight, self.bias)


class RowParallelLinear(nn.Module):
    """Splits the *inputs*: takes a column-parallel slice; the partial products are summed over
    the group (reduce-scattered along the sequence with `sequence_parallel`), then the bias."""

    def __init__(self, linear: nn.Module, comm: Communicator, sequence_parallel=False):
        super().__init__()
        self.in_out = type(linear).__name__ == "Conv1D"
        self.weight = cut(linear.weight, Split(0 if self.in_out else 1), comm)
        self.bias = linear.bias
        self.comm = comm
        self.sequence_parallel = sequence_parallel

    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x_slice, self.weight.t() if self.in_out else self.weight)
        reduce = ReduceScatterSequence if self.sequence_parallel else ReduceFromTensorParallel
        return reduce.apply(partial, self.comm) + (0 if self.bias is None else self.bias)


class VocabParallelEmbedding(nn.Module):
    """The table [V, h] cut by rows: this rank looks up the ids in [r·V/T, (r+1)·V/T), zeros
    for the others; the sum over the group (or reduce-scatter) completes every lookup. A model
    handed only its s/T ids (`given_slice`, HF GPT-2) all-gathers them first (b·s integers)."""

    def __init__(self, embedding, comm: Communicator, sequence_parallel=False, given_slice=False):
        super().__init__()
        split = Split(0, full_size=embedding.weight.shape[0])  # V, padded to a multiple of T
        self.weight = cut(embedding.weight, split, comm)
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.given_slice = given_slice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.given_slice and self.sequence_parallel:
            ids = _all_gather(ids, self.comm, -1)
        local = ids - self.comm.rank * self.weight.shape[0]
        not_mine = (local < 0) | (local >= self.weight.shape[0])
        vectors = F.embedding(local.masked_fill(not_mine, 0), self.weight)
        vectors = vectors.masked_fill(not_mine.unsqueeze(-1), 0.0)
        reduce = ReduceScatterSequence if self.sequence_parallel else ReduceFromTensorParallel
        return reduce.apply(vectors, self.comm)


class SequenceParallelPositions(nn.Module):
    """The whole position table, looked up for my s/T tokens under sequence parallel: hplab's GPT
    passes positions 0 … s−1 (keep my slice); a `given_slice` model 0 … s/T − 1 (add r·s/T)."""

    def __init__(self, embedding, comm: Communicator, sequence_parallel=False, given_slice=False):
        super().__init__()
        self.weight = embedding.weight
        self.comm = comm
        self.sp = sequence_parallel
        self.shift = given_slice

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if self.sp:
            pos = pos + self.comm.rank * pos.shape[-1] if self.shift else _split(pos, self.comm)
        return F.embedding(pos, self.weight)


def vocab_parallel_cross_entropy(logits, targets, comm, vocab_size: int) -> torch.Tensor:
    """The mean cross-entropy, from each rank's slice of the logits [..., V/T] (`comm`: the tp
    group, as a Communicator, a ProcessGroup or None for the world, like `parallelize`):
    loss = log Σ_v exp(z_v) − z_target, with three all-reduces of b·s numbers:
      1. m = max_v z_v            all-reduce(max): a constant shift for stability, no gradient
      2. S = Σ_v exp(z_v − m)     each rank sums its slice; all-reduce (g)
      3. z_target − m             on the rank owning the target id, 0 on the others; all-reduce (g)
    Vocabulary padding (ids ≥ `vocab_size`) is masked to −∞: exp(−∞) = 0, no gradient."""
    comm = communicator(comm, "tp")
    width = logits.shape[-1]
    first_id = comm.rank * logits.shape[-1]
    padding = torch.arange(first_id, first_id + width, device=logits.device) >= vocab_size
    logits = logits.float().masked_fill(padding, float("-inf"))
    with torch.no_grad():
        max_logit = logits.max(dim=-1).values
        comm.all_reduce(max_logit, op=dist.ReduceOp.MAX)
    shifted = logits - max_logit.unsqueeze(-1)
    sum_exp = ReduceFromTensorParallel.apply(shifted.exp().sum(dim=-1), comm)
    local_target = targets - first_id
    not_mine = (local_target < 0) | (local_target >= width)
    picked = shifted.gather(-1, local_target.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = ReduceFromTensorParallel.apply(picked.masked_fill(not_mine, 0.0), comm)
    return (sum_exp.log() - target_logit).mean()


# --- 5. Plans: module names (fnmatch patterns; "" is the model itself) → styles ---------------
# A style: any callable (module, comm, sequence_parallel) → the module that takes its place (a
# layer above), or a fix that changes the module in place and returns it. Where to cut is data:
# each model's plan lives with the model (hplab/models/), the styles they share in
# hplab/models/tp_styles.py.


def parallelize(model: nn.Module, group, plan: dict, sequence_parallel: bool = False):
    """Cut `model` (the same whole model on every rank) over `group` as `plan` says, entry by
    entry (each must match a module), in place; each rank keeps its pieces under the same names."""
    comm = communicator(group, "tp")
    c = getattr(model, "config", None)
    if heads := getattr(c, "n_head", None) or getattr(c, "num_attention_heads", None):  # (HF's)
        seq_len = getattr(c, "n_positions", None) if sequence_parallel else None
        kv = getattr(c, "kv_heads", None) or getattr(c, "num_key_value_heads", None)
        width = getattr(c, "n_embd", None) or c.hidden_size
        check_tensor_parallel(heads, width, comm.size, seq_len, kv_heads=kv)
    names = [name for name, _ in model.named_modules()]
    matches = {pattern: fnmatch.filter(names, pattern) for pattern in plan}
    if missing := [pattern for pattern, found in matches.items() if not found]:
        raise TensorParallelError(  # (before any cut: never a model cut halfway)
            f"the plan names {missing[0]!r}, but {type(model).__name__}"
            f" has no module matching it (it has {names[1:4]}, ...)"
        )
    already_cut = {p for p in model.parameters() if is_split(p)}
    kv_comms = {}  # replicas → the Communicator over this rank's K/V replicas (one per count)
    for pattern, style in plan.items():
        for name in matches[pattern]:
            old = model.get_submodule(name)
            if (new := style(old, comm, sequence_parallel)) is not old:
                model.set_submodule(name, new)
    for p in model.parameters():  # whole on every rank, from s/T tokens: a partial gradient
        unsaid = placement.of(p).tp_grad is None  # (a mixture of experts' is whole, see above)
        if sequence_parallel and not is_split(p) and unsaid:
            placement.update(p, tp_grad=placement.Partial())
            sum_gradient_in_backward(p, comm)  # (summed in backward: whole in any loop)
        replicas = placement.of(p).kv_replicas  # a K/V head held by several ranks, cut now
        if replicas > 1 and p not in already_cut:
            if replicas not in kv_comms:
                kv_comms[replicas] = replica_comm(comm, replicas)
            sum_gradient_in_backward(p, kv_comms[replicas])
    return model
