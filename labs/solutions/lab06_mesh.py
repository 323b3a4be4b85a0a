"""Lab 06 exercise (reference solution): coordinates and groups of a dp × tp × pp mesh.

Check it with `python -m hplab.check mesh labs/solutions/lab06_mesh.py`.
"""


def coordinates(rank, dp, tp, pp):
    tp_rank = rank % tp  # the fastest digit
    dp_rank = (rank // tp) % dp
    pp_rank = rank // (tp * dp)  # the slowest digit
    return dp_rank, tp_rank, pp_rank


def groups(dp, tp, pp):
    families = {"tp": {}, "dp": {}, "pp": {}}
    for rank in range(dp * tp * pp):  # increasing, so every group comes out sorted
        d, t, p = coordinates(rank, dp, tp, pp)
        # a group is keyed by the coordinates its members share
        families["tp"].setdefault((d, p), []).append(rank)
        families["dp"].setdefault((t, p), []).append(rank)
        families["pp"].setdefault((d, t), []).append(rank)
    return {family: list(by_key.values()) for family, by_key in families.items()}
