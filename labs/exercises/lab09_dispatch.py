"""Lab 09 exercise: the bookkeeping of expert-parallel dispatch.

A router sent each of this rank's T tokens to k experts: `expert_index[t, j]` is token t's
j-th expert, `gates[t, j]` its weight. The E experts are split over ep ranks, E/ep each: rank r
holds experts r·E/ep … (r+1)·E/ep − 1. Before the all-to-all that moves the tokens, a rank must
lay them out so each destination's tokens are contiguous, and tell every rank how many to expect:

    1. order   = the (token, slot) pairs sorted by expert — a permutation of the T·k positions
                 of expert_index.flatten(), keeping token order within each expert (so
                 capacity limits drop the later tokens, and the layout is reproducible);
    2. counts  = how many of those pairs go to each rank: the all-to-all's send counts
                 (exchanged first, in their own small all-to-all, so receivers can allocate);
    3. combine = after the experts ran and the results came back in the same order, put each
                 result back at its token and add the k results weighted by their gates.

Implement the three functions, then check them:

    python -m hplab.check dispatch                 # checks this file
    python -m hplab.check dispatch path/to/yours.py
"""

import torch


def dispatch_order(expert_index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[T·k] int64: positions in expert_index.flatten(), expert 0's first, each expert's in
    token order."""
    raise NotImplementedError("sort the flattened expert indices, stably")


def send_counts(expert_index: torch.Tensor, n_experts: int, ep_size: int) -> torch.Tensor:
    """[ep_size] int64: how many (token, slot) pairs go to each rank."""
    raise NotImplementedError("count the pairs per expert, then per rank")


def combine(results: torch.Tensor, order: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """[T, h]: `results[i]` [T·k, h] is the expert output for pair order[i]; gates is [T, k]."""
    raise NotImplementedError("un-permute the results, weight them by their gates, sum over k")
