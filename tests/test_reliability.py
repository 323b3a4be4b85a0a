"""Faults a user meets, injected for real: processes that exit, freeze or lose their launcher,
damaged files, folders full of someone's files, bad flags.

Each test asserts what the user sees: the run ends (never hangs), nothing of theirs is lost or
changed, and the message is one `hplab:` line with no traceback through hplab's code.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hplab
from hplab.runtime.group import shutdown
from hplab.runtime.launch import run_distributed, torchrun_command

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "hplab" / "train.py")
LINUX = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")


def clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
    }
    return {**env, **extra}


def hplab_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("hplab:")]


def no_hplab_traceback(text: str) -> bool:
    return not any(
        "hplab/" in line and line.strip().startswith("File ") for line in text.splitlines()
    )


def tagged_processes(tag: str) -> list[int]:
    """Pids of the training workers carrying `tag` in their environment: the tagged processes
    whose parent (the launcher: torchrun or train.py --nproc, which forks them) is tagged too."""

    def tagged(pid) -> bool:
        try:
            return f"HPLAB_FAULT_TAG={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False

    def parent(pid) -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            return "0"

    return [
        int(e.name)
        for e in Path("/proc").iterdir()
        if e.name.isdigit() and tagged(e.name) and tagged(parent(e.name))
    ]


def start_training(
    tag: str, *flags: str, torchrun: bool = False, timeout_s: int = 8, settle_s: float = 1
):
    """A 2-process training run that would take minutes; returns (launcher, worker pids)."""
    launcher = launch_training(tag, *flags, torchrun=torchrun, timeout_s=timeout_s)
    return launcher, wait_for_workers(launcher, tag, settle_s)


def launch_training(tag: str, *flags: str, torchrun: bool = False, timeout_s: int = 8):
    args = ["--steps", "100000", "--no-progress", *flags]
    cmd = (
        torchrun_command(2, TRAIN, *args)
        if torchrun
        else [sys.executable, TRAIN, "--nproc", "2", *args]
    )
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(HPLAB_FAULT_TAG=tag, HPLAB_TIMEOUT_S=str(timeout_s)),
    )


def wait_for_workers(launcher, tag: str, settle_s: float) -> list[int]:
    """The pids of its 2 workers once both exist (and, with `settle_s`, train)."""
    deadline = time.monotonic() + 90
    while len(workers := tagged_processes(tag)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    if len(workers) != 2:  # never leave a run of 100,000 steps behind (its ranks die with it)
        launcher.kill()
        pytest.fail(f"the workers did not start: {launcher.communicate()[1][-2000:]}")
    if settle_s:  # into training: every worker has joined the group (gloo's threads run)
        while not all(gloo_threads(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(settle_s)
    return workers


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]
        ]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


# --- exit: gloo's threads ----------------------------------------------------------------


def gloo_threads(pid: int | str = "self") -> list[str]:
    try:
        return [
            name
            for t in Path(f"/proc/{pid}/task").iterdir()
            if "gloo" in (name := (t / "comm").read_text().strip())
        ]
    except OSError:  # the process or a thread has just ended
        return []


def _train_then_shut_down():
    """An ordinary DDP loop; the optimizer's first use imports torch modules that take the
    world group as a default argument (they used to keep it, and gloo's threads, alive)."""
    model = hplab.DDP(torch.nn.Linear(8, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    before = gloo_threads()
    shutdown()
    return before, gloo_threads()


@LINUX
def test_shutdown_joins_gloo_threads_while_python_is_alive():
    """gloo's threads drop a collective's tensors just after wait() returns, taking the GIL;
    if Python is finalizing by then the process aborts ("terminate called without an active
    exception", a flaky exit code -6 in CI). shutdown() must leave no gloo thread behind."""
    for before, after in run_distributed(_train_then_shut_down, 2):
        assert before, "the check itself is broken: no gloo thread was running"
        assert after == [], f"gloo threads still running after shutdown: {after}"


# --- hangs and launchers -------------------------------------------------------------------


@LINUX
def test_a_killed_rank_is_named_and_the_job_ends():
    tag = uuid.uuid4().hex
    launcher, workers = start_training(tag)
    os.kill(max(workers), signal.SIGKILL)  # e.g. the out-of-memory killer
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert any("was killed by SIGKILL" in line for line in hplab_lines(err)), err[-2000:]
    assert no_hplab_traceback(err) and "Traceback" not in err, err[-2000:]
    assert wait_gone(workers, 10) == []


@LINUX
def test_workers_die_with_their_launcher():
    """Also when the launcher dies while its workers are still importing torch (before they
    could ask for PR_SET_PDEATHSIG): they used to train on, orphaned, for good. Four launchers
    at once, train.py --nproc and torchrun, each killed (SIGKILL: it can pass nothing on) as
    soon as its workers exist, or once they train."""
    runs = {
        (torchrun, settle_s): (tag := uuid.uuid4().hex, launch_training(tag, torchrun=torchrun))
        for settle_s in (0, 1)  # starting, training
        for torchrun in (False, True)
    }
    workers = {}
    try:
        for (torchrun, settle_s), (tag, launcher) in runs.items():
            workers[torchrun, settle_s] = wait_for_workers(launcher, tag, settle_s)
            launcher.kill()
    finally:  # (a failure above leaves no run of 100,000 steps behind)
        for _, launcher in runs.values():
            launcher.kill()
            launcher.communicate()
    for key, pids in workers.items():
        assert wait_gone(pids, 15) == [], f"workers outlived their launcher: {key}"


@LINUX
def test_ctrl_c_stops_every_process_with_one_line():
    tag = uuid.uuid4().hex
    launcher, workers = start_training(tag)
    os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground group
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130
    assert hplab_lines(err) == ["hplab: interrupted: stopped all 2 processes"], err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert wait_gone(workers, 15) == []


def _rank_1_ends_without_a_result():
    if dist.get_rank() == 1:
        os._exit(3)  # as a crash or the out-of-memory killer would: nothing sent back
    time.sleep(60)  # (its peer: what waited for the whole timeout before)
    return "never"


def test_run_distributed_names_a_rank_that_ended_without_a_result():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 1 ended \(exit code 3\) without a result$"):
        run_distributed(_rank_1_ends_without_a_result, 2, timeout_s=120)
    assert time.monotonic() - start < 30


def ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt  # what Python raises where Ctrl-C's SIGINT arrives


def test_ctrl_c_in_sample_plan_check_and_data_prepare_is_one_line(tmp_path, capsys, monkeypatch):
    """Each command, interrupted inside its work: one line, exit code 130; data prepare, cut
    off as it encodes, leaves no half-written file (its progress bar cleared, the line after)."""
    from hplab import data, sample
    from hplab.course.check import runner
    from hplab.plan import cli

    corpus = tmp_path / "corpus.jsonl"  # (its .bin.tmp is open when encoding starts)
    corpus.write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(1200)))
    monkeypatch.setattr(data, "encode_documents", ctrl_c)
    prefix = str(tmp_path / "o")
    assert data.main(["prepare", "--input", str(corpus), "--output-prefix", prefix]) == 130
    assert capsys.readouterr().err.split("\r")[-1] == "interrupted: nothing was written\n"
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]

    monkeypatch.setattr(sample, "load_model", ctrl_c)
    assert sample.main(["--checkpoint", str(tmp_path), "--prompt", "HAMLET:"]) == 130
    assert capsys.readouterr().err == "hplab: interrupted\n"
    monkeypatch.setattr(runner, "run_check", ctrl_c)
    assert runner.main(["memory"]) == 130
    assert capsys.readouterr().err == "hplab: interrupted\n"
    monkeypatch.setattr(cli, "search", ctrl_c)
    with pytest.raises(SystemExit) as ended:
        cli.main(["--model", "gpt2", "--search", "--gpus", "8"])
    assert ended.value.code == 130 and capsys.readouterr().err == "hplab.plan: interrupted\n"


