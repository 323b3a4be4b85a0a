"""Lab 10: grouped-query attention's heads under tensor parallel (one process: the ranks'
arithmetic, then their attention and gradients computed rank by rank)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from hplab.course.check.report import Report, differs
from hplab.models import llama
from hplab.parallel import tp

LAYOUTS = [  # (tp, n_head, n_kv_head) that hplab accepts: tp | n_head, tp and n_kv divide
    (t, h, kv)  # one another
    for h in (1, 2, 4, 8, 12, 16, 32)
    for kv in range(1, h + 1)
    for t in range(1, h + 1)
    if h % kv == 0 and h % t == 0 and (kv % t == 0 or t % kv == 0)
]
NUMERIC = [(4, 4, 2), (4, 8, 2), (2, 8, 4), (8, 8, 1), (4, 16, 4), (4, 4, 4), (1, 4, 2)]


def hplab_heads(tp_size: int, n_head: int, n_kv_head: int) -> list[tuple[list, list]]:
    """Per rank, the (query heads, K/V heads) hplab's own tensor parallel keeps: q_proj cut by
    tp.ColumnParallelLinear and k_proj by models.llama.kv_heads, on weights whose rows carry the
    index of their head."""

    def labelled(heads: int) -> nn.Linear:
        linear = nn.Linear(1, 2 * heads, bias=False)  # head_dim 2
        linear.weight.data = torch.arange(heads).repeat_interleave(2)[:, None].float()
        return linear

    def heads(linear) -> list[int]:
        return [int(i) for i in linear.weight[::2, 0]]

    out = []
    for rank in range(tp_size):
        comm = SimpleNamespace(rank=rank, size=tp_size)  # all that cutting reads
        attention = SimpleNamespace(head_dim=2, k_proj=labelled(n_kv_head))
        attention.v_proj = labelled(n_kv_head)
        queries = tp.ColumnParallelLinear(labelled(n_head), comm)
        out.append((heads(queries), heads(llama.kv_heads(attention, comm).k_proj)))
    return out


def _map_problem(module, tp_size, n_head, n_kv_head) -> str | None:
    where = f"tp {tp_size}, n_head {n_head}, n_kv_head {n_kv_head}: rank"
    for rank, (want_q, want_kv) in enumerate(hplab_heads(tp_size, n_head, n_kv_head)):
        got = module.heads_of_rank(rank, tp_size, n_head, n_kv_head)
        q, kv = ([*map(int, g)] for g in got)
        if q != want_q:
            hint = " — a consecutive block of n_head / tp" * (len(q) == len(want_q))
            return f"{where} {rank} holds query heads {q}, expected {want_q}{hint}"
        if kv != want_kv:
            read = n_head // n_kv_head
            hint = (
                " — it still reads one: hold that K/V head whole"
                if not kv
                else f" — query head i reads K/V head i // {read} (n_head / n_kv_head): "
                "neighbouring ranks share a K/V head"
            )
            return (
                f"{where} {rank} (query heads {q}) holds K/V heads {kv}, expected {want_kv}{hint}"
            )
    return None


def _layer(tp_size, n_head, n_kv_head):
    """Random q [n_head, T, d], k and v [n_kv_head, T, d] (float64), o_proj's weights as a loss,
    and the whole layer's output and K/V gradients."""
    g = torch.Generator().manual_seed(tp_size * 100 + n_head * 10 + n_kv_head)
    q, weigh = (torch.randn(n_head, 5, 3, generator=g, dtype=torch.float64) for _ in "qw")
    k, v = (torch.randn(n_kv_head, 5, 3, generator=g, dtype=torch.float64) for _ in "kv")
    k.requires_grad_(), v.requires_grad_()
    whole = _attend(q, k, v)
    (whole * weigh).sum().backward()
    return SimpleNamespace(q=q, k=k, v=v, weigh=weigh, whole=whole)


