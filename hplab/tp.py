"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019), from scratch.

Data parallel copies the whole model to every rank. Tensor parallel instead cuts every weight
matrix of every layer across the T ranks of a tensor-parallel group, so each rank holds and
multiplies only 1/T of it. The ranks then have to exchange activations inside every layer —
which is why TP groups live on the fastest links (the GPUs of one node).

**Two ways to cut a linear layer** Y = X·Aᵀ (A stored [out, in] as in `nn.Linear`):

* *Column parallel*: split the **outputs**. Rank r holds the rows A_r of A and computes
  Y_r = X·A_rᵀ, the r-th slice of Y's last dimension. It needs the whole X.
* *Row parallel*: split the **inputs**. Rank r holds the columns B_r of B and the r-th slice
  Y_r of its input; Y_r·B_rᵀ is a *partial sum*, and Z = Σ_r Y_r·B_rᵀ needs an all-reduce.

**Column then row: one all-reduce.** The MLP is Z = GeLU(X·Aᵀ)·Bᵀ. GeLU acts element by
element, so it can be applied to each rank's slice Y_r independently; the slice Y_r is exactly
the input a row-parallel B needs. Nothing is exchanged between the two matmuls, and the whole
MLP costs one all-reduce of Z (b·s·h numbers) in forward. In backward, the mirror image: the
gradient of X is a sum of every rank's contribution, one all-reduce. Megatron names the pair

    f:  forward identity,    backward all-reduce    (before the column-parallel layer)
    g:  forward all-reduce,  backward identity      (after the row-parallel layer)

**Attention splits by heads.** Heads are independent until the output projection, so rank r
computes heads r·H/T ... (r+1)·H/T - 1 completely: c_attn is column parallel, c_proj row
parallel, and attention costs one all-reduce too. c_attn fuses Q, K and V ([q | k | v] along
its outputs), so a rank takes *its heads' rows from each of the three blocks*, not a plain
contiguous third of the matrix (which would hand rank 0 all of Q and none of V).

**The vocabulary is split too.** The embedding table [V, h] is cut by rows: rank r looks up
only the ids in its range, writes zeros for the others, and an all-reduce adds the slices. The
LM head is the same (tied) matrix used column parallel, so each rank ends with the logits of
its V/T words — and the loss is computed from those slices with three all-reduces of b·s
numbers (max, sum of exponentials, target logit) instead of ever gathering b·s·V logits. V is
padded up to a multiple of T when needed; the padding rows are never looked up and their
logits are masked out of the softmax, so they never change the loss.

**Sequence parallel** (Korthikanti et al. 2022). Between the TP regions, layer norms (and
dropout, which this GPT does not use) run on the full activations, replicated on every rank —
T copies of the same work and memory. Sequence parallel cuts those along the *sequence*
instead: each rank keeps s/T tokens of the residual stream. The all-reduce g becomes a
reduce-scatter (sum, then keep my tokens), and f becomes an all-gather (collect everyone's
tokens before the column-parallel matmul). A reduce-scatter plus an all-gather move exactly
what one all-reduce moves, so the bandwidth is unchanged while activation memory drops by T.
The column-parallel layer keeps only its token slice for backward and gathers it again there.
Parameters that are not split (layer norms, row-parallel biases, position embeddings) now see
only s/T tokens on each rank, so their gradients are partial sums: add them over the group.

Collectives per transformer block, every payload b·s·h (b sequences of s tokens, hidden h):

                         forward                       backward
    tensor parallel      2 all-reduce                  2 all-reduce
    + sequence parallel  2 all-gather, 2 reduce-scatter 4 all-gather, 2 reduce-scatter

Every collective goes through the group's `Communicator` (`mesh.tp`), so the ledger counts it.
This file knows nothing of data parallel; `hplab.parallel` composes the two.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hplab.comm import Communicator


class TensorParallelError(ValueError):
    """A model that cannot be split over this many tensor-parallel ranks."""


# --- 1. Moving tensors across the group ------------------------------------------------------

def _split(x: torch.Tensor, dim: int, comm: Communicator) -> torch.Tensor:
    """This rank's 1/T slice of `x` along `dim`."""
    if x.shape[dim] % comm.size:
        raise TensorParallelError(
            f"a dimension of {x.shape[dim]} does not split over tp={comm.size} ranks: "
            "make it a multiple of --tp (for --sequence-parallel: --seq-len)")
    return x.chunk(comm.size, dim)[comm.rank].contiguous()


