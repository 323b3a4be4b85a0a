"""Failures at scale, injected for real (HPLAB_FAULT): a killed or frozen rank costs only the
steps since the last checkpoint. `train.py --nproc --max-restarts` stops every rank and starts
them again from --save's newest checkpoint, one line per restart; under torchrun a restarted
train.py resumes by itself; the recovered loss curve equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hplab import faults
from hplab.launch import torchrun_command, what_failed

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "hplab" / "train.py")
RUN = ["--steps", "8", "--batch-size", "8", "--no-progress"]


def train(tmp_path, name: str, *flags: str, fault="", torchrun=(), timeout_s=60, nproc=2):
    """A run of 2 processes, train.py --nproc or, given torchrun's own flags, torchrun; (exit
    code, hplab lines, metrics). `timeout_s`: HPLAB_TIMEOUT_S, how long a frozen peer takes to
    notice (a restart's ranks must also meet within it: each imports torch afresh)."""
    metrics = tmp_path / f"{name}.json"
    args = [*RUN, "--metrics", str(metrics), *flags]
    command = [sys.executable, TRAIN, *args]
    if torchrun:
        command = torchrun_command(2, TRAIN, *args)
        command[command.index(TRAIN) : command.index(TRAIN)] = torchrun
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HPLAB_FAULT=fault, HPLAB_TIMEOUT_S=str(timeout_s))
    done = subprocess.run(
        command if torchrun else [*command, "--nproc", str(nproc)],
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


def test_a_killed_a_frozen_and_a_saving_rank_cost_only_the_steps_since_the_checkpoint(
    tmp_path, uninterrupted
):
    """Rank 1 killed at step 4 (first attempt), rank 0 frozen at step 5 (second), rank 0 killed
    while it writes the checkpoint of step 6 (third): each restart resumes from the checkpoint
    of step 3 (--save-every 3; the torn one is never used), and the curve is unchanged. With
    --async-save that checkpoint is written while training goes on (rank 0 finishes it when
    its peer is lost): the curve shows it is the snapshot of its step boundary."""
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-every", "3", "--max-restarts", "3", "--async-save"]
    faults = "4:1:kill,5:0:hang@1,6:0:kill-in-save@2"
    code, lines, metrics = train(tmp_path, "faults", *flags, fault=faults, timeout_s=5)
    assert code == 0, lines
    # the writer thread is killed while training goes on: rank 0 has just finished step 5, or
    # already started step 6 (steps count from 0), and the line names the step it was at
    lost_at = 5 if "at step 5;" in lines[-1] else 6
    assert lines == [
        "hplab: restart 1 of 3: process 1 was killed by SIGKILL at step 4; resuming from step 3",
        "hplab: restart 2 of 3: process 0 stopped responding at step 5: its peers timed out "
        "waiting for it; resuming from step 3",
        f"hplab: restart 3 of 3: process 0 was killed by SIGKILL at step {lost_at}; resuming "
        "from step 3",
    ]
    assert curve(metrics) == pytest.approx(uninterrupted, rel=1e-5, abs=0)
    assert len(curve(metrics)) == 8 and metrics["resumed"]["step"] == 3
    restarts = metrics["restarts"]  # what each failed attempt cost
    assert [(r["failed_at_step"], r["resumed_from_step"]) for r in restarts] == [
        (4, 3),
        (5, 3),
        (lost_at, 3),
    ]
    assert all(r["seconds"] > 0 for r in restarts)
    saves = metrics["checkpoints"]  # the last attempt's, each written beside training
    assert [c["step"] for c in saves] == [6, 8]
    assert all(c["bytes"] > 0 and c["seconds"] > 0 and c["write_seconds"] > 0 for c in saves)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # torn: gone


def _killed_rank(argv: list[str]) -> int:
    """A rank of `launch` (forked): rank 1 is killed at step 1; rank 0 then finds its peer
    gone, as gloo would tell it, and says so in the status folder."""
    from hplab.launch import note_error, note_step

    note_step(1)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
    note_error("all_reduce in the dp group (ranks [0, 1]) lost its connection: a peer ended")
    return 2


def test_after_its_last_restart_the_job_ends_with_one_line(capsys):
    """The launcher itself, its ranks forked from here: every attempt is killed at step 1."""
    from hplab.launch import launch

    code = launch(2, [], _killed_rank, "train.py", max_restarts=1, restart=lambda attempt: 0)
    assert code == 1
    assert capsys.readouterr().err.splitlines() == [
        "hplab: restart 1 of 1: process 1 was killed by SIGKILL at step 1; resuming from step 0",
        "hplab: error: process 1 was killed by SIGKILL at step 1 (out of memory?) "
        "(1 restart used: --max-restarts 1)",
    ]


def test_a_failure_after_the_last_checkpoint_completes_the_job(capsys):
    """A rank lost after the last save (its checkpoint holds every step): `restart` says
    there is nothing left (None), and the job ends well, with one line."""
    from hplab.launch import launch

    code = launch(2, [], _killed_rank, "train.py", max_restarts=1, restart=lambda attempt: None)
    assert code == 0
    assert capsys.readouterr().err.splitlines() == [
        "hplab: process 1 was killed by SIGKILL at step 1, after the last checkpoint: the run "
        "is complete"
    ]


def test_under_torchrun_a_restarted_train_py_resumes_by_itself_on_fewer_processes(
    tmp_path, uninterrupted, capsys
):
    """Saved by 4 data-parallel ranks at step 4; then torchrun on 2 (a node lost) with
    --resume auto: the global batch stays, in twice the microbatches (each rank's microbatch,
    and its memory, as before). Killed at step 6, torchrun --max-restarts 1 starts the same
    command again, which resumes from --save's checkpoint of step 6 by itself (a restart count
    above 0). The curve equals an uninterrupted run's."""
    save = str(tmp_path / "ckpt")
    code, lines, first = train(tmp_path, "four", "--save", save, "--steps", "4", nproc=4)
    assert code == 0 and first["config"]["dp"] == 4, lines
    from hplab.train import main  # the same command again: done already, before any process

    assert main(["--nproc", "4", "--steps", "4", "--save", save, "--resume", "auto"]) == 0
    said = capsys.readouterr().err
    assert said == f"hplab: {save} already holds all 4 steps: nothing is left to train\n"
    flags = ["--save", save, "--save-every", "3", "--resume", "auto"]
    restarts = ["--max-restarts=1"]  # (torchrun's own flag)
    code, lines, metrics = train(tmp_path, "two", *flags, fault="6:1:kill", torchrun=restarts)
    assert code == 0, lines
    assert (metrics["config"]["dp"], metrics["config"]["microbatches"]) == (2, 2)
    assert metrics["resumed"]["step"] == 6  # (attempt 0 resumed from 4 and saved at 6)
    assert curve(metrics) == pytest.approx(uninterrupted, rel=1e-5, abs=0)
    # a layout that cannot shrink: one line, before any process

    assert main(["--nproc", "2", "--tp", "2", "--pp", "2", "--resume", save]) == 2
    assert capsys.readouterr().err == (
        "hplab: error: 2 processes cannot be split into tp=2 × pp=2 groups: make tp × pp "
        "divide the number of processes (a checkpoint reshards into any layout)\n"
    )


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
        ("6:1:kill-in-save", "only rank 0 writes checkpoints"),
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