def with_suppressed(fn, *args):
    try:
        fn(*args)
    except OSError:
        pass


# --- files: nothing of the user's is lost, damage is named ---------------------------------


def run_main(capsys, monkeypatch, *args):
    from hplab.train import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    code = main(list(args))
    return code, capsys.readouterr().err


def fingerprint(folder: Path) -> dict:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_save_never_replaces_someone_elses_files(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "my-project"
    (mine / "notes").mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "notes" / "ideas.txt").write_text("more")
    before = fingerprint(mine)
    a_file = tmp_path / "report.pdf"
    a_file.write_bytes(b"%PDF")
    for target, says in ((mine, "not part of an hplab checkpoint"), (a_file, "is a file")):
        code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--save", str(target))
        assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--metrics", str(a_file))
    assert code == 2 and "not an hplab metrics file" in err, err
    assert fingerprint(mine) == before and a_file.read_bytes() == b"%PDF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-project", "report.pdf"]
    from hplab import checkpoint  # the library refuses too, not only the command line

    with pytest.raises(checkpoint.CheckpointError, match="not part of an hplab checkpoint"):
        checkpoint.save(mine, None, {}, {}, {"step": 0})
    assert fingerprint(mine) == before


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "run"
    done = subprocess.run(
        [sys.executable, TRAIN, "--steps", "2", "--no-progress", "--save", str(folder)],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return folder


def _truncate(folder: Path):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _nan_weights(folder: Path):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _nan_weights_checksum_updated(folder: Path):
    import json

    from hplab.checkpoint import sha256

    _nan_weights(folder)
    state = json.loads((folder / "trainer_state.json").read_text())
    state["checksums"]["model.safetensors"] = sha256(folder / "model.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_truncate, "is damaged"),
        (_nan_weights, "is damaged"),  # the checksum catches it
        (_nan_weights_checksum_updated, "non-finite weights"),
        (lambda f: (f / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (lambda f: (f / "trainer_state.json").write_text("{"), "damaged"),
    ],
    ids=["truncated", "nan", "nan-checksum-forged", "no-optimizer", "no-config", "bad-json"],
)
def test_a_damaged_checkpoint_is_refused_with_one_line(
    saved_checkpoint, damage, says, tmp_path, capsys, monkeypatch
):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(saved_checkpoint, copy)
    damage(copy)
    before = fingerprint(copy)
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--steps", "4", "--resume", str(copy))
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert fingerprint(copy) == before  # refused, not "repaired"


def test_resuming_another_model_shape_is_refused_before_launch(
    saved_checkpoint, capsys, monkeypatch
):
    code, err = run_main(
        capsys,
        monkeypatch,
        "--nproc",
        "2",
        "--steps",
        "4",
        "--n-layer",
        "2",
        "--resume",
        str(saved_checkpoint),
    )
    assert code == 2 and "different model" in err and "n_layer" in err, err


# --- bad flags: one line, before any process starts ---------------------------------------

BAD = [
    (["--microbatches", "0"], "--microbatches: must be at least 1"),
    (["--tp", "0"], "--tp: must be at least 1"),
    (["--pp", "0"], "--pp: must be at least 1"),
    (["--batch-size", "-4"], "--batch-size: must be at least 1"),
    (["--lr", "-1"], "--lr: must be a positive number"),
    (["--tp", "2", "--n-head", "3", "--n-embd", "66"], "3 attention heads do not split"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "33"], "multiple of 2"),
    (["--backend", "nccl"], "--backend nccl needs one GPU per process"),
    (["--seq-len", "100000"], "GiB per process"),
    (["--metrics", "/etc/hostname/m.json"], "is a file, not a folder"),
    (["--config", "configs"], "is not a regular file"),
    # accepted but wrong, or a traceback, before (issue 28)
    (["--lr", "inf"], "--lr: must be a finite number, got inf"),
    (["--moe-experts", "4", "--moe-aux-coef", "nan"], "--moe-aux-coef: must be at least 0"),
    (["--moe-experts", "4", "--moe-capacity-factor", "inf"], "must be a finite number"),
    (["--seed", str(2**70)], "--seed: must be from 0 to 2**63 - 1"),
    (["--save", ""], "--save needs a path, got an empty one"),
    (["--resume", ""], "--resume needs a path, got an empty one"),
    (["--metrics", ""], "--metrics needs a path, got an empty one"),
    (["--metrics", "/dev/null"], "is not a regular file or folder (a device, a FIFO?)"),
    (["--config", "/dev/zero"], "config file /dev/zero is not a regular file"),
    (["--ep", "2"], "--ep 2 shares out a mixture of experts, and this model has none"),
    (["--resume", "auto"], "--resume auto resumes from --save's newest checkpoint: give --save"),
    (["--max-restarts", "2"], "--max-restarts 2 restarts from --save's newest checkpoint"),
    (["--async-save"], "--async-save writes --save's checkpoints: give --save DIR"),
]


@pytest.mark.parametrize(("flags", "says"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_flags_fail_before_launch_with_one_line(flags, says, capsys, monkeypatch):
    if flags[:2] == ["--backend", "nccl"] and torch.cuda.device_count() >= 2:
        pytest.skip("this machine can run NCCL")
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--steps", "1", *flags)
    assert code == 2 and err.count("\n") == 1 and says in err, err


def test_max_restarts_without_a_launcher_is_one_line(tmp_path, capsys, monkeypatch):
    """Without --nproc (or torchrun) no launcher watches the process, so --max-restarts was
    ignored in silence: it is refused before training, saying what to add."""
    save = str(tmp_path / "ckpt")
    code, err = run_main(capsys, monkeypatch, "--max-restarts", "1", "--save", save)
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "--max-restarts 1 restarts the job's processes, which takes a launcher: add --nproc" in err
    )
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("fault", "flags", "says"),
    [
        ("9:0:kill", [], "fail at step 9, but the run has --steps 4: it never gets there"),
        ("2:1:kill@1", [], "in attempt 1, but --max-restarts 0 ends the job after attempt 0"),
        ("2:0:kill-in-save", [], "no checkpoint is written after step 2: give --save DIR"),
        ("3:0:kill-in-save", ["--save-every", "2"], "no checkpoint is written after step 3"),
    ],
)
def test_a_fault_that_can_never_strike_is_one_line(
    fault, flags, says, tmp_path, capsys, monkeypatch
):
    """HPLAB_FAULT planning a failure the run never reaches was accepted in silence: a lesson
    or a test about recovery would then prove nothing."""
    monkeypatch.setenv("HPLAB_FAULT", fault)
    if "--save-every" in flags:
        flags = [*flags, "--save", str(tmp_path / "ckpt")]
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--steps", "4", *flags)
    assert code == 2 and err.count("\n") == 1 and says in err, err


def test_config_values_meet_the_same_checks(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "r.toml"
    for text, says in (
        ("zero = 5", "invalid choice: 5"),
        ('precision = "fp8"', "fp8"),
        ("steps = 2.5", "invalid int value"),
        ("offload = 3", "true or "),
        ("recompute = 3", "invalid choice: '3'"),  # a bare --recompute (true), or its mode
        ("\ufeffsteps = 2\nlr = -1", "--lr: must be a positive number"),
    ):
        recipe.write_text(text, encoding="utf-8")
        code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--config", str(recipe))
        assert code == 2 and err.count("\n") == 1 and says in err, (text, err)


def test_data_that_is_a_fifo_or_a_device_is_one_line(tmp_path, capsys, monkeypatch):
    """Reading a FIFO would wait for a writer, /dev/zero would never end."""
    os.mkfifo(tmp_path / "fifo.bin")
    (tmp_path / "zeros.bin").symlink_to("/dev/zero")
    for name in ("fifo", "zeros"):
        code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--data", str(tmp_path / name))
        assert code == 2 and f"{name}.bin is not a regular file (a FIFO, a device?)" in err, err


def test_a_recipe_giving_one_setting_twice_is_one_line(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text("batch-size = 8\nbatch_size = 4\n")
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--config", str(recipe))
    assert code == 2 and err == (
        f"hplab: error: {recipe}: batch-size and batch_size are the same setting: give it once\n"
    )


def test_the_timeout_must_be_seconds_above_0(monkeypatch):
    from hplab.runtime.group import _timeout_from_env

    for text in ("abc", "inf", "nan", "0", "-1", "1e9"):
        monkeypatch.setenv("HPLAB_TIMEOUT_S", text)
        seconds, problem = _timeout_from_env()
        assert seconds == 120 and problem.startswith(f"HPLAB_TIMEOUT_S={text}: give the"), text
    monkeypatch.setenv("HPLAB_TIMEOUT_S", "7.5")
    assert _timeout_from_env() == (7.5, None)
    done = subprocess.run(  # (read when hplab.runtime.group is imported: said before any process)
        [sys.executable, TRAIN, "--nproc", "2"],
        env=clean_env(HPLAB_TIMEOUT_S="abc"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and hplab_lines(done.stderr) == [
        "hplab: error: HPLAB_TIMEOUT_S=abc: give the seconds a collective may wait for its "
        "peers, a number above 0 and at most 86400 (e.g. 120)"
    ], done.stderr


def _config(**change) -> dict:
    base = dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=2048)
    return {**base, "n_positions": 64, **change}


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (_config(n_layer=10**6), "has n_layer 1000000: a whole number from 1 to 1,024"),
        (_config(n_layer=2.5), "has n_layer 2.5: a whole number"),
        (_config(n_head=[4]), "cannot be read as a gpt2 config"),
        (_config(layer_norm_epsilon=float("nan")), "has layer_norm_epsilon nan"),
        ([1, 2], "is not a JSON object"),
        ({"hplab": {}}, "has an 'hplab' entry without a usable config"),
        ("not json", "is not JSON"),
    ],
    ids=["a million layers", "float size", "list", "NaN epsilon", "a list", "no config", "text"],
)
def test_an_untrusted_config_json_is_one_line(config, says, tmp_path, capsys, monkeypatch):
    import json

    folder = tmp_path / "model"
    folder.mkdir()
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "config.json").write_text(text)
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--init-from", str(folder))
    assert code == 2 and err.count("\n") == 1 and says in err, err


def _edit_state(**change):
    def edit(folder: Path):
        import json

        state = json.loads((folder / "trainer_state.json").read_text())
        if "whole" in change:  # the file is something else altogether
            state = change["whole"]
        else:  # (None: the field is gone)
            state = {k: v for k, v in {**state, **change}.items() if v is not None}
        (folder / "trainer_state.json").write_text(json.dumps(state))

    return edit


def _integer_and_float8_weights(folder: Path):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    first, second = list(state)[:2]
    state[first] = state[first].to(torch.int32)
    state[second] = state[second].to(torch.float8_e4m3fn)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "trainer_state.json").unlink()  # (a Hugging Face folder: --init-from)


