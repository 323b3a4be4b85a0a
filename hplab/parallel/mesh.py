"""The device mesh: this rank's place in the dp × cp × tp × pp grid, and a group per family.

A training layout `dp × cp × tp × pp` arranges the N ranks in a grid. We number it as
Megatron-LM does, tensor-parallel ranks adjacent (they talk the most, so on a real cluster they
share a node's fast links), then context parallel, then data parallel, then pipeline parallel:

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

Each rank belongs to one group of each family: its `tp` group (same dp, cp and pp coordinates),
its `dp` group, and so on. Collectives of a strategy run inside its own family's group only.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from hplab.config import Layout, check_experts, check_mesh, check_sizes_and_choices
from hplab.parallel.collectives import CommLedger, Communicator
from hplab.runtime.group import current_device, new_group


def coordinates(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int]:
    """(dp_rank, tp_rank, pp_rank) of a global rank; tp varies fastest, then cp, then dp, then
    pp. Its cp_rank is (rank // tp) % cp."""
    return (rank // (tp * cp)) % dp, rank % tp, rank // (tp * cp * dp)


def global_rank(
    dp_rank: int, tp_rank: int, pp_rank: int, dp: int, tp: int, cp_rank: int = 0, cp: int = 1
) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def group_ranks(dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every family, as lists of global ranks (pure arithmetic, no processes):
    ranks that share all coordinates but one form a group along that one."""
    sizes = dict(pp=pp, dp=dp, cp=cp, tp=tp)  # outermost first
    grid = [dict(zip(sizes, c)) for c in itertools.product(*(range(n) for n in sizes.values()))]
    rank = lambda c: global_rank(c["dp"], c["tp"], c["pp"], dp, tp, c["cp"], cp)  # noqa: E731
    return {
        family: [
            [rank({**c, family: i}) for i in range(sizes[family])] for c in grid if c[family] == 0
        ]
        for family in ("tp", "dp", "pp", "cp")
    }


def replicas_with_context_parallel(dp: int, tp: int, pp: int, cp: int, ep: int = 1) -> dict:
    """The ranks holding the same weights when context parallel splits sequences: a dp group
    and each of its ranks' cp group (`dp_cp`; Megatron's data-parallel group with context
    parallel, torchtitan's dp_shard_cp), and under expert parallel an expert's (`edp_cp`)."""
    rank = lambda d, t, p, c: global_rank(d, t, p, dp, tp, c, cp)  # noqa: E731
    grid = list(itertools.product(range(pp), range(tp)))
    groups = {"dp_cp": [[rank(d, t, p, c) for d in range(dp) for c in range(cp)] for p, t in grid]}
    if ep > 1:
        groups["edp_cp"] = [
            [rank(d, t, p, c) for d in range(j, dp, ep) for c in range(cp)]
            for p, t in grid
            for j in range(ep)
        ]
    return groups


def mesh_groups(dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict:
    """Every group a Mesh builds, by family (pure arithmetic): tp, dp, pp, cp (`group_ranks`);
    ep, each dp group cut into blocks of ep ranks, and edp, the same place in every block (an
    expert's replicas); with cp, dp_cp and edp_cp (`replicas_with_context_parallel`)."""
    groups = group_ranks(dp, tp, pp, cp)
    groups["ep"] = [d[s : s + ep] for d in groups["dp"] for s in range(0, dp, ep)]
    if ep > 1:
        groups["edp"] = [d[j::ep] for d in groups["dp"] for j in range(ep)]
    if cp > 1:  # the ranks that hold the same parameters: gradients average, ZeRO shards
        groups.update(replicas_with_context_parallel(dp, tp, pp, cp, ep))
    return groups


class Mesh:
    """This rank's place in the dp × cp × tp × pp grid, and a communicator for each family:
    build it with `Mesh.create(dp, tp, pp, cp=cp)` after `init_distributed()`. `mesh.dp`,
    `mesh.cp`, `mesh.tp`, `mesh.pp` and `mesh.world` all write into one `CommLedger`: a rank's
    bytes per operation and family."""

    def __init__(
        self,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        device: torch.device | None = None,
        ledger: CommLedger | None = None,
        cp: int = 1,
        ep: int = 1,
    ):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        check_sizes_and_choices(layout)
        check_mesh(layout, self.world_size)
        check_experts(None, ep, dp)  # (ep groups are cut out of dp)
        self.dp_size, self.tp_size, self.pp_size, self.cp_size = dp, tp, pp, cp
        self.dp_rank, self.tp_rank, self.pp_rank = coordinates(self.rank, dp, tp, pp, cp)
        self.cp_rank = (self.rank // tp) % cp
        self.device, self.ledger = device or current_device(), ledger or CommLedger()
        self.world = Communicator(dist.group.WORLD, "world", self.ledger, device=self.device)
        self.groups = mesh_groups(dp, tp, pp, cp, ep)
        self.ep_size, self.ep_rank, self.edp_rank = ep, self.dp_rank % ep, self.dp_rank // ep
        for family, lists in self.groups.items():
            for ranks in lists:  # every rank must create every group, in the same order
                group = new_group(ranks) if len(ranks) > 1 else None
                if self.rank in ranks:  # this rank's group of the family: mesh.dp, .tp, .pp
                    setattr(
                        self, family, Communicator(group, family, self.ledger, ranks, self.device)
                    )
        if ep == 1:  # every expert on every rank: their replicas are the whole dp group
            self.edp = self.dp
        if cp == 1:  # (with cp: dp_cp, and edp_cp under ep, are their own groups)
            self.dp_cp, self.edp_cp = self.dp, self.edp
        elif ep == 1:
            self.edp_cp = self.dp_cp

    @classmethod
    def create(cls, *args, **kwargs) -> Mesh:
        return cls(*args, **kwargs)  # the name the labs use: the same as Mesh(dp, tp, pp, ...)

    def describe(self) -> dict:
        return {
            key: getattr(self, key) for key in ("rank", "dp_rank", "tp_rank", "pp_rank", "cp_rank")
        }
