"""Jobs from a notebook: start a real multi-process run, watch it, keep what it printed.

`launch(nproc, script, args)` runs `script` on `nproc` local processes behind a one-line
progress bar drawn from rank 0's tqdm bar; a failure raises LaunchError with the job's `hplab:
error:` line, a run past its time is stopped. train.py, collectives_bench.py and
bucket_sweep.py are their own launchers (`--nproc N` forks N ranks, as torchrun would start
them); in a notebook their `main` is forked from a process that has imported torch and hplab
once (`hplab.runtime.launch.start_forked`), so a short run does not pay ~5 s of imports. Any other
script runs under torchrun.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]
_TQDM_COUNT = re.compile(r"(\d+)/(\d+) \[")  # rank 0's tqdm bar: "12/20 [00:03<..., loss=4.1]"
_TQDM_LOSS = re.compile(r"loss=([0-9.]+)")
_OWN_LAUNCHERS = {
    "train.py": "hplab.train",
    "collectives_bench.py": "hplab.course.collectives_bench",
    "bucket_sweep.py": "hplab.course.bucket_sweep",
}


class LaunchError(RuntimeError):
    """A launched job failed; the message holds its error line or the tail of its output."""


# --- launching ----------------------------------------------------------------------------
def _progress(label: str, show: bool):
    """A one-line progress bar, `draw(text, final=False)`: in a notebook one output updated in
    place (so the saved notebook shows the final state), in a terminal a line redrawn after \\r."""
    handle = None
    last_draw = 0.0
    with contextlib.suppress(ImportError):
        from IPython import get_ipython
        from IPython.display import Pretty, display

        if show and hasattr(get_ipython(), "kernel"):
            handle = display(Pretty(f"{label}: starting..."), display_id=True)

    def draw(text: str, final: bool = False) -> None:
        nonlocal last_draw
        if not show or (not final and time.monotonic() - last_draw < 0.25):
            return
        last_draw = time.monotonic()
        if handle is not None:
            handle.update(Pretty(f"{label}: {text}"))
        else:
            print(f"\r{label}: {text}", end="\n" if final else "", file=sys.stderr, flush=True)

    return draw


def _environment(extra: dict | None = None) -> dict:
    """The launched processes' environment: unbuffered output, one thread each, hplab
    importable, and `extra` (e.g. HPLAB_FAULT)."""
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO_DIR), os.environ.get("PYTHONPATH", "")]),
        **(extra or {}),
    )


def _start(nproc: int, script: str | Path, args: list[str], output: Path, env: dict | None):
    """Start the job, its output appended to the file `output`, in a process group of its own;
    returns (its pid, its exit code or None while it runs). train.py and the course's two
    benchmarks are their own launchers (`--nproc`): from a notebook their `main` is forked from a
    preloaded process (`hplab.runtime.launch.start_forked`; from a script, which multiprocessing
    would run again in the child, a fresh interpreter). Any other script runs under torchrun."""
    from hplab.runtime import launch  # imports torch: only when a job is launched

    if (module := _OWN_LAUNCHERS.get(Path(script).name)) is None:
        command = launch.torchrun_command(nproc, str(script), *args)
    elif getattr(sys.modules["__main__"], "__file__", None) is None:  # a notebook, a REPL
        main = importlib.import_module(module).main
        argv = ["--nproc", str(nproc), *args]
        job = launch.start_forked(main, argv, str(output), _environment(env), REPO_DIR)
        return job.pid, lambda: job.exitcode
    else:
        command = [sys.executable, str(script), "--nproc", str(nproc), *args]
    with open(output, "ab") as out:
        job = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_environment(env),
            cwd=REPO_DIR,
            start_new_session=True,
        )
    return job.pid, job.poll


def _draw_tqdm(draw, output: bytearray, start: float) -> None:
    """Redraw the progress bar from rank 0's latest tqdm line: a bar of 24 characters, the
    loss, the seconds so far."""
    tail = output[-400:].decode(errors="replace")
    if counts := _TQDM_COUNT.findall(tail):
        done, total = map(int, counts[-1])
        loss = _TQDM_LOSS.findall(tail)
        bar = "█" * (24 * done // max(total, 1))
        draw(
            f"{bar:·<24} {done}/{total}"
            + (f"  loss {loss[-1]}" if loss else "")
            + f"  {time.monotonic() - start:.1f} s"
        )


def _watch(job, output: Path, label: str, draw, start: float, timeout_s: float) -> tuple:
    """Read the job's output to its end, drawing progress; past `timeout_s` (or on an
    interrupt) kill its whole process group. Returns (its output, its exit code)."""
    pid, exit_code = job
    text = bytearray()
    with open(output, "rb") as new_output:
        try:
            while True:
                code = exit_code()  # (before reading: then all it wrote is read below)
                text += new_output.read()
                _draw_tqdm(draw, text, start)
                if code is not None:
                    return text, code
                if time.monotonic() - start > timeout_s:
                    raise LaunchError(
                        f"{label} did not finish in {timeout_s:.0f} s and was stopped"
                    )
                time.sleep(0.2)
        except BaseException:  # a timeout or an interrupt: kill the launcher's process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            while exit_code() is None:  # (reaped: no zombie left in the kernel)
                time.sleep(0.05)
            raise


def _failure(text: str, label: str, returncode: int) -> LaunchError:
    """The job's `hplab: error:` line, or its exit code and the tail of its output."""
    errors = [line for line in text.splitlines() if line.startswith("hplab: error:")]
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return LaunchError(
        errors[0]
        if errors
        else f"{label} exited with code {returncode}; its last output:\n" + "\n".join(lines[-30:])
    )