@pytest.mark.parametrize(
    ("damage", "flag", "says"),
    [
        (_edit_state(whole=[1]), "--resume", "is damaged and cannot be read"),
        (_edit_state(step=None), "--resume", "has step None, not a whole number"),
        (_edit_state(step="3"), "--resume", "has step '3', not a whole number"),
        (_edit_state(step=-1), "--resume", "has step -1, not a whole number"),
        (_edit_state(config={}), "--resume", "lacks the flags of the run that saved it"),
        (_edit_state(losses=5), "--resume", "losses are not a list of numbers"),
        (_edit_state(lr_scheduler=[]), "--resume", "lr_scheduler has no last_epoch"),
        (_integer_and_float8_weights, "--init-from", "not float32, bfloat16 or float16"),
    ],
    ids=["a list", "no step", "text step", "negative step", "no config", "losses", "lr", "int"],
)
def test_a_damaged_trainer_state_or_odd_weights_are_one_line(
    saved_checkpoint, damage, flag, says, tmp_path, capsys, monkeypatch
):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(saved_checkpoint, copy)
    damage(copy)
    before = fingerprint(copy)
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--steps", "4", flag, str(copy))
    assert code == 2 and err.count("\n") == 1 and says in err, err
    assert fingerprint(copy) == before


def test_a_save_folder_in_use_by_another_run_is_one_line(tmp_path, capsys, monkeypatch):
    """Two runs saving to one folder would delete each other's half-written saves: the second
    is refused while the first holds the folder's lock (here: another process holds it)."""
    folder = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(tmp_path / ".ckpt.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--save", str(folder))
        assert code == 2 and "--save " in err and "is being written by another run" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert not folder.exists()


