"""Failures at scale, injected for real (HPLAB_FAULT): a killed or frozen rank costs only the
steps since the last checkpoint. `train.py --nproc --max-restarts` stops every rank and starts
them again from --save's newest checkpoint, one line per restart; under torchrun a restarted
train.py resumes by itself; the recovered loss curve equals an uninterrupted run's on one
process.
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

from hplab.runtime import faults
from hplab.runtime.group import free_port
from hplab.runtime.launch import what_failed

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "hplab" / "train.py")
RUN = ["--steps", "8", "--batch-size", "8", "--no-progress"]


def environment(fault: str, timeout_s) -> dict:
    """This process's environment for a job's launcher, less any torchrun variables, with
    HPLAB_FAULT and HPLAB_TIMEOUT_S (how long a frozen peer takes to notice: a restart's ranks
    must also meet within it, each importing torch afresh)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HPLAB_FAULT=fault, HPLAB_TIMEOUT_S=str(timeout_s))
    return env


def train(tmp_path, name: str, *flags: str, fault="", timeout_s=60, nproc=2):
    """A run of `train.py --nproc`: (exit code, hplab lines, metrics)."""
    metrics = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, TRAIN, *RUN, "--metrics", str(metrics), *flags, "--nproc", str(nproc)],
        cwd=tmp_path,
        env=environment(fault, timeout_s),
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
    """One process, never interrupted: the curve every recovered layout must equal."""
    code, lines, metrics = train(tmp_path_factory.mktemp("plain"), "plain", nproc=1)
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


def test_a_lone_frozen_rank_is_seen_by_its_heartbeat_and_restarted(tmp_path, uninterrupted):
    """One process frozen at step 5 has no peer whose collective would time out: its launcher
    sees its heartbeat stop (HPLAB_TIMEOUT_S, here 5 s), restarts it from the checkpoint of
    step 3, and the curve is unchanged."""
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-every", "3", "--max-restarts", "1"]
    code, lines, metrics = train(tmp_path, "frozen", *flags, fault="5:0:hang", timeout_s=5, nproc=1)
    assert code == 0, lines
    assert lines == [
        "hplab: restart 1 of 1: process 0 stopped responding at step 5: no sign of life for "
        "5 s (HPLAB_TIMEOUT_S sets how long); resuming from step 3"
    ]
    assert curve(metrics) == pytest.approx(uninterrupted, rel=1e-5, abs=0)


def _killed_rank(argv: list[str]) -> int:
    """A rank of `launch` (forked): rank 1 is killed at step 1; rank 0 then finds its peer
    gone, as gloo would tell it, and says so in the status folder."""
    from hplab.runtime.launch import note_error, note_step

    note_step(1)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
    note_error("all_reduce in the dp group (ranks [0, 1]) lost its connection: a peer ended")
    return 2


def test_after_its_last_restart_the_job_ends_with_one_line(capsys):
    """The launcher itself, its ranks forked from here: every attempt is killed at step 1."""
    from hplab.runtime.launch import launch

    code = launch(2, [], _killed_rank, "train.py", max_restarts=1, restart=lambda attempt: 0)
    assert code == 1
    assert capsys.readouterr().err.splitlines() == [
        "hplab: restart 1 of 1: process 1 was killed by SIGKILL at step 1; resuming from step 0",
        "hplab: error: process 1 was killed by SIGKILL at step 1 (out of memory?) "
        "(1 restart used: --max-restarts 1)",
    ]


def _killed_at_once(argv: list[str]) -> int:
    """A rank of `launch` (forked) killed before its first step, in every attempt."""
    os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_a_restart_loop_of_instant_deaths_backs_off(capsys):
    """Attempts that die before their first step restart after 1 s, then 2 s (at most 16 s):
    a loop of instant failures does not spin."""
    from hplab.runtime.launch import backoff_s, launch

    assert [backoff_s(a) for a in range(6)] == [1, 2, 4, 8, 16, 16]
    start = time.monotonic()
    code = launch(1, [], _killed_at_once, "train.py", max_restarts=2, restart=lambda attempt: 0)
    assert code == 1 and time.monotonic() - start >= 3
    assert capsys.readouterr().err.splitlines()[-1] == (
        "hplab: error: process 0 was killed by SIGKILL before its first step (out of memory?) "
        "(2 restarts used: --max-restarts 2)"
    )


