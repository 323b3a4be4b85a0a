"""Lab 05 exercise (reference solution): the 1F1B schedule as a list of actions per rank.

Check it with `python -m hplab.check one_f_one_b labs/solutions/lab05_1f1b.py`.
"""


def one_f_one_b(p: int, m: int) -> list[list[tuple[str, int]]]:
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)  # forwards in flight before the first backward arrives
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(m - warmup, m)]  # cool-down: the remaining backwards
        orders.append(order)
    return orders