def _all_gather(x: torch.Tensor, dim: int, comm: Communicator) -> torch.Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order."""
    first = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = first.new_empty((comm.size * first.shape[0], *first.shape[1:]))
    comm.all_gather(out, first)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Communicator) -> torch.Tensor:
    """The sum over ranks of `x`, of which this rank keeps its 1/T slice along `dim`."""
    if x.shape[dim] % comm.size:
        raise TensorParallelError(
            f"a sequence of {x.shape[dim]} tokens does not split over tp={comm.size} ranks: "
            "with --sequence-parallel make --seq-len a multiple of --tp")
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((first.shape[0] // comm.size, *first.shape[1:]))
    comm.reduce_scatter(out, first)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out)
    return out


# --- 2. The conjugate operators: each backward is the other's forward ------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """f — forward identity, backward all-reduce. Every rank uses the same X in a different
    column slice, so X's gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g — forward all-reduce, backward identity. Sums the partial outputs of a row-parallel
    layer; what follows is replicated, so every rank already holds the full gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SplitLastDim(torch.autograd.Function):
    """Keep my slice of the last dimension; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split(x, -1, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.comm), None


class GatherLastDim(torch.autograd.Function):
    """All-gather the slices of the last dimension; backward keeps my slice of the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, -1, comm)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.comm), None


SEQUENCE_DIM = 1  # activations are [batch, sequence, hidden]


class GatherSequence(torch.autograd.Function):
    """Sequence parallel's f — forward all-gather along the sequence (each rank had s/T tokens,
    now all s), backward reduce-scatter (sum the gradients, keep my tokens')."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, SEQUENCE_DIM, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.comm), None


class ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel's g — forward reduce-scatter along the sequence (sum the partial
    outputs, keep my s/T tokens), backward all-gather."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(x, SEQUENCE_DIM, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQUENCE_DIM, ctx.comm), None


class LinearWithSequenceGather(torch.autograd.Function):
    """`GatherSequence` followed by a linear layer, saving only this rank's s/T tokens.

    Written out by hand because autograd would keep the *gathered* input (all s tokens) for
    the weight gradient, undoing sequence parallel's memory saving. Backward gathers the
    tokens again: one more all-gather for T times less activation memory."""

    @staticmethod
    def forward(ctx, x_slice, weight, bias, comm):
        ctx.save_for_backward(x_slice, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return F.linear(_all_gather(x_slice, SEQUENCE_DIM, comm), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_slice, weight = ctx.saved_tensors
        x = _all_gather(x_slice, SEQUENCE_DIM, ctx.comm)  # the tokens again, not kept
        grad_x = _reduce_scatter(grad_out @ weight, SEQUENCE_DIM, ctx.comm)
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = grad_2d.t() @ x.reshape(-1, x.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


# --- 3. How a parameter is cut, and glued back -----------------------------------------------

@dataclass(frozen=True)
class Split:
    """Where a tensor-parallel parameter comes from: the full tensor cut along `dim`.

    `fused` > 1: the full tensor is that many blocks side by side along `dim` (c_attn's
    Q | K | V) and each block is cut separately. `full_size`: the size along `dim` before
    padding it to a multiple of T (the vocabulary), or None when no padding was needed."""

    dim: int
    fused: int = 1
    full_size: int | None = None


def shard(full: torch.Tensor, split: Split, comm: Communicator) -> torch.Tensor:
    """This rank's piece of `full` (padded with zeros first if `split` says so)."""
    if split.full_size is not None:
        size = full.shape[split.dim]
        extra = math.ceil(size / comm.size) * comm.size - size
        dims_after = full.dim() - 1 - split.dim % full.dim()  # F.pad counts from the last dim
        full = F.pad(full, [0, 0] * dims_after + [0, extra])
    blocks = full.chunk(split.fused, split.dim)
    return torch.cat([_split(b, split.dim, comm) for b in blocks], split.dim).clone()


def unshard(local: torch.Tensor, split: Split, comm: Communicator) -> torch.Tensor:
    """The full tensor, rebuilt on every rank from every rank's piece (one all-gather)."""
    per_rank = _all_gather(local.detach(), split.dim, comm).chunk(comm.size, split.dim)
    blocks = [torch.cat([r.chunk(split.fused, split.dim)[b] for r in per_rank], split.dim)
              for b in range(split.fused)]
    full = torch.cat(blocks, split.dim)
    if split.full_size is not None:
        full = full.narrow(split.dim, 0, split.full_size)
    return full.contiguous()


def _sharded_parameter(full: torch.Tensor, split: Split, comm: Communicator) -> nn.Parameter:
    p = nn.Parameter(shard(full.detach(), split, comm))
    p.tp_split = split  # read by unshard/clipping: this parameter is a piece of a bigger one
    return p


