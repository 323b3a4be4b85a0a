"""Lab 09: expert-parallel dispatch (one process: bookkeeping before the all-to-all)."""

from __future__ import annotations

import torch

from hplab.course.check.report import Report, differs

DISPATCH_CASES = [(16, 2, 4, 2), (37, 1, 8, 4), (20, 2, 8, 8), (9, 2, 4, 1), (6, 2, 8, 2)]


def _routing(T: int, k: int, E: int) -> tuple:
    """Expert indices [T, k] (k distinct experts a token, ties across tokens; with T·k < E some
    experts get nothing) and gates [T, k]."""
    g = torch.Generator().manual_seed(T * E + k)
    index = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    return index, torch.rand(T, k, generator=g, dtype=torch.float64)


def _order_problem(module, T, k, E, ep) -> str | None:
    index = _routing(T, k, E)[0]
    order = module.dispatch_order(index, E)
    expected = index.flatten().sort(stable=True).indices
    if order is None or sorted(order.tolist()) != list(range(T * k)):
        return f"T={T}, k={k}: not a permutation of the {T * k} (token, slot) positions"
    if not torch.equal(index.flatten()[order], index.flatten()[expected]):
        return f"T={T}, k={k}, E={E}: the positions are not grouped by expert, 0 first"
    return not torch.equal(order, expected) and (
        f"T={T}, k={k}, E={E}: within an expert keep token order (sort stably)"
    )


def _counts_problem(module, T, k, E, ep) -> str | None:
    index = _routing(T, k, E)[0]
    counts = module.send_counts(index, E, ep)
    got = None if counts is None else counts.tolist()
    per_expert = torch.bincount(index.flatten(), minlength=E)
    expected = per_expert.view(ep, E // ep).sum(dim=1).tolist()
    hint = (
        " — rank r holds experts r·E/ep … (r+1)·E/ep − 1, not e % ep"
        if got == per_expert.view(E // ep, ep).sum(dim=0).tolist()
        else " — count every (token, slot) pair: a token goes to k experts"
        if got is not None and k > 1 and sum(got) == T
        else ""
    )
    return got != expected and f"T={T}, k={k}, E={E}, ep={ep}: {got}, not {expected}{hint}"


def _combine_problem(module, T, k, E, ep) -> str | None:
    """Expert e computes x·(e+1) + e: the results, in the reference dispatch order, combined."""
    index, gates = _routing(T, k, E)
    x = torch.randn(T, 4, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
    order = index.flatten().sort(stable=True).indices
    expert = index.flatten()[order, None]
    per_slot = x[:, None, :] * (index[..., None] + 1) + index[..., None]  # [T, k, 4], ungated
    got = module.combine(x[order // k] * (expert + 1) + expert, order, gates)
    problem = differs(got, (gates[..., None] * per_slot).sum(dim=1))
    return problem and f"T={T}, k={k}: {problem}" + " — weight each result by its gate" * (
        got is not None and not differs(got, per_slot.sum(dim=1))
    )


def check_dispatch(module, report: Report) -> None:
    """dispatch_order, send_counts and combine against the reference over several routings."""
    for label, problem, success in (
        ("dispatch_order", _order_problem, "grouped by expert, token order within each"),
        ("send_counts", _counts_problem, "the pairs per destination rank"),
        ("combine", _combine_problem, "each token's gated sum of its k results"),
    ):
        report.check(
            label,
            (problem(module, *case) for case in DISPATCH_CASES),
            f"{success}, for {len(DISPATCH_CASES)} routings (T, k, E, ep)",
        )
