"""Lab 08 solution: the log-sum-exp merge of two partial attention results (see exercises/)."""

import torch


def merge(out_a, lse_a, out_b, lse_b):
    """`logaddexp` factors out the larger lse (max + log(1 + exp(min − max))), so no exp
    overflows; each share is exp of a number ≤ 0. Where neither block had a key for a query,
    both lse are −inf: the shares are NaN there (−inf − −inf) and become 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    share_a = torch.exp(lse_a - lse).nan_to_num(0.0)
    share_b = torch.exp(lse_b - lse).nan_to_num(0.0)
    return share_a[..., None] * out_a + share_b[..., None] * out_b, lse