def test_saving_through_a_link_keeps_the_link(saved_checkpoint, tmp_path):
    import shutil

    target, link = tmp_path / "real", tmp_path / "link"
    shutil.copytree(saved_checkpoint, target)
    link.symlink_to(target)
    from hplab import checkpoint

    saved = checkpoint.load(link)
    checkpoint.save(link, saved["config"], saved["model"], {}, {"step": 3})
    assert link.is_symlink() and checkpoint.load(link)["trainer_state"]["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(checkpoint.CheckpointError, match="is a symbolic link to nothing"):
        checkpoint.check_save_target(tmp_path / "gone")


def test_data_prepare_never_writes_over_a_file(tmp_path, capsys):
    from hplab.data import main as data_main

    corpus = tmp_path / "corpus.json"  # its own output would be corpus.json
    corpus.write_text('{"text": "hello there"}\n')
    mine = tmp_path / "notes.json"
    mine.write_text("my notes")
    for argv, says in (
        (["--input", str(corpus), "--output-prefix", str(tmp_path / "corpus")], "over the input"),
        (["--input", str(corpus), "--output-prefix", str(tmp_path / "notes")], "not a token file"),
    ):
        assert data_main(["prepare", *argv]) == 2
        assert says in capsys.readouterr().err
    assert mine.read_text() == "my notes" and corpus.read_text() == '{"text": "hello there"}\n'
    out = str(tmp_path / "tokens")
    assert data_main(["prepare", "--input", str(corpus), "--output-prefix", out]) == 0
    assert data_main(["prepare", "--input", str(corpus), "--output-prefix", out]) == 0  # again
    surrogate = tmp_path / "odd.jsonl"
    surrogate.write_text('{"text": "a\\ud800b"}\n')
    assert data_main(["prepare", "--input", str(surrogate), "--output-prefix", out]) == 2
    assert "holds a lone surrogate" in capsys.readouterr().err


def test_the_examples_refuse_bad_input_in_one_line(saved_checkpoint, tmp_path, capsys):
    import runpy

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        finetune = runpy.run_path(str(ROOT / "examples" / "finetune_classification.py"))
    finally:
        sys.path.remove(str(ROOT / "examples"))
    mine = tmp_path / "results.json"
    mine.write_text("mine")
    assert finetune["main"](["--init", str(saved_checkpoint), "--out", str(mine)]) == 2
    assert "--out" in capsys.readouterr().err and mine.read_text() == "mine"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_loop.py"), "--batch-size", "0"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "need --steps and --batch-size of at least 1" in done.stderr


def run_all(commands: list[list[str]], at_once: int = 6) -> list[subprocess.CompletedProcess]:
    """Run the commands, `at_once` at a time (they fail fast: before training)."""
    done = []
    for i in range(0, len(commands), at_once):
        procs = [
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=clean_env(),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for cmd in commands[i : i + at_once]
        ]
        done += [
            subprocess.CompletedProcess(p.args, p.returncode, *p.communicate(timeout=180))
            for p in procs
        ]
    return done


def test_every_bad_flag_through_torchrun_says_its_line():
    """Under torchrun every rank finds the error, and torchrun stops all ranks as soon as one
    exits: the line must still come out (rank 0 says it, the others wait), each time. (Through
    --nproc the same checks run before any process starts: the test above.) Every refusal
    reaches the same `except` in train.main; one of each path to it: argparse's range checks
    (--tp 0) and the layout (heads); the output folder's (--metrics) is the same `except`."""
    cases = [BAD[1], BAD[5]]
    cases += cases[1:2]  # the heads once more: a race shows as a lost line
    done = run_all([torchrun_command(2, TRAIN, "--steps", "1", *flags) for flags, _ in cases])
    for (flags, says), result in zip(cases, done):
        assert result.returncode != 0, flags
        assert any(says in line for line in hplab_lines(result.stderr)), (
            flags,
            result.stderr[-2000:],
        )
        assert no_hplab_traceback(result.stderr), (flags, result.stderr[-2000:])


# --- a checkpoint folder belongs to one run (issue: correctness first) -------------------------


def test_a_save_folder_named_through_a_link_shares_its_lock(tmp_path, capsys, monkeypatch):
    """The lock is keyed on the folder's real path: a second run naming the same folder through
    a symbolic link is refused too (it would delete the first one's save as it is written)."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(tmp_path / ".real.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--save", str(link))
        assert code == 2 and "is being written by another run" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert list(real.iterdir()) == []


def test_a_fifo_where_the_lock_goes_is_one_line(tmp_path, capsys, monkeypatch):
    os.mkfifo(tmp_path / ".ckpt.lock")  # (opening it to write would wait for a reader forever)
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--save", str(tmp_path / "ckpt"))
    assert code == 2 and err.count("\n") == 1 and "is not a regular file" in err, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("name", ["/dev/zero", "../secret.txt", "fifo"])
def test_checksum_names_are_files_of_the_checkpoint(
    saved_checkpoint, name, tmp_path, capsys, monkeypatch
):
    """trainer_state.json's checksums name the checkpoint's own files: /dev/zero made --resume
    read for ever, and any path would let it read any file on the machine."""
    import json
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(saved_checkpoint, copy)
    (tmp_path / "secret.txt").write_text("not yours")
    os.mkfifo(copy / "fifo")
    state = json.loads((copy / "trainer_state.json").read_text())
    state["checksums"][name] = "0" * 64
    (copy / "trainer_state.json").write_text(json.dumps(state))
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--steps", "4", "--resume", str(copy))
    assert code == 2 and err.count("\n") == 1 and "which is not a file of a checkpoint" in err, err


def test_a_checkpoint_file_that_is_a_fifo_is_one_line(
    saved_checkpoint, tmp_path, capsys, monkeypatch
):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(saved_checkpoint, copy)
    (copy / "rng.safetensors").unlink()
    os.mkfifo(copy / "rng.safetensors")
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--steps", "4", "--resume", str(copy))
    assert code == 2 and err.count("\n") == 1 and "rng.safetensors is not a regular file" in err


@pytest.mark.parametrize(
    ("shard", "says"),
    [("fifo.safetensors", "fifo.safetensors is not a regular file"),
     ("../model.safetensors", "expected the name of a .safetensors file in the same folder")],
)  # fmt: skip
def test_a_shard_index_names_files_of_its_folder(
    saved_checkpoint, shard, says, tmp_path, capsys, monkeypatch
):
    """A sharded model's index names its shards: a FIFO among them blocked --init-from, and a
    path outside the folder would read anyone's file."""
    import json
    import shutil

    from safetensors.torch import load_file

    hf = tmp_path / "hf"
    shutil.copytree(saved_checkpoint, hf)
    names = list(load_file(hf / "model.safetensors"))
    for extra in ("trainer_state.json", "optimizer.safetensors", "rng.safetensors"):
        (hf / extra).unlink()  # (a Hugging Face folder, as save_pretrained writes one)
    os.mkfifo(hf / "fifo.safetensors")
    index = {"weight_map": dict.fromkeys(names, shard)}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run_main(capsys, monkeypatch, "--nproc", "2", "--init-from", str(hf))
    assert code == 2 and err.count("\n") == 1 and says in err, err


def test_resume_auto_never_takes_another_runs_checkpoint(
    saved_checkpoint, tmp_path, capsys, monkeypatch
):
    """A run with its own seed whose --save holds an older run's checkpoint does not go on from
    it (the two runs' losses would read as one history): --resume auto says so in one line."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(saved_checkpoint, copy)
    before = fingerprint(copy)
    flags = ["--nproc", "2", "--steps", "4", "--save", str(copy), "--resume", "auto"]
    code, err = run_main(capsys, monkeypatch, *flags, "--seed", "7", "--lr", "2e-3")
    assert code == 2 and err.count("\n") == 1, err
    assert "holds the checkpoint of another run (--seed 0, this run 7; --lr" in err, err
    assert f"resume it with --resume {copy}" in err
    assert fingerprint(copy) == before


def test_a_restart_goes_on_only_from_its_own_runs_checkpoint(saved_checkpoint, monkeypatch):
    """A restart (attempt 1) resumes from --save only if this run wrote the checkpoint there;
    a new run killed before its own first save starts afresh again, as its first attempt did."""
    from hplab.cli import parse_args
    from hplab.preflight import resume_point

    monkeypatch.setenv("HPLAB_ATTEMPT", "1")
    for seed, resumes in (("0", str(saved_checkpoint)), ("7", None)):
        args = parse_args(["--steps", "4", "--save", str(saved_checkpoint), "--seed", seed])
        resume_point(args)
        assert args.resume == resumes, seed
