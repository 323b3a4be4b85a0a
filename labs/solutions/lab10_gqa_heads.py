"""Lab 10 exercise (reference solution): the heads of each tensor-parallel rank under
grouped-query attention, and the ranks that sum their K/V gradients.

Check it with `python -m hplab.check gqa_heads labs/solutions/lab10_gqa_heads.py`.
"""


def heads_of_rank(rank, tp, n_head, n_kv_head):
    per_rank = n_head // tp  # query heads, a consecutive block each
    queries = list(range(rank * per_rank, (rank + 1) * per_rank))
    group = n_head // n_kv_head  # query heads that read one K/V head
    kv = sorted({q // group for q in queries})  # exactly the K/V heads these queries read
    return queries, kv


def kv_gradient_groups(tp, n_head, n_kv_head):
    sharing = max(1, tp // n_kv_head)  # ranks holding each K/V head: neighbours
    return [list(range(first, first + sharing)) for first in range(0, tp, sharing)]