def _attend(q, k, v):
    """Causal attention, [heads, T, d]; consecutive query heads share a K/V head, in order (the
    GQA each rank runs on the heads it holds)."""
    share = q.shape[0] // k.shape[0]
    k, v = (t.repeat_interleave(share, 0) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _rank_pass(layer, queries, kv):
    """One rank's heads of the output, and the partial K/V gradients they leave it."""
    k, v = (t[kv].detach().requires_grad_() for t in (layer.k, layer.v))
    out = _attend(layer.q[queries], k, v)
    (out * layer.weigh[queries]).sum().backward()
    return out, k.grad, v.grad


def _attention_problem(module, tp_size, n_head, n_kv_head) -> str | None:
    """Each rank attends its query heads over the K/V heads you give it: its heads of the
    output must be the whole layer's."""
    layer = _layer(tp_size, n_head, n_kv_head)
    where = f"tp {tp_size}, n_head {n_head}, n_kv_head {n_kv_head}"
    for rank in range(tp_size):
        qh, kvh = ([*map(int, h)] for h in module.heads_of_rank(rank, tp_size, n_head, n_kv_head))
        if not qh or not kvh or len(qh) % len(kvh):
            return f"{where}: rank {rank}'s {len(qh)} query heads cannot share {len(kvh)} K/V heads"
        if problem := differs(_rank_pass(layer, qh, kvh)[0], layer.whole[qh]):
            return f"{where}: rank {rank}'s attention (query heads {qh}, K/V {kvh}): {problem}"
    return None


def _groups_problem(module, tp_size, n_head, n_kv_head) -> str | None:
    """Each rank's partial K/V gradients (its heads as hplab cuts them), added over the ranks of
    your group, must be the whole layer's gradient of those heads."""
    layer = _layer(tp_size, n_head, n_kv_head)
    where = f"tp {tp_size}, n_head {n_head}, n_kv_head {n_kv_head}"
    heads = hplab_heads(tp_size, n_head, n_kv_head)
    partial = [(kv, *_rank_pass(layer, q, kv)[1:]) for q, kv in heads]
    groups = [[*map(int, group)] for group in module.kv_gradient_groups(tp_size, n_head, n_kv_head)]
    if sorted(r for group in groups for r in group) != list(range(tp_size)):
        return (
            f"{where}: your groups {groups} do not hold each of ranks 0 … {tp_size - 1} exactly "
            "once (a rank that holds its K/V heads alone is a group of one)"
        )
    for group in groups:
        if len(held := {tuple(partial[r][0]) for r in group}) > 1:
            return (
                f"{where}: group {group} holds different K/V heads {sorted(held)}: only ranks "
                "holding the same heads add their gradients"
            )
        kvh = partial[group[0]][0]
        for i, whole in ((1, layer.k.grad), (2, layer.v.grad)):
            if problem := differs(sum(partial[r][i] for r in group), whole[kvh]):
                return (
                    f"{where}: the gradients of K/V heads {kvh} added over {group}: {problem}"
                    " — each rank whose query heads read a K/V head holds part of its gradient:"
                    " add all"
                )
    return None


def check_gqa_heads(module, report: Report) -> None:
    """heads_of_rank against hplab's cut for every layout of up to 32 heads; then attention and
    gradient sums, rank by rank, against the whole layer's."""
    report.check(
        "heads of each rank",
        (_map_problem(module, *layout) for layout in LAYOUTS),
        f"every rank of {len(LAYOUTS)} layouts (tp, n_head, n_kv_head) as hplab cuts them",
    )
    report.check(
        "attention of each rank",
        (_attention_problem(module, *layout) for layout in NUMERIC),
        f"each rank's heads of the output equal the whole layer's, {len(NUMERIC)} layouts",
    )
    report.check(
        "K/V gradient groups",
        (_groups_problem(module, *layout) for layout in NUMERIC),
        f"partial K/V gradients added over your groups equal the whole layer's, "
        f"{len(NUMERIC)} layouts",
    )
