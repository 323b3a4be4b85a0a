"""The device mesh: this rank's place in the pp × dp × cp × tp grid, and a group per family.

A training layout `dp × cp × tp × pp` arranges the N ranks in a grid. We number it as
Megatron-LM does, tensor-parallel ranks adjacent (they talk the most, so on a real cluster they
share a node's fast links), then context parallel, then data parallel, then pipeline parallel:

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

Each rank belongs to one group of each family: its `tp` group (same dp, cp and pp coordinates),
its `dp` group, and so on. Collectives of a strategy run inside its own family's group only.

The functions below are that numbering as plain arithmetic (no processes). `Mesh` builds the
same grid with PyTorch's own `init_device_mesh`, as torchtitan's ParallelDims does: a
DeviceMesh with dimensions ("pp", "dp", "cp", "tp"), dp × cp flattened into one dimension
(the ranks that hold the same weights under context parallel) and dp unflattened into
(edp, ep) for expert parallel.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hplab.config import Layout, check_experts, check_mesh, check_sizes_and_choices
from hplab.parallel.collectives import OPEN_COMMUNICATORS, CommLedger, Communicator
from hplab.runtime.group import current_device, group_options


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

    def rank(c):
        return global_rank(c["dp"], c["tp"], c["pp"], dp, tp, c["cp"], cp)

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

    def rank(d, t, p, c):
        return global_rank(d, t, p, dp, tp, c, cp)

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


DIMENSIONS = ("pp", "dp", "cp", "tp")  # outermost first: tp's ranks are adjacent


class Mesh:
    """This rank's place in the pp × dp × cp × tp grid, and a communicator for each family:
    build it with `Mesh(dp=2, tp=2, pp=2)` (sizes by name, 1 where not given) after
    `init_distributed()`. `mesh.device_mesh` is PyTorch's DeviceMesh of that grid, and
    `mesh.dimensions` each family's own 1-D DeviceMesh (dp_cp, ep, edp and edp_cp where they
    are groups of their own); `mesh.dp`, `mesh.cp`, `mesh.tp`, `mesh.pp`, `mesh.ep`,
    `mesh.edp`, `mesh.dp_cp`, `mesh.edp_cp` and `mesh.world` are Communicators over its
    groups, all writing into one `CommLedger`: a rank's bytes per operation and family."""

    def __init__(
        self,
        *,
        pp: int = 1,
        dp: int = 1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        device: torch.device | None = None,
        ledger: CommLedger | None = None,
    ):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        check_sizes_and_choices(layout)
        check_mesh(layout, self.world_size)
        check_experts(None, ep, dp)  # (ep groups are cut out of dp)
        self.pp_size = pp
        self.dp_size = dp
        self.cp_size = cp
        self.tp_size = tp
        self.ep_size = ep
        self.device = device or current_device()
        self.ledger = ledger or CommLedger()
        self.groups = mesh_groups(dp, tp, pp, cp, ep)  # every group, for groups built beside
        self.device_mesh = init_device_mesh(
            self.device.type,
            (pp, dp, cp, tp),
            mesh_dim_names=DIMENSIONS,
            backend_override={name: group_options() for name in DIMENSIONS},
        )
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = self.device_mesh.get_coordinate()
        self.dimensions: dict[str, DeviceMesh] = {}
        self.world = Communicator(dist.group.WORLD, "world", self.ledger, device=self.device)
        for family in DIMENSIONS:
            setattr(self, family, self._communicator(self.device_mesh[family], family))
        self._expert_dimensions()
        self._replica_dimensions()
        OPEN_COMMUNICATORS.add(self)  # (its DeviceMeshes hold process groups too: `release`)

    def _communicator(self, dimension: DeviceMesh, family: str) -> Communicator:
        """The Communicator over one dimension's group (this rank's), counted under `family`;
        the dimension itself, a 1-D DeviceMesh, is kept in `mesh.dimensions[family]`."""
        self.dimensions[family] = dimension
        group = dimension.get_group()
        ranks = dist.get_process_group_ranks(group)
        return Communicator(group, family, self.ledger, ranks, self.device)

    def _expert_dimensions(self) -> None:
        """Expert parallel cuts each dp group into blocks of ep ranks (`mesh.ep`, which share
        out the experts); the ranks at the same place in every block (`mesh.edp`) hold the
        same experts. As torchtitan does: dp unflattened into (edp, ep), ep varying fastest."""
        self.ep_rank = self.dp_rank % self.ep_size
        self.edp_rank = self.dp_rank // self.ep_size
        if self.ep_size == 1:  # every expert on every rank: their replicas are the whole dp group
            self.ep = Communicator(None, "ep", self.ledger, [self.rank], self.device)
            self.edp = self.dp
            self.expert_mesh = None
            return
        self.expert_mesh = self.device_mesh._unflatten(
            "dp",
            (self.dp_size // self.ep_size, self.ep_size),
            ("edp", "ep"),
            backend_override={"edp": group_options(), "ep": group_options()},
        )
        self.ep = self._communicator(self.expert_mesh["ep"], "ep")
        self.edp = self._communicator(self.expert_mesh["edp"], "edp")

    def _replica_dimensions(self) -> None:
        """Under context parallel each rank of a cp group holds the same weights, as the dp
        group does: gradients average and ZeRO shards over dp × cp (`mesh.dp_cp`; Megatron's
        data-parallel group with context parallel, torchtitan's dp_shard_cp), an expert's
        over edp × cp (`mesh.edp_cp`). Both are the DeviceMesh's dimensions, flattened."""
        if self.cp_size == 1:  # the replicas are the dp (or edp) group itself
            self.dp_cp = self.dp
            self.edp_cp = self.edp
            return
        dp_cp = self.device_mesh["dp", "cp"]._flatten("dp_cp", backend_override=group_options())
        self.dp_cp = self._communicator(dp_cp, "dp_cp")
        if self.ep_size == 1:
            self.edp_cp = self.dp_cp
            return
        edp_cp = self.expert_mesh["edp", "cp"]._flatten("edp_cp", backend_override=group_options())
        self.edp_cp = self._communicator(edp_cp, "edp_cp")

    def release(self) -> None:
        """Let go of the DeviceMeshes (at shutdown, with every Communicator): each holds its
        process groups, whose gloo threads must be joined while Python is still alive."""
        self.device_mesh = None
        self.expert_mesh = None
        self.dimensions = {}

    def describe(self) -> dict:
        return {
            key: getattr(self, key) for key in ("rank", "dp_rank", "tp_rank", "pp_rank", "cp_rank")
        }
