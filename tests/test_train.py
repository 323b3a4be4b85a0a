"""The command line contract: flags, one-line errors, the metrics file, and equivalence of a
real 4-process `torchrun hplab/train.py` with a 1-process one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "hplab" / "train.py")
STEPS = 4


def run_main(capsys, monkeypatch, *args, env=None):
    """train.main in this process (bad flags are caught before any process starts)."""
    from hplab.train import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nproc", "3", "--dp", "2"], "dp=2 × tp=1 × pp=1 = 2 processes, but there are 3"),
        (["--nproc", "4", "--tp", "3"], "cannot be split into tp=3"),
        (["--nproc", "2", "--batch-size", "3"], "--batch-size 3 does not split over dp=2"),
        (["--nproc", "2", "--batch-size", "4", "--microbatches", "3"], "--microbatches 3"),
        (["--nproc", "1", "--model", "gpt5"], "unknown model preset 'gpt5'"),
        (["--nproc", "1", "--n-embd", "66"], "n_embd=66 is not divisible by n_head=4"),
        (["--nproc", "1", "--data", "nothing-here"], "not found"),
    ],
)
def test_bad_command_lines_fail_with_one_clear_line(capsys, monkeypatch, flags, says):
    code, err = run_main(capsys, monkeypatch, *flags, "--steps", "1")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hplab: error:"), err
    assert says in lines[0]


def test_bad_flag_value_is_one_line(capsys, monkeypatch):
    code, err = run_main(capsys, monkeypatch, "--zero", "5")
    assert code == 2
    assert err.strip() == (
        "hplab: error: argument --zero: invalid choice: 5 (choose from 0, 1, 2, 3) (see --help)"
    )


def test_config_file_gives_defaults_and_flags_override(tmp_path, capsys, monkeypatch):
    from hplab.train import parse_args

    recipe = tmp_path / "recipe.toml"
    recipe.write_text("# a recipe\nbatch-size = 32\nsteps = 7\nlr = 3e-4\nrecompute = true\n")
    args = parse_args(["--config", str(recipe), "--steps", "9"])
    assert (args.batch_size, args.steps, args.lr, args.recompute) == (32, 9, 3e-4, "full")
    recipe.write_text("batch-size = 32\nwarp-speed = 9\n")
    code, err = run_main(capsys, monkeypatch, "--config", str(recipe))
    assert code == 2 and "unknown setting(s) warp_speed" in err
    code, err = run_main(capsys, monkeypatch, "--config", str(tmp_path / "none.toml"))
    assert code == 2 and "none.toml not found" in err


def test_layout_flags_are_the_layouts_fields(tmp_path, capsys, monkeypatch):
    """train.py's layout flags come from config.Layout's fields (as the planner's do), and a
    recipe's `recompute` is a bare --recompute (true) or its mode; selective with context
    parallel is refused in one line, with its reason."""
    from dataclasses import fields

    from hplab.cli import build_parser, parse_args
    from hplab.config import Layout

    parser = build_parser()
    assert {f.name for f in fields(Layout)} <= {a.dest for a in parser._actions}
    assert parser.get_default("batch_size") == 16 and parser.get_default("dp") is None
    recipe = tmp_path / "recipe.toml"
    for value, mode in (
        ("true", "full"),
        ("false", "none"),
        ('"full"', "full"),
        ('"selective"', "selective"),
    ):
        recipe.write_text(f"recompute = {value}\n")
        assert parse_args(["--config", str(recipe)]).recompute == mode
    recipe.write_text('recompute = "selective"\ncp = 2\n')
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--config", str(recipe))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("hplab: error: --recompute selective --cp 2: not supported: context"), err


def test_layout_is_checked_under_torchrun_environment_too(capsys, monkeypatch):
    code, err = run_main(capsys, monkeypatch, "--dp", "2", env={"WORLD_SIZE": "3", "RANK": "0"})
    assert code == 2
    assert "but there are 3" in err and "Traceback" not in err


def test_a_bad_command_line_through_the_launcher_starts_no_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, TRAIN, "--nproc", "3", "--dp", "2"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hplab: error: layout dp=2 × tp=1 × pp=1 = 2 processes, but there are 3: make --dp × "
        "--tp × --pp equal the number of processes (--nproc_per_node, or --nproc)"
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training on 1 and on 4 processes, through the real command line."""
    out = {}
    for n in (1, 4):
        path = tmp_path_factory.mktemp("m") / f"dp{n}.json"
        flags = (
            "--dp",
            str(n),
            "--steps",
            str(STEPS),
            "--batch-size",
            "8",
            "--microbatches",
            "2",
            "--metrics",
            str(path),
        )  # one process: no launcher at all; four: train.py's own (torchrun's: test_reliability)
        cmd = [sys.executable, TRAIN, *(("--nproc", str(n)) if n > 1 else ()), *flags]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        out[n] = (json.loads(path.read_text()), result.stdout)
    return out


def test_metrics_file_follows_the_contract(runs):
    metrics, stdout = runs[4]
    assert metrics["version"] == 1 and metrics["world_size"] == 4
    assert metrics["config"]["dp"] == 4 and metrics["config"]["steps"] == STEPS
    assert [s["step"] for s in metrics["steps"]] == list(range(STEPS))
    assert all(s["tokens"] == 8 * 64 and s["time_s"] > 0 for s in metrics["steps"])
    assert metrics["tokens_per_s"] > 0
    assert len(metrics["memory"]) == len(metrics["comm"]) == 4
    psi = metrics["model"]["num_params"]
    for memory, comm in zip(metrics["memory"], metrics["comm"]):
        assert memory["params_bytes"] == memory["grads_bytes"] == 4 * psi
        assert memory["optim_bytes"] == 8 * psi  # Adam's two moments, fp32
        assert memory["activation_bytes"] > 0 and memory["peak_bytes"] > 0
        # one bucket all-reduced per step: exactly the gradient bytes, no_sync inside a step
        assert comm["all_reduce"]["calls"] == STEPS
        assert comm["all_reduce"]["bytes"] == STEPS * 4 * psi
        assert comm["all_reduce"]["bus_bytes"] == pytest.approx(STEPS * 4 * psi * 2 * 3 / 4)
    assert [m["dp_rank"] for m in metrics["mesh"]] == [0, 1, 2, 3]
    assert "memory per rank" in stdout and "all_reduce" in stdout  # the summary table


def test_four_processes_train_the_one_process_model(runs):
    one, four = runs[1][0], runs[4][0]
    for a, b in zip(four["steps"], one["steps"]):
        assert abs(a["loss"] - b["loss"]) / abs(b["loss"]) < 1e-5
    assert "all_reduce" not in one["comm"][0]  # a group of one sends nothing


def test_the_garbage_collector_runs_between_steps_only():
    """Python's collector paused one rank ~200 ms at step 5 of every run (a 5-step pipeline then
    measured GPipe's bubble at 70%): during training it is off, what was built is frozen, and
    `gc.collect(1)` runs every EVERY steps before a step starts; afterwards all is as before."""
    import gc

    from hplab.runtime.collector import between_steps

    assert gc.isenabled()
    with between_steps():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with between_steps():
            pass
        assert not gc.isenabled()  # (left as the caller had it)
    finally:
        gc.enable()
    code = """
import gc, sys
import hplab.runtime.collector as collector
import hplab.train as t
collector.EVERY = 2
collect, calls = gc.collect, []
gc.collect = lambda generation=2: calls.append((generation, gc.isenabled())) or collect(generation)
code = t.main(["--steps", "5", "--no-progress"])
print(code, [c for c in calls if not c[1]], gc.isenabled())
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # while the collector is off (the loop): steps 2 and 4, the young generations only
    assert result.stdout.strip().splitlines()[-1] == "0 [(1, False), (1, False)] True"
