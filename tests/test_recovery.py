"""Failures at scale, injected for real (HPLAB_FAULT): a killed or frozen rank costs only the
steps since the last checkpoint. `train.py --nproc --max-restarts` stops every rank and starts
them again from --save's newest checkpoint, one line per restart; under torchrun a restarted
train.py resumes by itself; the recovered loss curve equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hplab import faults
from hplab.launch import torchrun_command, what_failed

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "hplab" / "train.py")
RUN = ["--steps", "8", "--batch-size", "8", "--no-progress"]


def train(tmp_path, name: str, *flags: str, fault: str = "", torchrun=(), timeout_s=4):
    """A run of 2 processes, train.py --nproc or, given torchrun's own flags, torchrun; (exit
    code, hplab lines, metrics)."""
    metrics = tmp_path / f"{name}.json"
    args = [*RUN, "--metrics", str(metrics), *flags]
    command = [sys.executable, TRAIN, *args]
    if torchrun:
        command = torchrun_command(2, TRAIN, *args)
        command[command.index(TRAIN) : command.index(TRAIN)] = torchrun
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HPLAB_FAULT=fault, HPLAB_TIMEOUT_S=str(timeout_s))
    done = subprocess.run(
        command if torchrun else [*command, "--nproc", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("hplab:")]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.returncode, lines, json.loads(metrics.read_text()) if metrics.exists() else None


def curve(metrics: dict) -> list[float]:
    """Every step's loss: those before the resumed checkpoint (it keeps them), then its own."""
    before = metrics["resumed"]["losses"] if metrics["resumed"] else []
    return before + [s["loss"] for s in metrics["steps"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    code, lines, metrics = train(tmp_path_factory.mktemp("plain"), "plain")
    assert code == 0 and lines == [], lines
    return curve(metrics)


def test_a_killed_then_a_frozen_rank_cost_only_the_steps_since_the_checkpoint(
    tmp_path, uninterrupted
):
    """Rank 1 killed at step 4 (first attempt), rank 0 frozen at step 5 (second): each restart
    resumes from the checkpoint of step 3 (--save-every 3), and the curve is unchanged."""
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-every", "3", "--max-restarts", "2"]
    code, lines, metrics = train(tmp_path, "faults", *flags, fault="4:1:kill,5:0:hang@1")
    assert code == 0, lines
    assert lines == [
        "hplab: restart 1 of 2: process 1 was killed by SIGKILL at step 4; resuming from step 3",
        "hplab: restart 2 of 2: process 0 stopped responding at step 5: its peers timed out "
        "waiting for it; resuming from step 3",
    ]
    assert curve(metrics) == pytest.approx(uninterrupted, rel=1e-5, abs=0)
    assert len(curve(metrics)) == 8 and metrics["resumed"]["step"] == 3
    restarts = metrics["restarts"]  # what each failed attempt cost
    assert [(r["failed_at_step"], r["resumed_from_step"]) for r in restarts] == [(4, 3), (5, 3)]
    assert all(r["seconds"] > 0 for r in restarts)
    assert [c["step"] for c in metrics["checkpoints"]] == [6, 8]  # (the last attempt's saves)
    assert all(c["bytes"] > 0 and c["seconds"] > 0 for c in metrics["checkpoints"])


def test_after_its_last_restart_the_job_ends_with_one_line(tmp_path):
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-every", "3", "--max-restarts", "1"]
    code, lines, metrics = train(tmp_path, "fails", *flags, fault="1:1:kill@*")
    assert code == 1 and metrics is None
    assert lines == [
        "hplab: restart 1 of 1: process 1 was killed by SIGKILL at step 1; resuming from step 0",
        "hplab: error: process 1 was killed by SIGKILL at step 1 (out of memory?) "
        "(1 restart used: --max-restarts 1)",
    ]


def test_under_torchrun_a_restarted_train_py_resumes_by_itself(tmp_path, uninterrupted):
    """torchrun --max-restarts 1 starts the same command again; `--resume auto` (and a restart
    count above 0) resumes from --save's checkpoint, or starts afresh when there is none."""
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-every", "3", "--resume", "auto"]
    code, lines, metrics = train(
        tmp_path, "torchrun", *flags, fault="4:1:kill", torchrun=["--max-restarts=1"]
    )
    assert code == 0, lines
    assert metrics["resumed"]["step"] == 3
    assert curve(metrics) == pytest.approx(uninterrupted, rel=1e-5, abs=0)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("9:2", "'9:2' is not STEP:RANK:KIND"),
        ("x:1:kill", "has step 'x'"),
        ("1:-1:kill", "has rank '-1'"),
        ("1:1:explode", "has kind 'explode'"),
        ("1:1:slow", "has kind 'slow'"),
        ("1:1:slow=inf", "has slow=inf"),
        ("1:1:slow=-2", "has slow=-2"),
        ("1:1:kill@x", "has attempt 'x'"),
    ],
)
def test_a_malformed_fault_is_one_line(text, says):
    with pytest.raises(ValueError, match=says) as err:
        faults.parse(text)
    assert "\n" not in str(err.value) and "e.g. HPLAB_FAULT=9:2:kill" in str(err.value)


def test_faults_parse_into_steps_ranks_kinds_and_attempts():
    assert faults.parse("9:2:kill, 3:0:slow=0.5@1,4:1:hang@*") == [
        faults.Fault(9, 2, "kill"),
        faults.Fault(3, 0, "slow", 0.5, attempt=1),
        faults.Fault(4, 1, "hang", attempt=None),
    ]
    assert faults.parse("") == []


def test_the_launcher_names_the_process_that_brought_the_job_down(tmp_path):
    for rank, step, error in ((0, 7, "all_reduce ... lost its connection"), (1, 7, "")):
        (tmp_path / f"rank{rank}.step").write_text(f"{step:>20}\n")
        if error:
            (tmp_path / f"rank{rank}.error").write_text(error)
    assert what_failed({0: 0, 1: 0}, tmp_path) is None
    assert what_failed({0: 2, 1: -9}, tmp_path)[:2] == (
        "process 1 was killed by SIGKILL at step 7",
        1,
    )
    (tmp_path / "rank1.error").write_text("the loss is NaN")
    assert what_failed({0: 2, 1: 2}, tmp_path)[0] == "process 1 failed at step 7: the loss is NaN"
    (tmp_path / "rank0.error").write_text("all_reduce in the dp group timed out: ...")
    (tmp_path / "rank1.step").unlink()
    assert what_failed({0: 2, 1: None}, tmp_path)[0] == (
        "process 1 stopped responding before its first step: its peers timed out waiting for it"
    )
