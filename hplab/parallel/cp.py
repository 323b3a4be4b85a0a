"""Context parallel: one long sequence split over the N ranks of a `cp` group, from scratch.

Activations grow with the sequence length s. Context parallel splits the *sequence itself* over
N ranks: each embeds, norms, projects and runs the MLP on its s/N tokens only, with its own copy
of every weight (so gradients average, and ZeRO shards, over the dp × cp ranks together: the
mesh's `dp_cp` group, as Megatron and torchtitan do). Only attention needs the other
tokens: each query, the keys and values of every earlier one. Two ways to give it them:

**Ring attention** (Liu et al. 2023). Each rank starts with its own K/V block and, N times,
computes its queries against the block it holds, hands that block to the next rank and takes one
from the previous; the next block's send/recv is posted *before* computing on the current one,
so the transfer runs under the compute where the backend allows. Each block gives a partial
result O_j = softmax(Q·K_jᵀ/√d)·V_j and, per query, its log-sum-exp L_j = log Σ exp(scores);
two partials merge exactly (the online softmax of FlashAttention):

    L = log(e^L_a + e^L_b),     O = e^(L_a - L)·O_a + e^(L_b - L)·O_b

Backward is a second ring: the K/V blocks travel again, each with the dK/dV accumulator of its
tokens, to which every rank adds its queries' share (computed while the accumulator is on its
way); one more hop brings each accumulator home.
Probabilities are recomputed from the saved L (nothing s×s is kept). Messages per layer and
step: `formulas.ring_attention_bytes`.

**The causal mask, and the split.** A block of keys later than every query is skipped; the
rank's own block (the diagonal) is causal; an earlier block is attended in full. Cut into N
contiguous pieces, rank r does r + ½ blocks of work: the last 2N−1 times the first's, and
everyone waits for it. The **zig-zag** split cuts 2N chunks and gives rank r chunks r and
2N-1-r, one early, one late: against a lower rank's block all its queries see that block's
early chunk, against a higher rank's only its late chunk sees the whole block. Half a block, on
every rank, every step: the work evens out (Megatron-LM, Llama 3).

**Ulysses** (Jacobs et al. 2023). An all-to-all turns [b, heads, s/N, d] (all heads, my tokens)
into [b, heads/N, s, d] (my heads, all tokens); ordinary causal attention runs on whole
sequences; a second all-to-all turns the result back; backward, the reverse all-to-alls. It
moves less than the ring, but needs the heads to divide by N. Every message goes through the
group's `Communicator` (`mesh.cp`): the ledger counts it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hplab.config import check_context_parallel
from hplab.parallel.collectives import AllToAll, Communicator, communicator

# --- 1. The split: which tokens each rank holds -------------------------------------------


def positions(seq_len: int, rank: int, size: int, split: str = "zigzag") -> torch.Tensor:
    """The positions in the whole sequence of the tokens rank `rank` of `size` holds, in order."""
    chunks = [rank, 2 * size - 1 - rank] if split == "zigzag" else [rank]
    width = seq_len // (2 * size if split == "zigzag" else size)
    return torch.cat([torch.arange(c * width, (c + 1) * width) for c in chunks])


def tokens_of(x: torch.Tensor, rank: int, size: int, split: str = "zigzag", dim: int = 1):
    """This rank's tokens of `x` (the whole sequence along `dim`)."""
    return x.index_select(dim, positions(x.shape[dim], rank, size, split).to(x.device))


def join_tokens(pieces: list[torch.Tensor], split: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The inverse: every rank's tokens (in rank order) put back into sequence order."""
    seq_len = sum(t.shape[dim] for t in pieces)
    order = torch.cat([positions(seq_len, r, len(pieces), split) for r in range(len(pieces))])
    return torch.cat(pieces, dim).index_select(dim, order.argsort().to(pieces[0].device))


# --- 2. One block of attention, its log-sum-exp, and the merge -----------------------------


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:  # query i sees keys 0..i (a diagonal block: the same positions on both sides)
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    return scores


def block_attention(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries `q` over one block of keys/values: (output, log-sum-exp per query)."""
    scores = _scores(q, k, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key sets → the attention over their union."""
    new_lse = torch.logaddexp(lse, block_lse)
    return (
        out * torch.exp(lse - new_lse).unsqueeze(-1)
        + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    ), new_lse


def block_attention_backward(q, k, v, d_out, lse, delta, causal: bool):
    """FlashAttention's backward of one block: probabilities recomputed from the saved `lse`;
    `delta` = rowsum(dO ∘ O) is the softmax's correction. Returns (dQ, dK, dV) of the block."""
    p = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))
    d_scores = p * (d_out @ v.transpose(-2, -1) - delta.unsqueeze(-1)) * q.shape[-1] ** -0.5
    return d_scores @ k, d_scores.transpose(-2, -1) @ q, p.transpose(-2, -1) @ d_out


