"""Mixture of experts (MoE) and expert parallel, from scratch.

**The layer.** An MoE MLP holds E *experts*, each an ordinary GPT-2 MLP, and a *router*, one
linear layer h → E. Each token goes to only k of the experts, so the model has E times the MLP
parameters but each token costs only k MLPs of compute:

    p     = softmax(router(x))                 probabilities over the E experts, per token
    g, e  = top-k(p)                            the k chosen experts and their gates
    g     = g / Σ g   (renormalise, default)    Mixtral and GShard's top-2; Switch (k=1) keeps p
    y     = Σ_j g_j · expert_{e_j}(x)

**Keeping the experts busy.** A router left alone sends most tokens to a few experts. The
Switch / GShard auxiliary loss pushes towards balance; with f_e the fraction of token-slots
routed to expert e (counted, no gradient) and P_e the mean probability the router gives e,

    balance = E · Σ_e f_e · P_e            (1 when perfectly balanced)

Here f_e is counted over the whole batch (one all-reduce of E numbers over dp, and over cp
when context parallel splits each sequence, as Megatron's "global" aux loss), so the loss does
not depend on how the batch is split over ranks — only on how it is split into microbatches:
each microbatch counts its own f_e, so a run with m microbatches of B/m sequences matches one
process with the same microbatches. DeepSeek-V3's *sequence-wise* balance loss
(`balance="sequence"`, Megatron's "seq_aux_loss") counts f_e and P_e per sequence and averages
the sequences' losses: one sequence's tokens are all it sees (summed over cp, which splits a
sequence), so it is the same in every layout and every microbatching. The optional router
z-loss (ST-MoE), mean over tokens of logsumexp(router logits)², keeps the logits small.
`aux_loss` holds aux_coef · balance + z_coef · z; the model adds it.

**Dropless, or a capacity.** By default every token reaches its k experts. With a capacity
factor cf, each expert takes at most capacity = ceil(cf · T · k / E) of a rank's T·k
token-slots; the rest are dropped (the residual connection still carries the token). Which
drop: slots in position order (token by token, a token's first choice before its second),
the latest beyond the capacity.

**Expert parallel.** Over an `ep` group of ranks (each with its own tokens, as in data
parallel), rank r keeps experts [r·E/ep, (r+1)·E/ep). A layer *dispatches* its token-slots,
sorted by expert, to their experts' ranks with all-to-alls and *combines* the results with the
gates (`run_experts`, step by step); autograd runs through the exchanges (an all-to-all's
backward is the reverse all-to-all). An expert's replicas live on the ranks with the same ep
coordinate (the expert-data-parallel group, dp/ep ranks): `hplab.DDP(model, dp,
expert_group=edp)` averages expert gradients there, in backward, and everything else over the
whole dp group (ZeroOptimizer: the experts in a param group with `shard_over=edp`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from hplab.config import check_balance, check_experts, check_top_k
from hplab.parallel import placement
from hplab.parallel.collectives import AllToAll, communicator


class MoE(nn.Module):
    """E experts (`make_expert()` each, single-device names `experts.0` … `experts.E-1`) and a
    top-k router. `capacity_factor` 0: dropless. After a forward, `aux_loss` holds the weighted
    auxiliary losses and `routing` what this rank routed (`RoutingStats` reads it)."""

    def __init__(
        self,
        n_embd: int,
        n_experts: int,
        top_k: int,
        make_expert,
        capacity_factor: float = 0.0,
        aux_coef: float = 0.01,
        z_coef: float = 0.0,
        renormalize: bool = True,
        balance: str = "batch",
    ):
        super().__init__()
        check_top_k(n_experts, top_k)
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.aux_coef = aux_coef
        self.z_coef = z_coef
        self.renormalize = renormalize
        self.per_sequence = check_balance(balance) == "sequence"
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        # a dict keyed by the expert's global number: under ep a rank keeps some, names unchanged
        self.experts = nn.ModuleDict({str(e): make_expert() for e in range(n_experts)})
        for p in self.experts.parameters():
            placement.update(p, expert=True)  # replicated over the expert-data-parallel group only
        self.ep = None  # the expert-parallel Communicator (None: every expert is here)
        self.counted_over = []  # the groups f_e is summed over (none: these tokens are the batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, h]
        T = tokens.shape[0]
        E = self.n_experts
        k = self.top_k
        logits = self.router(tokens)
        probs = logits.float().softmax(dim=-1)  # [T, E]
        gates, chosen = probs.topk(k, dim=-1)  # [T, k] each
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        slot_expert = chosen.flatten()  # token-slot s = t·k + j: token t's j-th choice
        kept = self.within_capacity(slot_expert, T)
        # stable sort by expert: each expert's slots contiguous, in position order
        order = torch.argsort(slot_expert.masked_fill(~kept, E), stable=True)[: int(kept.sum())]
        slot_token = order.div(k, rounding_mode="floor")
        per_expert = torch.bincount(slot_expert[order], minlength=E)
        outputs = self.run_experts(tokens[slot_token], per_expert.tolist())
        combined = torch.zeros_like(tokens).index_add(
            0, slot_token, outputs * gates.flatten()[order, None].to(outputs.dtype)
        )

        sequences = x.shape[0] if self.per_sequence and x.dim() == 3 else 1  # x: [b, s, h]
        self.aux_loss = self.auxiliary_loss(logits, probs, slot_expert, sequences)
        self.routing = dict(tokens_per_expert=per_expert, dropped=int((~kept).sum()), slots=T * k)
        return combined.view_as(x)

    def within_capacity(self, slot_expert: torch.Tensor, T: int) -> torch.Tensor:
        """Which token-slots their expert takes: all, or each expert's first `capacity`."""
        if self.capacity_factor <= 0:
            return torch.ones_like(slot_expert, dtype=torch.bool)
        capacity = math.ceil(min(self.capacity_factor * T * self.top_k / self.n_experts, T))
        one_hot = nn.functional.one_hot(slot_expert, self.n_experts)
        place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1)  # 1 for an expert's first slot
        return place <= capacity

    def auxiliary_loss(self, logits, probs, slot_expert, sequences: int = 1) -> torch.Tensor:
        """aux_coef · E · Σ_e f_e · P_e  +  z_coef · mean(logsumexp(logits)²); per sequence
        (the mean of `sequences` such losses) or over all these tokens (`sequences` = 1)."""
        E = self.n_experts
        T = probs.shape[0]
        group_of_slot = (
            torch.arange(T * self.top_k, device=probs.device) * sequences // (T * self.top_k)
        )  # token-slots are in sequence order: the first T·k/b belong to sequence 0, ...
        routed = torch.bincount(group_of_slot * E + slot_expert, minlength=sequences * E)
        tokens = probs.new_full((sequences, 1), T // sequences)  # each group's tokens here
        counts = torch.cat([routed.view(sequences, E).to(probs.dtype), tokens], 1).detach()
        for group in self.counted_over:  # f_e over the whole batch, or the whole sequence
            group.all_reduce(counts)
        f = counts[:, :-1] / (counts[:, -1:] * self.top_k)
        shares = probs.view(sequences, -1, E).mean(dim=1)  # P_e of each sequence's tokens here
        balance = E * (f * shares).sum(dim=1).mean()
        z = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        return self.aux_coef * balance + self.z_coef * z

    def run_experts(self, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Each expert's rows of `x` (sorted by expert, `per_expert[e]` rows for expert e)
        through that expert: here, or dispatched over the ep group and combined back."""
        if self.ep is None:
            return torch.cat(
                [self.experts[str(e)](rows) for e, rows in enumerate(x.split(per_expert))]
            )
        n = self.ep.size
        local = self.n_experts // self.ep.size
        # 1. counts: rank j learns how many rows of each of its experts every rank sends
        send = torch.tensor(per_expert, device=x.device)
        recv = torch.empty_like(send)
        self.ep.all_to_all_single(recv, send)
        recv = recv.view(n, local).tolist()  # [source rank][local expert]
        send_rows = [sum(per_expert[j * local : (j + 1) * local]) for j in range(n)]
        recv_rows = [sum(row) for row in recv]
        # 2. dispatch: the rows themselves; they arrive by source rank, then by expert
        arrived = AllToAll.apply(x, self.ep, recv_rows, send_rows)
        pieces = arrived.split([c for row in recv for c in row])
        first = self.ep.rank * local
        # 3. each local expert on its rows from every source, then back into arrival order
        outs = [self.experts[str(first + e)](torch.cat(pieces[e::local])) for e in range(local)]
        by_expert = [out.split([row[e] for row in recv]) for e, out in enumerate(outs)]
        results = torch.cat([by_expert[e][r] for r in range(n) for e in range(local)])
        # 4. combine: results return to the ranks their tokens came from
        return AllToAll.apply(results, self.ep, send_rows, recv_rows)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def parallelize(model: nn.Module, ep=None, dp=None, cp=None) -> nn.Module:
    """Expert parallel over `ep` (None or one rank: all experts here): each MoE layer keeps its
    E/ep experts and frees the others; the balance loss counts tokens over `dp` (the whole
    data-parallel group, of which ep is a part) and `cp` (the ranks that share each sequence);
    a sequence-wise one over `cp` only. Each group is what `communicator()` takes (an hplab
    Communicator, a torch ProcessGroup or a DeviceMesh of one dimension), or None: no such
    group. Returns `model`. Averaging the gradients is data parallel's:
    `hplab.DDP(model, dp, expert_group=edp)` (DDP without it, fully_shard, and a ZeroOptimizer
    without an edp group for the experts, refuse experts shared out over ep)."""
    ep = group_or_none(ep, "ep")
    dp = group_or_none(dp, "dp")
    cp = group_or_none(cp, "cp")
    for layer in moe_layers(model):
        groups = (cp,) if layer.per_sequence else (dp, cp)
        layer.counted_over = [g for g in groups if g is not None and g.size > 1]
        if ep is None or ep.size == 1:
            continue
        check_experts(layer.n_experts, ep.size, dp.size if dp else ep.size)
        local = layer.n_experts // ep.size
        mine = range(ep.rank * local, (ep.rank + 1) * local)
        layer.experts = nn.ModuleDict({str(e): layer.experts[str(e)] for e in mine})
        layer.ep = ep
        for p in layer.experts.parameters():  # (no wrapper may average them over all of dp)
            placement.update(p, expert_parallel=ep.size)
    return model


def group_or_none(group, name: str):
    """`group` as a Communicator (`communicator()`), None kept: here None means no such group,
    not the whole world."""
    return None if group is None else communicator(group, name)


def is_expert(p: torch.Tensor) -> bool:
    return placement.of(p).expert
