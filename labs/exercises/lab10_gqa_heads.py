"""Lab 10 exercise: which attention heads each tensor-parallel rank holds under grouped-query
attention, and which ranks must add up their K/V gradients.

Implement both functions, then check them against hplab's own cut of a Llama's attention:

    python -m hplab.check gqa_heads                 # checks this file
    python -m hplab.check gqa_heads path/to/yours.py

A Llama layer has n_head query heads and n_kv_head K/V heads; query head i reads K/V head
i // (n_head / n_kv_head), so consecutive query heads share one. Tensor parallel gives each of
the tp ranks a consecutive block of n_head / tp query heads (q_proj is column parallel), and
each rank needs the K/V heads its own query heads read:

  * tp <= n_kv_head: each rank holds its own n_kv_head / tp K/V heads (no one else holds them);
  * tp > n_kv_head: a K/V head cannot be cut, so it is held whole, alike, by every rank whose
    query heads read it. Each of those ranks computes only part of its gradient (from its own
    query heads): after backward they add their parts up (an all-reduce over those ranks).

You may assume tp divides n_head, n_kv_head divides n_head, and tp and n_kv_head divide one
another (hplab refuses other layouts in one line).
"""


def heads_of_rank(rank: int, tp: int, n_head: int, n_kv_head: int) -> tuple[list[int], list[int]]:
    """(query heads, K/V heads) that tensor-parallel rank `rank` of `tp` holds, each a list of
    head indices in increasing order. Example: n_head 4, n_kv_head 2, tp 4 → rank 3 holds
    query head 3, which reads K/V head 1: ([3], [1])."""
    raise NotImplementedError("a consecutive block of query heads; the K/V heads they read")


def kv_gradient_groups(tp: int, n_head: int, n_kv_head: int) -> list[list[int]]:
    """The groups of ranks (0 … tp−1) whose K/V gradients are summed after backward: the ranks
    that hold the same K/V heads. Every rank is in exactly one group (a rank that holds its K/V
    heads alone is a group of one); list each group's ranks in increasing order."""
    raise NotImplementedError("ranks holding the same K/V heads sum their partial gradients")