def launch(
    nproc: int,
    script: str | Path,
    args: list[str],
    label: str | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
    env: dict | None = None,
) -> tuple[str, float]:
    """Run `script` on `nproc` local processes (`env`: variables to add); return (captured
    output, seconds). Progress comes from rank 0's tqdm bar. A non-zero exit raises LaunchError
    with the job's `hplab: error:` line (or the tail of its output); past `timeout_s` the whole
    job is killed."""
    label = label or f"{Path(script).name} on {nproc} processes"
    draw = _progress(label, progress)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hplab-") as folder:
        output = Path(folder) / "output.txt"
        output.touch()
        job = _start(nproc, script, args, output, env)
        text, returncode = _watch(job, output, label, draw, start, timeout_s)
    seconds, text = time.monotonic() - start, text.decode(errors="replace")
    if returncode != 0:
        draw(f"failed after {seconds:.1f} s", final=True)
        raise _failure(text, label, returncode)
    draw("█" * 24 + f" done in {seconds:.1f} s", final=True)
    return text, seconds


def as_flags(options: dict) -> list[str]:
    """{"bucket_mb": 1, "recompute": True} → ["--bucket-mb", "1", "--recompute"]."""
    return [
        part
        for key, value in options.items()
        if value is not None and value is not False
        for part in ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    ]


def launch_json(
    nproc: int,
    script: Path,
    args: list[str],
    out_flag: str,
    label: str,
    progress: bool,
    timeout_s: float,
    env: dict | None = None,
    out: str | Path | None = None,
) -> tuple[dict, float, str]:
    """Launch `script` with `out_flag PATH` added (PATH: `out`, else a temporary file); return
    (the JSON it wrote, seconds, output). A job that ends well without writing it (a run its
    checkpoint already holds whole, say) is a LaunchError with the job's own line."""
    with tempfile.TemporaryDirectory(prefix="hplab-") as tmp:
        path = Path(out) if out is not None else Path(tmp) / "out.json"
        output, seconds = launch(
            nproc,
            script,
            args + [out_flag, str(path)],
            label,
            progress,
            timeout_s,
            env,
        )
        if not path.is_file():
            said = [line for line in output.splitlines() if line.startswith("hplab:")]
            raise LaunchError(
                f"{label} wrote no results"
                + (f": {said[-1].removeprefix('hplab: ')}" if said else "")
            )
        return json.loads(path.read_text()), seconds, output
