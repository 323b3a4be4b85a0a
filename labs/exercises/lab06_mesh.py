"""Lab 06 exercise: who is who in a dp × tp × pp mesh.

Implement both functions, then check them against hplab's mesh for dozens of layouts:

    python -m hplab.check mesh                 # checks this file
    python -m hplab.check mesh path/to/yours.py

N = dp · tp · pp processes are numbered 0 ... N-1 (their global rank). A layout arranges them
in a 3-D grid. Number it as Megatron-LM does: the tensor-parallel coordinate varies fastest
(tp ranks are neighbours: on a cluster they share a node's fast links), then data parallel,
then pipeline parallel — like the digits of a number whose lowest digit counts tp ranks.
For dp=2, tp=2, pp=2: ranks 0 and 1 differ only in their tp coordinate, ranks 0 and 2 only in
dp, ranks 0 and 4 only in pp.
"""


def coordinates(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(dp_rank, tp_rank, pp_rank) of global `rank` (0 <= rank < dp·tp·pp)."""
    raise NotImplementedError("tp varies fastest, then dp, then pp: use // and %")


def groups(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every process group of each family, as lists of global ranks:

        {"tp": [...], "dp": [...], "pp": [...]}

    A tp group holds the ranks that share their dp and pp coordinates (so there are dp·pp tp
    groups of tp ranks each); likewise a dp group shares tp and pp, a pp group shares dp and
    tp. Every rank is in exactly one group of each family. List each group's ranks in
    increasing order (a group's first rank is its rank 0); the groups may come in any order."""
    raise NotImplementedError("ranks that agree on every coordinate but one form a group")