def is_split(p: torch.Tensor) -> bool:
    return getattr(p, "tp_split", None) is not None


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face GPT-2's `Conv1D`: a linear layer whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D"


# --- 4. The parallel layers ------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """A linear layer whose *outputs* are split: this rank computes its slice of them.

    Input: the full activations (or, with `sequence_parallel`, this rank's tokens, gathered
    here). Output: this rank's slice of the last dimension, or all of it with `gather_output`.
    `in_out`: the weight is stored [in, out] (Hugging Face `Conv1D`) instead of [out, in]."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Communicator,
                 sequence_parallel: bool = False, gather_output: bool = False,
                 in_out: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.gather_output, self.in_out = gather_output, in_out

    @classmethod
    def from_full(cls, linear: nn.Module, comm: Communicator, fused: int = 1, **kwargs):
        """Cut an `nn.Linear` (or `Conv1D`) by its outputs; `fused` blocks cut separately."""
        in_out = _is_conv1d(linear)
        weight = _sharded_parameter(linear.weight, Split(1 if in_out else 0, fused), comm)
        bias = None if linear.bias is None else _sharded_parameter(linear.bias, Split(0, fused),
                                                                   comm)
        return cls(weight, bias, comm, in_out=in_out, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.in_out else self.weight
        if self.sequence_parallel:
            y = LinearWithSequenceGather.apply(x, weight, self.bias, self.comm)
        else:
            y = F.linear(CopyToTensorParallel.apply(x, self.comm), weight, self.bias)
        return GatherLastDim.apply(y, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """A linear layer whose *inputs* are split: the input arrives already sliced along its
    last dimension (the output of a column-parallel layer) and the partial products are
    summed across the group (reduce-scattered along the sequence with `sequence_parallel`).
    The bias is not split: it is added once, after the sum."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Communicator,
                 sequence_parallel: bool = False, in_out: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.comm, self.sequence_parallel, self.in_out = comm, sequence_parallel, in_out

    @classmethod
    def from_full(cls, linear: nn.Module, comm: Communicator, **kwargs):
        """Cut an `nn.Linear` (or `Conv1D`) by its inputs; the bias stays whole."""
        in_out = _is_conv1d(linear)
        weight = _sharded_parameter(linear.weight, Split(0 if in_out else 1), comm)
        return cls(weight, linear.bias, comm, in_out=in_out, **kwargs)

    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.in_out else self.weight
        partial = F.linear(x_slice, weight)
        if self.sequence_parallel:
            y = ReduceScatterSequence.apply(partial, self.comm)
        else:
            y = ReduceFromTensorParallel.apply(partial, self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding table cut by rows: this rank holds the vectors of ids
    [r·V/T, (r+1)·V/T). It looks up the ids it owns, writes zeros for the others, and the sum
    over the group (all-reduce, or reduce-scatter along the sequence) completes every lookup."""

    def __init__(self, weight: nn.Parameter, comm: Communicator, sequence_parallel: bool = False):
        super().__init__()
        self.weight, self.comm, self.sequence_parallel = weight, comm, sequence_parallel
        self.first_id = comm.rank * weight.shape[0]

    @classmethod
    def from_full(cls, embedding: nn.Embedding, comm: Communicator, **kwargs):
        vocab_size = embedding.weight.shape[0]
        split = Split(0, full_size=vocab_size if vocab_size % comm.size else None)
        return cls(_sharded_parameter(embedding.weight, split, comm), comm, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_id
        not_mine = (local < 0) | (local >= self.weight.shape[0])
        vectors = F.embedding(local.masked_fill(not_mine, 0), self.weight)
        vectors = vectors.masked_fill(not_mine.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return ReduceScatterSequence.apply(vectors, self.comm)
        return ReduceFromTensorParallel.apply(vectors, self.comm)


class SequenceSlicedEmbedding(nn.Embedding):
    """Position embeddings under sequence parallel: the whole (replicated) table, but only the
    positions of this rank's s/T tokens are looked up."""

    def __init__(self, embedding: nn.Embedding, comm: Communicator):
        super().__init__(*embedding.weight.shape)
        self.weight, self.comm = embedding.weight, comm

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(_split(positions, -1, self.comm))


class OffsetPositionEmbedding(nn.Embedding):
    """Position embeddings for a model handed only this rank's s/T tokens (Hugging Face GPT-2
    under sequence parallel): the model numbers them 0 … s/T − 1, but they sit at positions
    r·s/T … (r+1)·s/T − 1 of the sequence. The whole (replicated) table is kept."""

    def __init__(self, embedding: nn.Embedding, comm: Communicator):
        super().__init__(*embedding.weight.shape)
        self.weight, self.comm = embedding.weight, comm

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions + self.comm.rank * positions.shape[-1])


class VocabParallelEmbeddingOfSlices(VocabParallelEmbedding):
    """A sequence-parallel `VocabParallelEmbedding` for a model handed only this rank's s/T
    token ids: it first all-gathers the ids along the sequence (b·s integers, no gradient), so
    the vocabulary shards can look every token up before reduce-scattering back to s/T."""

    def forward(self, ids_slice: torch.Tensor) -> torch.Tensor:
        return super().forward(_all_gather(ids_slice, -1, self.comm))


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 comm: Communicator, vocab_size: int) -> torch.Tensor:
    """The mean cross-entropy, from each rank's slice of the logits [..., V/T].

    loss = log Σ_v exp(z_v) − z_target, computed in slices:
      1. m = max_v z_v            all-reduce(max) of b·s numbers — for numerical stability;
                                  a constant shift, so no gradient flows through it
      2. S = Σ_v exp(z_v − m)     each rank sums its slice; all-reduce (g) of b·s numbers
      3. z_target − m             only the rank owning the target id has it, the others
                                  contribute 0; all-reduce (g) of b·s numbers
    Vocabulary padding (ids ≥ `vocab_size`) is masked to −∞: exp(−∞) = 0, no gradient.
    """
    logits = logits.float()
    width = logits.shape[-1]
    first_id = comm.rank * width
    ids = torch.arange(first_id, first_id + width, device=logits.device)
    if first_id + width > vocab_size:
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
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


def gather_vocab(logits: torch.Tensor, comm: Communicator, vocab_size: int) -> torch.Tensor:
    """All the logits [..., V] from every rank's slice (for inspection and tests: training
    never needs them), padding removed."""
    return _all_gather(logits.detach(), -1, comm)[..., :vocab_size]


# --- 5. A GPT under tensor parallel ----------------------------------------------------------

def check_divisible(n_head: int, n_embd: int, tp: int, seq_len: int | None = None) -> None:
    """Raise TensorParallelError unless a model with these sizes splits over `tp` ranks."""
    if tp > n_head:
        raise TensorParallelError(
            f"--tp {tp} is larger than the model's {n_head} attention heads: attention is split "
            f"by heads, so use at most --tp {n_head}")
    if n_head % tp:
        raise TensorParallelError(
            f"the model's {n_head} attention heads do not split over --tp {tp}: use a --tp that "
            f"divides {n_head} (or change --n-head)")
    if n_embd % tp:
        raise TensorParallelError(
            f"hidden size n_embd={n_embd} does not split over --tp {tp}: use a --tp that "
            f"divides {n_embd} (or change --n-embd)")
    if seq_len is not None and seq_len % tp:
        raise TensorParallelError(
            f"--sequence-parallel cuts the {seq_len}-token sequence over --tp {tp}: make "
            "--seq-len a multiple of --tp")


def parallelize_gpt(model: nn.Module, comm: Communicator, sequence_parallel: bool = False):
    """Cut an hplab GPT across the ranks of `comm`, in place, and return it.

    Every rank must pass the same full model (same seed): each keeps its own slices. Parameter
    names do not change, so `full_state_dict` gives back the single-device checkpoint.
    `model(idx, targets)` then returns this rank's slice of the logits [B, T, V/T] and the
    full loss (identical on every rank of the group)."""
    config = model.config
    check_divisible(config.n_head, config.n_embd, comm.size,
                    config.n_positions if sequence_parallel else None)
    sp = dict(sequence_parallel=sequence_parallel)
    body = model.transformer
    body.wte = VocabParallelEmbedding.from_full(body.wte, comm, **sp)
    model.lm_head = ColumnParallelLinear(body.wte.weight, None, comm, **sp)  # still tied
    if sequence_parallel:
        body.wpe = SequenceSlicedEmbedding(body.wpe, comm)
    for block in body.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear.from_full(attn.c_attn, comm, fused=3, **sp)
        attn.c_proj = RowParallelLinear.from_full(attn.c_proj, comm, **sp)
        attn.n_head = config.n_head // comm.size  # this rank's heads
        mlp.c_fc = ColumnParallelLinear.from_full(mlp.c_fc, comm, **sp)
        mlp.c_proj = RowParallelLinear.from_full(mlp.c_proj, comm, **sp)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, comm=comm,
                                      vocab_size=config.vocab_size)
    return model


def parallelize_hf_gpt2(model: nn.Module, comm: Communicator, sequence_parallel: bool = False):
    """Cut a Hugging Face `GPT2LMHeadModel` across the ranks of `comm`, in place.

    Its projections are `Conv1D` (weight [in, out]) and c_attn fuses Q, K, V — the layers
    PyTorch's own tensor parallel refuses. Here they are cut like hplab's, along the other
    dimension. `model(ids).logits` is then this rank's vocabulary slice; compute the loss
    with `vocab_parallel_cross_entropy` (HF's own loss would see only the slice).

    With `sequence_parallel`, HF's forward, which sizes positions, the causal mask and its
    output by the ids it is given, is given only this rank's s/T ids (`sequence_slice(ids,
    comm)`): the embedding gathers the ids, positions are offset by the rank, and attention
    sees the whole sequence after c_attn's all-gather — causal through PyTorch's
    scaled-dot-product attention (HF's "sdpa", with no padding mask). The logits come back
    for the whole sequence, as without sequence parallel."""
    config = model.config
    check_divisible(config.n_head, config.n_embd, comm.size)
    if sequence_parallel and config._attn_implementation != "sdpa":
        raise TensorParallelError(
            f"sequence parallel needs the model built with attn_implementation='sdpa' (it has "
            f"{config._attn_implementation!r}): HF sizes an explicit causal mask by the s/T "
            "tokens a rank is given, not by the whole sequence attention sees")
    sp = dict(sequence_parallel=sequence_parallel)
    body = model.transformer
    embedding = VocabParallelEmbeddingOfSlices if sequence_parallel else VocabParallelEmbedding
    body.wte = embedding.from_full(body.wte, comm, **sp)
    model.lm_head = ColumnParallelLinear(body.wte.weight, None, comm, **sp)  # still tied
    if sequence_parallel:
        body.wpe = OffsetPositionEmbedding(body.wpe, comm)
    for block in body.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear.from_full(attn.c_attn, comm, fused=3, **sp)
        attn.c_proj = RowParallelLinear.from_full(attn.c_proj, comm, **sp)
        attn.num_heads //= comm.size
        attn.embed_dim //= comm.size
        attn.split_size //= comm.size  # HF splits c_attn's output into q, k, v by this width
        mlp.c_fc = ColumnParallelLinear.from_full(mlp.c_fc, comm, **sp)
        mlp.c_proj = RowParallelLinear.from_full(mlp.c_proj, comm, **sp)
    return model


def sequence_slice(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's s/T tokens of a [b, s] batch (what a sequence-parallel HF GPT-2 is given)."""
    return _split(x, -1, comm)


@torch.no_grad()
def sync_sequence_parallel_grads(params, comm: Communicator) -> None:
    """Under sequence parallel, each rank's replicated parameters saw only its s/T tokens:
    sum their gradients over the group (one all-reduce of all of them, flattened).
    `params`: a model or a list of its parameters."""
    params = params.parameters() if isinstance(params, nn.Module) else params
    grads = [p.grad for p in params if not is_split(p) and p.grad is not None]
    if not grads or comm.size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def grad_norm_squared(params: list[nn.Parameter], grads: list[torch.Tensor | None],
                      comm: Communicator) -> float:
    """The squared L2 norm of the *whole* model's gradient, from this rank's `grads` (one per
    parameter of `params`, e.g. fp32 master gradients): the pieces of split parameters summed
    over the group, replicated parameters counted once (not T times)."""
    pieces = whole = 0.0
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if is_split(p):
            pieces += float(g.float().pow(2).sum())
        else:
            whole += float(g.float().pow(2).sum())
    return comm.all_reduce_scalar(pieces + (whole if comm.rank == 0 else 0.0))


@torch.no_grad()
def full_state_dict(model: nn.Module, comm: Communicator) -> dict[str, torch.Tensor]:
    """The single-device state dict (same names, full shapes), rebuilt on every rank."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = unshard(p, p.tp_split, comm) if is_split(p) else p.detach().clone()
    return out


@torch.no_grad()
def full_grads(model: nn.Module, comm: Communicator) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by name (for checking against one process)."""
    return {name: unshard(p.grad, p.tp_split, comm) if is_split(p) else p.grad.clone()
            for name, p in model.named_parameters() if p.grad is not None}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor],
                         comm: Communicator) -> None:
    """Load a single-device checkpoint into a tensor-parallel model: each rank keeps its
    pieces."""
    for name, p in model.named_parameters():
        full = state_dict[name].to(p.device, p.dtype)
        p.copy_(shard(full, p.tp_split, comm) if is_split(p) else full)
