"""Lab 08: the log-sum-exp merge of ring attention (one process: it is arithmetic)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from hplab.course.check.report import Report, differs


def partial_attention(q, k, v, visible) -> tuple:
    """(out, lse) of q's attention over one block of keys; `visible` [Tq, Tk] masks the rest. A
    query that sees no key of the block gets out 0 and lse −inf, as a ring step passes on."""
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v, torch.logsumexp(scores, -1)


def _merge_problem(module, scale: float, blocks: int, causal: bool) -> str | None:
    """Merge the blocks' partials one by one (the last block first, as a ring step may deliver
    it) and compare with attention over every key at once."""
    g = torch.Generator().manual_seed(blocks)
    q, k, v = (
        torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64) * c for c in (scale, 1, 1)
    )
    visible = torch.ones(16, 16, dtype=torch.bool).tril_(0 if causal else 16)
    out, lse = functools.reduce(
        lambda merged, part: module.merge(*merged, *part),
        (
            partial_attention(q, k[..., cols, :], v[..., cols, :], visible[:, cols])
            for cols in reversed(torch.arange(16).chunk(blocks))
        ),
    )
    if out is not None and not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        return "NaN or inf in out or lse: " + (
            "exp(lse) overflowed — factor out the larger lse first"
            if scale > 1
            else "a block no query saw (lse −inf on both "
            "sides) must add nothing: −inf − (−inf) is NaN"
        )
    if d := differs(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal)):
        return f"out: {d} — each partial weighs exp(its lse − the merged lse)"
    return (d := differs(lse, partial_attention(q, k, v, visible)[1])) and f"lse: {d}"


def check_lse_merge(module, report: Report) -> None:
    """`merge` against attention over all keys, for 2 and 4 blocks, causal, and large scores."""
    for label, *case in (
        ("two blocks", 1.0, 2, False),
        ("a ring of four blocks, causal", 1.0, 4, True),
        ("scores past exp's range (~1000)", 400.0, 2, False),
    ):
        report.check(
            label,
            (_merge_problem(module, *case) for _ in "x"),  # lazily: in the case
            "equals attention over every key at once (out and lse)",
        )
