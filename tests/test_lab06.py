"""Lab 06 (hybrid 3D parallel and checkpoints): the mesh exercise's checker can tell right from
wrong, and the rank-grid plot draws every rank where `hplab.parallel.mesh` puts it. No processes:
the mesh is arithmetic."""

import textwrap

import pytest

from hplab.config import LayoutError
from hplab.course.check import EXERCISES, EXERCISES_DIR, SOLUTIONS_DIR, main, run_check
from hplab.parallel.mesh import coordinates

# dp varies fastest (PyTorch's default DeviceMesh order of the last two dims reversed): the
# groups are those of another numbering, so only layouts with dp = 1 or tp = 1 agree.
MESH_DP_FASTEST = """
def coordinates(rank, dp, tp, pp):
    return rank % dp, rank // dp % tp, rank // (dp * tp)

def groups(dp, tp, pp):
    ranks = lambda d, t, p: p * dp * tp + t * dp + d
    return {"tp": [[ranks(d, t, p) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "dp": [[ranks(d, t, p) for d in range(dp)] for t in range(tp) for p in range(pp)],
            "pp": [[ranks(d, t, p) for p in range(pp)] for d in range(dp) for t in range(tp)]}
"""

# Right numbering, but the tuple comes back as (tp, dp, pp) and the pp groups are forgotten.
MESH_SWAPPED_TUPLE = """
import sys
sys.path.insert(0, {solutions!r})
import lab06_mesh

def coordinates(rank, dp, tp, pp):
    d, t, p = lab06_mesh.coordinates(rank, dp, tp, pp)
    return t, d, p

def groups(dp, tp, pp):
    out = lab06_mesh.groups(dp, tp, pp)
    out["pp"] = [[r] for r in range(dp * tp * pp)]
    return out
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab06")
    paths = {
        "solution": SOLUTIONS_DIR / "lab06_mesh.py",
        "skeleton": EXERCISES_DIR / "lab06_mesh.py",
    }
    for label, source in (("dp_fastest", MESH_DP_FASTEST), ("swapped", MESH_SWAPPED_TUPLE)):
        paths[label] = tmp / f"mesh_{label}.py"
        paths[label].write_text(
            textwrap.dedent(source.replace("{solutions!r}", repr(str(SOLUTIONS_DIR))))
        )
    return dict(zip(paths, run_check("mesh", list(paths.values()))))


def test_mesh_is_registered_for_lab_06():
    assert EXERCISES["mesh"][:3] == ("06", "lab06_mesh.py", 0)


def test_solution_passes(outcomes):
    results = outcomes["solution"]
    assert [r.name for r in results] == ["coordinates", "groups: tp", "groups: dp", "groups: pp"]
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]


def test_untouched_skeleton_fails_and_says_so(outcomes):
    results = outcomes["skeleton"]
    assert results and not any(r.passed for r in results)
    assert all("not implemented yet" in r.message for r in results)


def test_dp_fastest_numbering_is_named(outcomes):
    coords, tp, dp, pp = outcomes["dp_fastest"]
    assert not coords.passed and "you number dp fastest" in coords.message
    assert not tp.passed and not dp.passed
    assert pp.passed  # same (dp, tp) pairs along pp in both numberings


def test_swapped_tuple_and_missing_pp_groups_are_named(outcomes):
    coords, tp, dp, pp = outcomes["swapped"]
    assert not coords.passed and "you return (tp, dp, pp)" in coords.message
    assert tp.passed and dp.passed
    assert not pp.passed and "pp group is [0], expected [0," in pp.message


def test_command_line_exit_codes(capsys):
    assert main(["mesh", str(SOLUTIONS_DIR / "lab06_mesh.py")]) == 0
    assert "PASS: all 4 checks passed" in capsys.readouterr().out
    assert main(["mesh"]) == 1  # the skeleton
    assert main(["mesh", "no/such/file.py"]) == 2


def test_rank_grid_puts_every_rank_at_its_coordinates():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hplab import viz

    for dp, tp, pp in ((2, 2, 2), (1, 2, 2), (3, 1, 2), (1, 1, 1)):
        ax = viz.plot_rank_grid(dp, tp, pp)
        texts = [t.get_text() for t in ax.texts]
        for rank in range(dp * tp * pp):
            d, t, p = coordinates(rank, dp, tp, pp)
            label = texts.index(f"rank {rank}")
            assert texts[label + 1] == f"dp{d} tp{t} pp{p}"  # drawn under its rank
        assert sum(text.startswith("pipeline stage") for text in texts) == pp
        assert f"on {dp * tp * pp} ranks" in ax.get_title()
        assert len(ax.get_legend().get_texts()) == 3
        plt.close(ax.figure)


def test_rank_grid_refuses_an_impossible_layout():
    from hplab import viz

    with pytest.raises(LayoutError, match="at least 1"):
        viz.plot_rank_grid(0, 2, 2)
