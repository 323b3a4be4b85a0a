"""Lab 06: the device mesh (no processes: numbering is arithmetic)."""

from __future__ import annotations

import itertools
import math

from hplab.course.check.report import Report, first
from hplab.parallel.mesh import coordinates, group_ranks

MESH_LAYOUTS = [(dp, tp, pp) for dp in (1, 2, 3, 4) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4)]
MESH_RANKS = [(rank, lay) for lay in MESH_LAYOUTS for rank in range(math.prod(lay))]
FAMILIES = ("dp", "tp", "pp")


def _mesh_hint(mine: list) -> str:
    """Name the numbering (which family varies fastest) or the tuple order the learner's
    coordinates of MESH_RANKS follow, if they follow another one consistently."""

    def numbering(slots):  # hplab's (tp fastest, then dp, then pp) with the families renamed
        return [
            dict(zip(slots, coordinates(rank, *(lay[FAMILIES.index(f)] for f in slots))))
            for rank, lay in MESH_RANKS
        ]

    for order in list(itertools.permutations(FAMILIES))[1:]:  # every order but hplab's
        if mine == [tuple(c[f] for f in FAMILIES) for c in numbering(order)]:
            return (
                f" — you number {order[1]} fastest, then {order[0]}, then {order[2]}; "
                "Megatron's order is tp fastest, then dp, then pp"
            )
        if mine == [tuple(c[f] for f in order) for c in numbering(FAMILIES)]:
            return f" — you return ({', '.join(order)}): return (dp_rank, tp_rank, pp_rank)"
    return ""


def check_mesh(module, report: Report) -> None:
    """The learner's coordinates and groups against `hplab.parallel.mesh` (which builds the real
    process groups) for every rank of 64 layouts, dp ≤ 4, tp ≤ 8, pp ≤ 4."""

    def group_problem(layout: tuple, family: str) -> str | None:
        where = "dp{}×tp{}×pp{}".format(*layout)
        want = group_ranks(*layout)[family]
        mine = module.groups(*layout)
        try:
            got = [list(g) for g in mine[family]]
        except (TypeError, KeyError, IndexError):
            return f"{where}: groups()[{family!r}] should be lists of ranks; got {mine!r:.60}"
        for rank in range(math.prod(layout)):  # in exactly one group: the one mesh.py makes
            holding = [g for g in got if rank in g]
            expected = next(g for g in want if rank in g)
            if holding != [expected]:
                shared = " and ".join(f for f in FAMILIES if f != family)
                return (
                    f"{where}: rank {rank}'s {family} group is "
                    f"{' and '.join(map(str, holding)) or 'missing'}, expected {expected} "
                    f"(the ranks that share its {shared} coordinates, in increasing order)"
                )
        return sorted(got) != sorted(want) and f"{where}: {family} groups {got}, expected {want}"

    with report.case("coordinates"):
        mine = [module.coordinates(rank, *lay) for rank, lay in MESH_RANKS]
        mine = [tuple(m) if isinstance(m, (tuple, list)) else m for m in mine]
        bad = first(
            f"rank {rank} of dp{dp}×tp{tp}×pp{pp}: you say (dp, tp, pp) = {m!r:.60}, "
            f"expected {want}"
            for m, (rank, (dp, tp, pp)) in zip(mine, MESH_RANKS)
            if m != (want := coordinates(rank, dp, tp, pp))
        )
        report.add(
            bad and bad + _mesh_hint(mine),
            f"every rank of {len(MESH_LAYOUTS)} layouts "
            f"(1 to {max(map(math.prod, MESH_LAYOUTS))} ranks)",
        )
    for family in ("tp", "dp", "pp"):
        report.check(
            f"groups: {family}",
            (group_problem(lay, family) for lay in MESH_LAYOUTS),
            f"every {family} group of the {len(MESH_LAYOUTS)} layouts",
        )