def block_work(rank: int, src: int, size: int, split: str, n: int):
    """Which of this rank's `n` queries attend to which keys of rank `src`'s block, and whether
    causally: (query rows, key columns, causal), or None for a block wholly in the future."""
    everything = slice(None)
    if src == rank:
        return everything, everything, True  # the diagonal block
    if split == "contiguous":
        return (everything, everything, False) if src < rank else None
    early = slice(0, n // 2)  # zig-zag: chunks r and 2N-1-r
    late = slice(n // 2, None)
    return (everything, early, False) if src < rank else (late, everything, False)


def pairs_computed(rank: int, size: int, split: str, n: int) -> int:
    """Query-key pairs one head of one sequence really attends on this rank in ring attention
    (the causal diagonal counted as n(n+1)/2): the work whose imbalance the zig-zag evens."""
    total = 0
    for src in range(size):
        if work := block_work(rank, src, size, split, n):
            rows, cols = (len(range(n)[part]) for part in work[:2])
            total += rows * (rows + 1) // 2 if work[2] else rows * cols
    return total


# --- 3. The ring ---------------------------------------------------------------------------
# Grouped-query attention (a Llama's): the ring carries only the K/V heads, n_head/n_kv_head
# times fewer bytes; each block is widened to the query heads where it is used, and its dK/dV
# summed back over each group of query heads before it travels on.


def _widen(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [b, kv_heads, n, d] → [b, heads, n, d]: query head j reads K/V head j // group."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _narrow(d_kv: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse for gradients: each K/V head's is the sum over the query heads that read it."""
    return d_kv.unflatten(1, (kv_heads, -1)).sum(2)


def _pass_on(t: torch.Tensor, comm: Communicator):
    """Post the send of `t` to the next rank and a receive from the previous one, together
    (every rank sends while it receives: posted apart, NCCL's sends could wait for each other
    around the ring): (the buffer being filled, the two pending operations)."""
    buffer = torch.empty_like(t)
    me = comm.rank
    n = comm.size
    return buffer, comm.send_and_recv([("send", t, (me + 1) % n), ("recv", buffer, (me - 1) % n)])


def _around_the_ring(kv: torch.Tensor, comm: Communicator):
    """Yield (src, the K/V block of rank src) N times, starting with our own; each next block
    is already travelling while the caller computes on the current one."""
    for step in range(comm.size):
        last = step == comm.size - 1
        next_kv, pending = (kv, []) if last else _pass_on(kv, comm)
        yield (comm.rank - step) % comm.size, kv
        for p in pending:
            p.wait()
        kv = next_kv


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's q, k, v [b, heads, s/N, d] (its tokens of the `split`)
    against every rank's keys and values, passed around the ring (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Communicator, split: str):
        dtype = q.dtype  # blocks travel in q's dtype, math runs in fp32
        out = None
        lse = None
        for src, kv in _around_the_ring(torch.stack([k, v]), comm):  # one message: K and V
            if work := block_work(comm.rank, src, comm.size, split, q.shape[2]):
                rows, cols, causal = work
                block_out, block_lse = block_attention(
                    q[:, :, rows].float(),
                    _widen(kv[0][:, :, cols].float(), q.shape[1]),
                    _widen(kv[1][:, :, cols].float(), q.shape[1]),
                    causal,
                )
                if out is None:  # step 0: our own block, every query (so no -inf to merge)
                    out = block_out
                    lse = block_lse
                else:
                    out[:, :, rows], lse[:, :, rows] = merge(
                        out[:, :, rows], lse[:, :, rows], block_out, block_lse
                    )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm = comm
        ctx.split = split
        return out.to(dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm = ctx.comm
        dtype = d_out.dtype
        q, d_out = q.float(), d_out.float()
        delta = (d_out * out).sum(-1)
        dq = torch.zeros_like(q)
        received = torch.zeros_like(torch.stack([k, v]))  # dK/dV of the block we hold
        arriving = []  # the next block's dK/dV on its way: it travels with the block
        for src, kv in _around_the_ring(torch.stack([k, v]), comm):
            d_kv = _block_gradients(q, kv, d_out, lse, delta, dq, comm, src, ctx.split)
            for p in arriving:  # (it travelled while this block's gradients were computed)
                p.wait()
            dkv = received
            if d_kv is not None:
                rows, cols = d_kv[0]
                dkv[0][:, :, cols] += d_kv[1].to(dtype)  # (summed in q's dtype, as it travels)
                dkv[1][:, :, cols] += d_kv[2].to(dtype)
            received, arriving = _pass_on(dkv, comm)  # after N hops each accumulator is home
        for p in arriving:
            p.wait()
        return dq.to(dtype), received[0].to(dtype), received[1].to(dtype), None, None


def _block_gradients(q, kv, d_out, lse, delta, dq, comm, src: int, split: str):
    """The backward of this rank's queries against rank `src`'s block: adds to dq in place and
    returns ((rows, cols), dK, dV) of the block, or None where the block is wholly in the
    future."""
    if not (work := block_work(comm.rank, src, comm.size, split, q.shape[2])):
        return None
    rows, cols, causal = work
    dq_b, dk_b, dv_b = block_attention_backward(
        q[:, :, rows],
        _widen(kv[0][:, :, cols].float(), q.shape[1]),
        _widen(kv[1][:, :, cols].float(), q.shape[1]),
        d_out[:, :, rows],
        lse[:, :, rows],
        delta[:, :, rows],
        causal,
    )
    dq[:, :, rows] += dq_b
    return (rows, cols), _narrow(dk_b, kv.shape[2]), _narrow(dv_b, kv.shape[2])


def ring_attention(q, k, v, comm: Communicator, split: str = "zigzag") -> torch.Tensor:
    """Causal attention over the whole sequence, of this rank's tokens [b, heads, s/N, d]."""
    return (
        RingAttention.apply(q, k, v, comm, split)
        if comm.size > 1
        else F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )


# --- 4. Ulysses: all-to-all to whole sequences of a share of the heads ----------------------


def _all_to_all(x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int):
    """Piece j of `x` along `scatter_dim` goes to rank j; the pieces received, one per rank in
    rank order, are joined along `gather_dim` (backward: the reverse exchange)."""
    pieces = torch.stack(x.chunk(comm.size, scatter_dim))  # piece j in row j
    return torch.cat(AllToAll.apply(pieces, comm).unbind(0), gather_dim)


def ulysses_attention(q, k, v, comm: Communicator, split: str = "zigzag") -> torch.Tensor:
    """Causal attention of this rank's tokens [b, heads, s/N, d]: q, k, v go to [b, heads/N,
    s, d] (one all-to-all for the three), SDPA runs on whole sequences, an all-to-all returns."""
    check_context_parallel(q.shape[2] * comm.size, q.shape[1], comm.size, "ulysses", split)
    k, v = _widen(k, q.shape[1]), _widen(v, q.shape[1])  # (GQA: every query head's K/V moves)
    by_rank = torch.cat(
        [positions(q.shape[2] * comm.size, r, comm.size, split) for r in range(comm.size)]
    ).to(q.device)  # as the tokens arrive
    qkv = _all_to_all(torch.stack([q, k, v]), comm, 2, 3)  # [3, b, heads/N, s, d]
    q, k, v = qkv.index_select(3, by_rank.argsort())  # into sequence order
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _all_to_all(y.index_select(2, by_rank), comm, 2, 1)  # rank order, home


# --- 5. Making the GPT context-parallel ----------------------------------------------------


def parallelize(model, group, style: str = "ring", split: str = "zigzag"):
    """Make hplab's GPT or Llama, or a transformers decoder, context-parallel over `group`, in
    place: every attention runs `style`, and the positions (GPT-2's embedding, a Llama's RoPE)
    are this rank's tokens' true ones (the caller hands each rank its tokens with `tokens_of` and
    averages gradients over the group)."""
    comm = communicator(group, "cp")
    if not hasattr(model, "attentions"):  # transformers' own model
        return _parallelize_hugging_face(model, comm, style, split)
    heads = model.attentions()[0].n_head  # this tensor-parallel rank's query heads
    check_context_parallel(model.config.n_positions, heads, comm.size, style, split)
    attend = ring_attention if style == "ring" else ulysses_attention
    for attention in model.attentions():
        attention.attend = functools.partial(attend, comm=comm, split=split)
    model.position_ids = lambda n, device=None: positions(  # torch.arange's place: n local
        n * comm.size, comm.rank, comm.size, split
    ).to(device)  # tokens' true positions
    return model


def _parallelize_hugging_face(model, comm: Communicator, style: str, split: str):
    """A transformers decoder (Llama, Qwen2, ...): its attention function becomes `style` over
    `comm` (registered with transformers' AttentionInterface; the causal mask it builds for the
    local tokens is ignored: the ring knows the true positions), and each forward is handed
    `position_ids`, the true positions of the tokens this rank holds, for RoPE."""
    from transformers import AttentionInterface

    c = model.config
    check_context_parallel(
        c.max_position_embeddings, c.num_attention_heads, comm.size, style, split
    )
    attend = functools.partial(
        ring_attention if style == "ring" else ulysses_attention, split=split
    )
    name = f"hplab-{style}-{split}-{comm.rank}-of-{comm.size}"
    AttentionInterface.register(  # [b, heads, s/N, d] in; HF wants [b, s/N, heads, d] back
        name, lambda module, q, k, v, mask, **_: (attend(q, k, v, comm).transpose(1, 2), None)
    )
    model.set_attn_implementation(name)

    def true_positions(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        where = positions(ids.shape[1] * comm.size, comm.rank, comm.size, split).to(ids.device)
        return args, {**kwargs, "position_ids": where.expand(ids.shape[0], -1)}

    model.register_forward_pre_hook(true_positions, with_kwargs=True)
    return model
