"""The mesh (hplab/parallel/mesh.py) on PyTorch's DeviceMesh: its groups are the arithmetic's.

`coordinates`, `group_ranks` and `mesh_groups` are Megatron's numbering as plain arithmetic
(lab 06's exercise is checked against them); `Mesh` builds the grid with `init_device_mesh`,
dp × cp flattened and dp unflattened into (edp, ep). For several layouts, every rank's group of
every family equals the arithmetic's: PyTorch's "fake" backend lets one process play each rank
in turn (groups are formed, nothing is sent). Then on 4 gloo processes: every group the mesh
creates keeps the world's timeout (a collective a peer never joins raises hplab's CommTimeout
after it), DDP over `mesh.device_mesh["dp"]` trains exactly as DDP over `mesh.dp`, expert
parallel takes its groups as DeviceMeshes too, and `shutdown()` frees every group the
DeviceMeshes hold (their gloo threads end while Python is alive).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hplab.parallel.mesh import Mesh, coordinates, mesh_groups
from hplab.runtime.launch import run_distributed

LAYOUTS = [
    dict(pp=2, dp=2, tp=2),
    dict(pp=2, dp=2, cp=2, tp=2),
    dict(dp=4, cp=2, ep=2),
    dict(pp=2, dp=4, ep=2),
    dict(pp=2, dp=2, tp=2, ep=2),
    dict(dp=8, ep=4),
    dict(pp=2, dp=4, cp=2, ep=2),
]
FAMILIES = ("tp", "dp", "pp", "cp", "ep", "edp", "dp_cp", "edp_cp")


def sizes_of(layout: dict) -> dict:
    return {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1} | layout


def as_fake_rank(rank: int, world_size: int, layout: dict) -> dict:
    """The Mesh rank `rank` builds, read out: its coordinates and each family's ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = Mesh(**layout)
        return {
            "coordinates": (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank, mesh.cp_rank),
            "device mesh": mesh.device_mesh.get_coordinate(),
            **{family: getattr(mesh, family).ranks for family in FAMILIES},
            "names": {family: getattr(mesh, family).name for family in FAMILIES},
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: " ".join(f"{k}{v}" for k, v in d.items()))
def test_every_rank_gets_the_groups_of_megatrons_numbering(layout):
    s = sizes_of(layout)
    world_size = s["pp"] * s["dp"] * s["cp"] * s["tp"]
    expected = mesh_groups(s["dp"], s["tp"], s["pp"], s["cp"], s["ep"])
    for rank in range(world_size):
        got = as_fake_rank(rank, world_size, layout)
        dp_rank, tp_rank, pp_rank = coordinates(rank, s["dp"], s["tp"], s["pp"], s["cp"])
        cp_rank = (rank // s["tp"]) % s["cp"]
        assert got["coordinates"] == (dp_rank, tp_rank, pp_rank, cp_rank)
        assert got["device mesh"] == (pp_rank, dp_rank, cp_rank, tp_rank)
        for family, groups in expected.items():
            assert [got[family]] == [g for g in groups if rank in g], (rank, family)
        # one ledger name per group: a family that is another's group is counted under it
        names = got["names"]
        assert names["edp"] == ("edp" if s["ep"] > 1 else "dp")
        assert names["dp_cp"] == ("dp_cp" if s["cp"] > 1 else "dp")
        if s["cp"] == 1:
            assert names["edp_cp"] == names["edp"]
        else:
            assert names["edp_cp"] == ("edp_cp" if s["ep"] > 1 else "dp_cp")


def test_the_mesh_takes_its_sizes_by_name():
    with pytest.raises(TypeError):
        Mesh(2, 1, 1)  # which is dp, which tp? (positional sizes are refused before any group)
    assert not hasattr(Mesh, "create")


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux)."""
    names = [(t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    return [name for name in names if "gloo" in name]


def _on_four_ranks() -> dict:
    """Each group's timeout; a collective rank 1 never joins; DDP both ways; MoE's groups;
    the gloo threads left after shutdown."""
    import hplab
    from hplab.parallel import moe
    from hplab.runtime import group as runtime_group
    from hplab.runtime.errors import CommTimeout
    from hplab.runtime.group import shutdown

    mesh = Mesh(dp=2, cp=2, ep=2)  # groups of 1, 2 and 4 ranks, flattened and unflattened
    cpu = torch.device("cpu")
    timeouts = {
        family: dimension.get_group()._get_backend(cpu).options._timeout
        for family, dimension in mesh.dimensions.items()
    }
    out = {"timeouts": timeouts, "world": runtime_group.TIMEOUT}

    runtime_group.TIMEOUT = timedelta(seconds=2)  # (the groups of the next mesh only)
    short = Mesh(dp=2, tp=2)
    if short.rank == 0:
        try:
            short.tp.all_reduce(torch.ones(4))  # its peer, rank 1, never joins
        except CommTimeout as err:
            out["timed out"] = str(err)
    dist.barrier()

    losses = {}
    for key, group in (("device_mesh", mesh.device_mesh["dp"]), ("mesh.dp", mesh.dp)):
        torch.manual_seed(0)
        model = hplab.DDP(torch.nn.Linear(8, 8), group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(mesh.dp_rank))
        for x in data:
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses[key] = [p.detach().clone() for p in model.parameters()]
        out[f"{key} ranks"] = model.comm.ranks
    out["same weights"] = all(
        torch.equal(a, b) for a, b in zip(losses["device_mesh"], losses["mesh.dp"])
    )

    layer = moe.MoE(8, 4, 2, lambda: torch.nn.Linear(8, 8))
    moe.parallelize(layer, mesh.dimensions["ep"], mesh.device_mesh["dp"])
    out["experts"] = sorted(layer.experts)
    out["moe ep ranks"] = layer.ep.ranks
    out["mesh ep ranks"] = mesh.ep.ranks
    if sys.platform == "linux":
        shutdown()  # (while `mesh` and `short` are alive)
        out["gloo threads after shutdown"] = gloo_threads()
    return out


def test_groups_keep_the_worlds_timeout_and_blocks_take_a_device_mesh():
    results = run_distributed(_on_four_ranks, 4, timeout_s=60)
    for rank, out in enumerate(results):
        assert out["world"] == timedelta(seconds=60)
        assert set(out["timeouts"]) == {"pp", "dp", "cp", "tp", "ep", "edp", "dp_cp", "edp_cp"}
        assert all(t == out["world"] for t in out["timeouts"].values()), out["timeouts"]
        assert out["same weights"], rank
        assert out["device_mesh ranks"] == out["mesh.dp ranks"] == [rank % 2, rank % 2 + 2]
        assert out["moe ep ranks"] == out["mesh ep ranks"] == [rank % 2, rank % 2 + 2]
        assert out["experts"] == (["0", "1"] if rank < 2 else ["2", "3"])
        assert out.get("gloo threads after shutdown", []) == []
    assert "all_reduce in the tp group (ranks [0, 1]) timed out" in results[0]["timed out"]