def test_a_failure_after_the_last_checkpoint_completes_the_job(capsys):
    """A rank lost after the last save (its checkpoint holds every step): `restart` says
    there is nothing left (None), and the job ends well, with one line."""
    from hplab.runtime.launch import launch

    code = launch(2, [], _killed_rank, "train.py", max_restarts=1, restart=lambda attempt: None)
    assert code == 0
    assert capsys.readouterr().err.splitlines() == [
        "hplab: process 1 was killed by SIGKILL at step 1, after the last checkpoint: the run "
        "is complete"
    ]


def elastic_node(tmp_path, name: str, port: int, *args: str, host: bool) -> subprocess.Popen:
    """One node of an elastic torchrun job (--nnodes 1:2): its own agent and one process,
    meeting the other node at a c10d rendezvous on `port`; `host` holds the rendezvous store.
    The rendezvous is tuned for one machine: a node silent for 2 s is gone, and a round closes
    2 s after its first member arrived. Every rank 1 hangs at step 6 of the first attempt."""
    quick = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1"),
        *("--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"),
        *("--rdzv-id=elastic", f"--rdzv-conf=is_host={str(host).lower()},{quick}", TRAIN),
        *args,
    ]
    env = environment("6:1:hang", 60)
    with open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )


def step_saved(save: Path) -> int | None:
    try:
        return json.loads((save / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError):
        return None


def test_an_elastic_torchrun_job_that_loses_a_node_resumes_on_fewer_processes(
    tmp_path, uninterrupted, capsys
):
    """An elastic torchrun job of two nodes (`--nnodes 1:2`, one process each) with --resume
    auto, which starts fresh (no checkpoint yet). It saves at step 6; node 2's rank hangs; node
    2 is lost (its agent and its rank SIGKILLed: no goodbye to the rendezvous). Node 1's rank
    loses its peer, its agent restarts it (--max-restarts 1) in a new rendezvous round of one
    node, and train.py resumes by itself from step 6 on 1 process: the global batch stays, in
    twice the microbatches (each rank's microbatch, and its memory, as before). The curve
    equals an uninterrupted run's. The same command again has nothing left to do."""
    save = tmp_path / "ckpt"
    args = [*RUN, "--save", str(save), "--save-every", "3", "--resume", "auto"]
    port = free_port()
    node1 = elastic_node(tmp_path, "node1", port, *args, "--metrics", "m.json", host=True)
    node2 = elastic_node(tmp_path, "node2", port, *args, host=False)
    try:
        deadline = time.monotonic() + 120
        while step_saved(save) != 6 and node1.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert step_saved(save) == 6, (tmp_path / "node1.err").read_text()[-3000:]
        workers = Path(f"/proc/{node2.pid}/task/{node2.pid}/children").read_text().split()
        for pid in [node2.pid, *map(int, workers)]:  # the node is lost: agent and rank at once
            os.kill(pid, signal.SIGKILL)
        assert node1.wait(timeout=120) == 0, (tmp_path / "node1.err").read_text()[-3000:]
    finally:
        for node in (node1, node2):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["world_size"] == 1 and metrics["resumed"]["step"] == 6
    assert (metrics["config"]["dp"], metrics["config"]["microbatches"]) == (1, 2)
    assert curve(metrics) == pytest.approx(uninterrupted, rel=1e-5, abs=0)
    said = (tmp_path / "node1.err").read_text()  # hplab's line, not gloo's C++ file and line
    assert "Traceback" not in said and "pair.cc" not in said and "lost its connection" in said
    from hplab.train import main  # done already: one line, before any process

    assert main([*args, "--nproc", "2"]) == 0
    assert capsys.readouterr().err == (
        f"hplab: {save} already holds all 8 steps: nothing is left to train\n"
    )
    # a layout that cannot shrink: one line, before any process
    assert main(["--nproc", "2", "--tp", "2", "--pp", "2", "--resume", str(save)]) == 2
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
