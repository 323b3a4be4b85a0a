"""Lab 09 solution: expert-parallel dispatch bookkeeping (see exercises/)."""

import torch


def dispatch_order(expert_index, n_experts):
    return torch.sort(expert_index.flatten(), stable=True).indices


def send_counts(expert_index, n_experts, ep_size):
    per_expert = torch.bincount(expert_index.flatten(), minlength=n_experts)
    return per_expert.view(ep_size, n_experts // ep_size).sum(dim=1)


def combine(results, order, gates):
    T, k = gates.shape
    by_pair = torch.empty_like(results)
    by_pair[order] = results  # pair order[i]'s result back at its place in the flat layout
    return (by_pair.view(T, k, -1) * gates[..., None]).sum(dim=1)
