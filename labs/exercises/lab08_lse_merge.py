"""Lab 08 exercise: merge two partial attention results with the log-sum-exp rule.

Ring attention never holds all the keys at once. Each step, a rank attends its queries to one
block of keys and values and gets a *partial* result for that block:

    out_j = softmax(S_j) @ V_j          S_j = Q K_jᵀ / √d   (the scores against block j)
    lse_j = log Σ_k exp(S_j[:, k])      (one number per query: the block's softmax denominator)

Attention over all the keys is a weighted mix of the partials, each weighted by its share of
the whole denominator:

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a − lse) · out_a + exp(lse_b − lse) · out_b

Implement `merge`, then check it against attention over all keys at once:

    python -m hplab.check lse_merge                 # checks this file
    python -m hplab.check lse_merge path/to/yours.py

Two things make it real rather than textbook. Scores can be large (exp(100) overflows fp32's
exp(88) limit): never form exp(lse) itself, only exp of a difference that is ≤ 0. And with a
causal mask a query may see *no* key of a block (a later block of the sequence): that block
arrives as out = 0, lse = −inf, and must change nothing (no NaN: −inf − −inf is NaN).
"""

import torch


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over the keys of both blocks.

    out_a, out_b: [..., T, d], the partial outputs; lse_a, lse_b: [..., T], their log-sum-exps
    (−inf where a query saw no key of that block). Returns out [..., T, d] and lse [..., T]."""
    raise NotImplementedError("weight each partial by exp(its lse − the merged lse)")
