"""Starting and watching processes: the launcher's side of distributed training.

Every "device" in hplab is one operating-system process. `torchrun` (or `train.py --nproc N`,
which does the same job itself after checking the flags) starts N of them, gives each its
place through environment variables (`dist.torchrun_env`: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), watches them, and stops them all when one fails or on Ctrl-C.

    launch(nproc, argv, run_rank)   train.py --nproc N: N ranks, forked from this process
                                    (fresh interpreters on a GPU machine), watched to the end
    run_distributed(fn, n, *args)   tests and checkers: fn on n processes, results by rank
    start_forked(main, argv, ...)   notebooks: a command such as train.py's `main`, forked
                                    from a process that has imported torch and hplab once
    torchrun_command(n, script)     the torchrun command line, for notebooks and tests
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from hplab.runtime.group import (
    DEFAULT_TIMEOUT_S,
    PRELOAD,
    free_port,
    import_before_the_group_exists,
    init_distributed,
    shutdown,
    torchrun_env,
)

# What the forkserver of run_distributed and start_train imports once, before it forks.
FORKSERVER_PRELOAD = [*PRELOAD, "hplab.train"]

# --- train.py --nproc N: start N ranks, watch them, stop them all, start them again ----------


def launch(nproc: int, argv: list[str], run_rank, script: str, max_restarts=0, restart=None) -> int:
    """Start `nproc` ranks of `run_rank(argv)` and watch them as torchrun would: one fails or
    Ctrl-C, all stop; returns the job's exit code. The ranks are forked from this process once
    it has imported torch and hplab, instead of N fresh interpreters importing them (~3 s of CPU
    each), except on a GPU machine, where CUDA does not survive a fork: then each rank runs
    `python script argv` afresh.

    When an attempt fails (a process killed or ended by an error, a collective timed out) and
    restarts are left, every rank is started again, as torchelastic does: `restart(attempt)`
    (train.py's: check everything again, find the checkpoint to resume from) returns the step
    the next attempt resumes from (None: nothing is left to train), and one line says so. Each
    rank tells the launcher its step and its error through files in a status folder
    (`note_step`, `note_error`), so that one line can name the process that brought the job
    down and where."""
    import_before_the_group_exists()
    history = []  # the failed attempts, for the metrics file (HPLAB_RESTARTS)
    for attempt in itertools.count():
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="hplab-status-") as status:
            ended = _attempt(nproc, argv, run_rank, script, attempt, status, history)
        if ended is None or ended[1] == 130:  # finished, or Ctrl-C (said already)
            return 0 if ended is None else 130
        why, code, step, retry = ended
        history.append(dict(attempt=attempt, why=why, failed_at_step=step))
        history[-1]["seconds"] = round(time.monotonic() - start, 3)
        if attempt == max_restarts or not retry:
            oom = " (out of memory?)" * ("by SIGKILL" in why)
            used = _used(max_restarts) if retry else ""
            print(f"hplab: error: {why}{oom}{used}", file=sys.stderr)
            return code
        try:
            history[-1]["resumed_from_step"] = resumed = restart(attempt + 1)
        except ValueError as err:  # e.g. the checkpoint it would resume from is damaged
            print(f"hplab: error: {why}; cannot restart: {err}", file=sys.stderr)
            return 2
        if resumed is None:  # its checkpoint holds every step: the run is done
            print(f"hplab: {why}, after the last checkpoint: the run is complete", file=sys.stderr)
            return 0
        print(
            f"hplab: restart {attempt + 1} of {max_restarts}: {why}; resuming from step {resumed}",
            file=sys.stderr,
        )
        if step is None:  # it died before its first step: give what killed it time to pass
            time.sleep(backoff_s(attempt))
    return 1  # (unreachable: count() does not end)


def backoff_s(attempt: int) -> float:
    """How long to wait before restarting an attempt that died before its first step: 1 s,
    then twice as long each time, at most 16 s (a loop of instant deaths must not spin)."""
    return float(min(2**attempt, 16))


def _used(n: int) -> str:
    return f" ({n} restart{'s' * (n > 1)} used: --max-restarts {n})" if n else ""


def _attempt(nproc, argv, run_rank, script, attempt: int, status: str, history) -> tuple | None:
    """One attempt: start every rank, watch them; None when all finished, else `what_failed`'s
    (one line, exit code, step, whether a restart may help); (…, 130, …) after Ctrl-C."""
    port = free_port()
    workers = Workers()
    fork = not torch.cuda.is_available()
    extra = {STATUS_DIR: status, "HPLAB_ATTEMPT": str(attempt)}
    extra["HPLAB_RESTARTS"] = json.dumps(history)  # (rank 0 puts them in the metrics)
    try:  # start them (a Ctrl-C meanwhile waits until all are started), then watch them
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        sys.stdout.flush(), sys.stderr.flush()  # or every child would print it again
        for rank in range(nproc):
            env = {**torchrun_env(rank, nproc, port), **extra}
            if not fork:  # Ctrl-C reaches only the launcher
                environment = {"OMP_NUM_THREADS": "1", **os.environ, **env}
                command = [sys.executable, script, *argv]
                pid = subprocess.Popen(command, start_new_session=True, env=environment).pid
            elif (pid := os.fork()) == 0:
                run_forked_rank(env, argv, run_rank)
            workers.pids.append(pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        # a rank alone has no peer to time out waiting for it: its silence is the sign; with
        # peers, they say it first (the second timeout is for a job whose ranks all froze)
        silence_s = DEFAULT_TIMEOUT_S * (1 if nproc == 1 else 2)
        frozen = workers.watch(Path(status), silence_s)
    except KeyboardInterrupt:
        workers.stop_all()
        print(f"hplab: interrupted: stopped all {nproc} processes", file=sys.stderr)
        return "interrupted", 130, None, False
    codes = {rank: workers.poll(pid) for rank, pid in enumerate(workers.pids)}  # None: running
    workers.stop_all()
    if frozen is not None:  # (no peer timed out: it was alone, or they all froze)
        return silent(frozen, Path(status), nproc, silence_s)
    return what_failed(codes, Path(status))


def silent(rank: int, status: Path, nproc: int, seconds: float) -> tuple:
    """`what_failed`'s answer for a rank that stopped showing signs of life (`heartbeat`)."""
    steps, _ = read_status(status, nproc)
    where = f" at step {steps[rank]}" if rank in steps else " before its first step"
    return (
        f"process {rank} stopped responding{where}: no sign of life for {seconds:g} s "
        "(HPLAB_TIMEOUT_S sets how long)",
        1,
        steps.get(rank),
        rank in steps,
    )


def what_failed(codes: dict[int, int | None], status: Path) -> tuple | None:
    """(one line, exit code, step, whether a restart may help) naming the process that brought
    the job down and the step it was at, or None if every rank ended well (`codes`: each rank's
    exit code, None if it still ran when the others had failed). A killed process first (it
    could say nothing); then one that failed on its own; then one still running when its peers
    timed out waiting for it (frozen); else the first that timed out or lost its peers. A
    failure before any step that was not a kill is a refusal: a restart would not help."""
    steps, errors = read_status(status, len(codes))
    still_running = [rank for rank, code in codes.items() if code is None]

    def at(rank: int) -> str:
        return f" at step {steps[rank]}" if rank in steps else " before its first step"

    def about_peers(rank: int) -> bool:
        return any(s in errors.get(rank, "") for s in ("timed out", "lost its connection"))

    failed = [rank for rank, code in codes.items() if code]
    if not failed:
        return None
    if killed := [rank for rank in failed if codes[rank] < 0]:
        name = signal.Signals(-codes[killed[0]]).name
        return (
            f"process {killed[0]} was killed by {name}{at(killed[0])}",
            1,
            steps.get(killed[0]),
            True,
        )
    own = [rank for rank in failed if not about_peers(rank)] or failed
    rank = own[0]
    timed_out = any("timed out" in errors.get(r, "") for r in failed)
    if own == failed and timed_out and still_running:
        return (
            f"process {still_running[0]} stopped responding{at(still_running[0])}: its peers "
            "timed out waiting for it",
            codes[rank],
            steps.get(still_running[0]),
            still_running[0] in steps,
        )
    why = errors.get(rank, f"exit code {codes[rank]}")
    # (a failure before any step is a refusal: it would only fail again)
    return f"process {rank} failed{at(rank)}: {why}", codes[rank], steps.get(rank), rank in steps


# --- what a rank tells its launcher: its step, its error -------------------------------------
STATUS_DIR = "HPLAB_STATUS_DIR"  # set by launch for its ranks; absent under torchrun
_STEP_FILE: list = []  # this rank's open step file, once opened


def supervised() -> bool:
    """Whether this rank's launcher reads its status (train.py --nproc): it then reports its
    errors there, and the launcher says in one line which process failed, where and why."""
    return bool(os.environ.get(STATUS_DIR))


def note_step(step: int) -> None:
    """Tell the launcher that this rank starts step `step` (a fixed-width write in place); the
    first call also starts the rank's heartbeat."""
    if not supervised():
        return
    if not _STEP_FILE:
        path = Path(os.environ[STATUS_DIR]) / f"rank{os.environ.get('RANK', 0)}.step"
        _STEP_FILE.append(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        threading.Thread(target=heartbeat, args=(path.with_suffix(".alive"),), daemon=True).start()
    os.pwrite(_STEP_FILE[0], f"{step:>20}\n".encode(), 0)


def heartbeat(path: Path, every_s: float = 1.0) -> None:
    """Touch `path` every second while this process lives and runs. A frozen rank (stopped, or
    stuck with no thread scheduled) stops touching it: a rank alone has no peer whose
    collective would time out, so its launcher watches this instead (`Workers.watch`)."""
    path.touch()
    while True:
        time.sleep(every_s)
        with contextlib.suppress(OSError):  # (the launcher removed the folder: it is ending)
            os.utime(path)


def note_error(message: str) -> None:
    """Tell the launcher this rank's error (one line), which it names if this rank failed."""
    path = Path(os.environ[STATUS_DIR]) / f"rank{os.environ.get('RANK', 0)}.error"
    path.write_text(message)


def read_status(status: Path, nproc: int) -> tuple[dict[int, int], dict[int, str]]:
    """({rank: the step it started last}, {rank: its error}) from the status folder."""
    steps = {}
    errors = {}
    for rank in range(nproc):
        try:
            steps[rank] = int((status / f"rank{rank}.step").read_text())
        except (OSError, ValueError):
            pass
        try:
            errors[rank] = (status / f"rank{rank}.error").read_text().strip()
        except OSError:
            pass
    return steps, errors


class Workers:
    """The ranks of one job (their pids, in rank order) and the exit codes of those that ended
    (-N: killed by signal N)."""

    def __init__(self):
        self.pids: list[int] = []
        self.codes: dict[int, int] = {}

    def poll(self, pid: int) -> int | None:
        """Its exit code, or None while it runs."""
        if pid not in self.codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
            self.codes[pid] = os.waitstatus_to_exitcode(done[1])
        return self.codes.get(pid)

    def running(self) -> bool:
        return any(self.poll(pid) is None for pid in self.pids)

    def watch(self, status: Path, silence_s: float) -> int | None:
        """Wait until all end or one fails; then give the others 3 s to end too (cut off from
        it, they fail on their own and say why), and return None. A rank whose heartbeat in
        `status` is older than `silence_s` (the collective timeout) is frozen: its rank is
        returned at once (with peers, they would have timed out waiting for it by then)."""
        while not any(self.poll(pid) for pid in self.pids) and self.running():
            if (frozen := self.silent_rank(status, silence_s)) is not None:
                return frozen
            time.sleep(0.1)
        deadline = time.monotonic() + 3
        while any(self.codes.values()) and self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        return None

    def silent_rank(self, status: Path, silence_s: float) -> int | None:
        """The first running rank whose heartbeat has not been seen for `silence_s`."""
        now = time.time()
        for rank, pid in enumerate(self.pids):
            try:
                last = (status / f"rank{rank}.alive").stat().st_mtime
            except OSError:  # (not started yet, or no heartbeat: nothing to judge)
                continue
            if now - last > silence_s and self.poll(pid) is None:
                return rank
        return None

    def stop_all(self) -> None:
        """SIGTERM then SIGCONT (a stopped process ends on waking, saying nothing) to every rank
        still running; SIGKILL after 5 s. A second Ctrl-C does not cut this short."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for pid in self.pids:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                if self.poll(pid) is None:
                    os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in (pid for pid in self.pids if self.poll(pid) is None):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.codes[pid] = -signal.SIGKILL
        signal.signal(signal.SIGINT, previous)


def run_forked_rank(env: dict[str, str], argv: list[str], run_rank) -> None:
    """One rank of `--nproc N`, just forked: out of the terminal's process group (Ctrl-C reaches
    the launcher, which stops every rank), then as under torchrun. It never returns into the
    launcher's code."""
    code = 1
    try:
        os.setsid()  # (it dies with the launcher: init_distributed asks Linux for that)
        os.environ.update(env)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # N share the cores
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        code = run_rank(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


# --- tests and checkers: a function on n processes ---------------------------------------------


def _child(fn, rank, world_size, port, args, results, backend, timeout_s):
    os.environ.update(torchrun_env(rank, world_size, port))
    torch.set_num_threads(1)
    try:
        init_distributed(backend, timeout_s)
        # pickled here, tensors by value: through the queue, torch would share their memory,
        # and the parent could rebuild them only while this process lives (it may have gone)
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report every failure to the parent, then exit
        results.put((rank, False, traceback.format_exc()))
    finally:
        shutdown()


def run_distributed(
    fn, world_size: int, *args, backend: str | None = "gloo", timeout_s: float = 300.0
) -> list:
    """Run `fn(*args)` on `world_size` fresh processes joined in one process group (gloo by
    default) on a free local port; return the results by rank. `fn` must be a module-level
    function (spawned processes pickle it by name). A child's exception is re-raised here with
    its traceback; a hang becomes a TimeoutError."""
    ctx = multiprocessing.get_context("forkserver")  # forked from a process that has imported
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # torch & co. once
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                r,
                world_size,
                port,
                args,
                results,
                backend,
                min(timeout_s, DEFAULT_TIMEOUT_S),
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            rank, ok, value = _next_result(results, procs, out, deadline, timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:  # after a failure, the others are stopped quickly
            p.join(timeout=5 if len(out) == world_size else 1)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def _next_result(results, procs: list, out: dict, deadline: float, timeout_s: float) -> tuple:
    """The next (rank, ok, value) a child sent; a RuntimeError as soon as a child has ended
    without sending one (killed, crashed: its peers would wait for it until the deadline), a
    TimeoutError at the deadline."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(procs)}-process run did not finish in {timeout_s:.0f}s")
        for rank, p in enumerate(procs):
            if rank not in out and p.exitcode is not None:
                try:  # (its result may still be in the pipe)
                    return results.get(timeout=2.0)
                except queue.Empty:
                    raise RuntimeError(
                        f"rank {rank} ended (exit code {p.exitcode}) without a result"
                    ) from None


# --- notebooks: train.py without a fresh interpreter ------------------------------------------


def start_forked(main, argv: list[str], output: str, env: dict[str, str], cwd: str):
    """Start the command `main(argv)` (a module-level function that returns an exit code, such
    as `hplab.train.main`) in `env` and `cwd`, its stdout and stderr appended to the file
    `output`, in a process group of its own; returns the process (`.pid`, `.exitcode`: the
    command's exit code once it ended). It is forked from the preloaded server run_distributed
    uses: a fresh interpreter would import torch and hplab first (~5 s of CPU, most of what a
    notebook's short run costs)."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(FORKSERVER_PRELOAD)
    process = server.Process(target=_command, args=(main, list(argv), output, dict(env), cwd))
    process.start()
    return process


def _command(main, argv: list[str], output: str, env: dict[str, str], cwd: str) -> None:
    os.setsid()  # (the ranks it forks die with it: init_distributed asks Linux for that)
    out = os.open(output, os.O_WRONLY | os.O_APPEND)
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        os.dup2(out, fd)
        stream.reconfigure(line_buffering=True)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # tqdm's default lock is a multiprocessing semaphore, which the resource tracker would
    # report as leaked when the ranks end without finalizers; a thread lock does the job
    tqdm.set_lock(threading.RLock())
    sys.exit(main(argv))


def torchrun_command(nproc: int, script: str, *script_args: str) -> list[str]:
    """The command that launches `script` on `nproc` local processes, without relying on a
    `torchrun` executable on PATH (notebooks and tests use the current interpreter)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *script_args,
    ]
