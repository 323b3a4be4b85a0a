"""Notebook helpers: launch a real multi-process job, watch it, read what it measured.

A lab cell such as

    run = lab.train(nproc=4, dp=4, steps=20)

starts `torchrun hplab/train.py --dp 4 --steps 20 --metrics ...` as four real operating-system
processes (gloo on CPU, NCCL on GPUs), shows a progress bar while they train, and returns a
`Run`: the metrics file as an object, with the numbers the labs plot (`run.losses`,
`run.memory_bytes()`, `run.comm_bytes("all_reduce")`) and plotting helpers (`run.plot_loss()`).

Why a subprocess and not threads or `multiprocessing` inside the kernel? Because that is how
training really runs: `torchrun` sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and the rendezvous
address, and every process joins the group from scratch. We launch the current interpreter
(`sys.executable -m torch.distributed.run`), so no `torchrun` needs to be on PATH, and we
capture everything the processes print: a notebook kernel (and nbval under pytest) would not
see output written straight to the terminal. If the job fails, the error carries its output.

`lab.collectives(nproc=4)` runs `hplab/collectives_bench.py` the same way and returns the
measured time of each collective against message size, with the α-β model fitted to it.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# in one home, hplab.formulas; lab 00 and tests call them as lab.<name>
from hplab import viz  # plots; matplotlib itself loads only when one is drawn
from hplab.formulas import alpha_beta_terms, training_flops_per_token

HPLAB_DIR = Path(__file__).resolve().parent
REPO_DIR = HPLAB_DIR.parent
KINDS = ("params", "grads", "optim", "master", "activation")


class LaunchError(RuntimeError):
    """A launched job failed; the message holds its error line or the tail of its output."""


# --- launching ----------------------------------------------------------------------------

class _Progress:
    """A one-line text progress bar. In a notebook it is one output updated in place (so the
    saved notebook shows the final state); in a terminal it is redrawn with a carriage return."""

    def __init__(self, label: str, show: bool = True):
        self.label, self.show, self.last_draw = label, show, 0.0
        self.handle = None
        if show and _in_notebook():
            from IPython.display import Pretty, display

            self.handle = display(Pretty(f"{label}: starting..."), display_id=True)

    def draw(self, text: str, final: bool = False) -> None:
        if not self.show or (not final and time.monotonic() - self.last_draw < 0.25):
            return
        self.last_draw = time.monotonic()
        line = f"{self.label}: {text}"
        if self.handle is not None:
            from IPython.display import Pretty

            self.handle.update(Pretty(line))
        else:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "█" * filled + "·" * (width - filled) + f" {done}/{total}"


_TQDM_COUNT = re.compile(r"(\d+)/(\d+) \[")
_TQDM_POSTFIX = re.compile(r"loss=([0-9.]+)")


def launch(nproc: int, script: str | Path, args: list[str], label: str | None = None,
           progress: bool = True, timeout_s: float = 600.0) -> tuple[str, float]:
    """Run `script` on `nproc` local processes; return (captured output, seconds).

    Progress is read from the tqdm bar that rank 0 prints (`12/20 [`). On a non-zero exit the
    job's `hplab: error:` line (or the tail of its output) is raised as a LaunchError; past
    `timeout_s` the whole process group is killed and a LaunchError says so.
    """
    from hplab.dist import torchrun_command

    command = torchrun_command(nproc, str(script), *args)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO_DIR), os.environ.get("PYTHONPATH", "")]))
    label = label or f"{Path(script).name} on {nproc} processes"
    bar = _Progress(label, progress)
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=REPO_DIR, start_new_session=True)
    chunks: list[bytes] = []
    tail = ""
    try:
        while True:
            if time.monotonic() - start > timeout_s:
                raise LaunchError(f"{label} did not finish in {timeout_s:.0f} s and was stopped")
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                data = os.read(proc.stdout.fileno(), 65536)
                if not data:
                    break
                chunks.append(data)
                tail = (tail + data.decode(errors="replace"))[-400:]
                counts = _TQDM_COUNT.findall(tail)
                if counts:
                    done, total = map(int, counts[-1])
                    loss = _TQDM_POSTFIX.findall(tail)
                    bar.draw(_bar(done, total) + (f"  loss {loss[-1]}" if loss else "") +
                             f"  {time.monotonic() - start:.1f} s")
        proc.wait()
    except BaseException:
        _kill(proc)
        raise
    seconds = time.monotonic() - start
    output = b"".join(chunks).decode(errors="replace")
    if proc.returncode != 0:
        bar.draw(f"failed after {seconds:.1f} s", final=True)
        errors = [line for line in output.splitlines() if line.startswith("hplab: error:")]
        if errors:
            raise LaunchError(errors[0])
        lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip()]
        raise LaunchError(f"{label} exited with code {proc.returncode}; its last output:\n"
                          + "\n".join(lines[-30:]))
    bar.draw("█" * 24 + f" done in {seconds:.1f} s", final=True)
    return output, seconds


def _kill(proc: subprocess.Popen) -> None:
    """Stop the job we started: its whole process group (torchrun and its workers)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _flags(options: dict) -> list[str]:
    """{"bucket_mb": 1, "recompute": True} → ["--bucket-mb", "1", "--recompute"]."""
    out = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


# --- training runs ------------------------------------------------------------------------

@dataclass
class Run:
    """One finished training run: its metrics file (see DESIGN.md) and convenient views."""

    metrics: dict
    seconds: float = 0.0
    output: str = field(default="", repr=False)

    @property
    def world_size(self) -> int:
        return self.metrics["world_size"]

    @property
    def config(self) -> dict:
        return self.metrics["config"]

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.metrics["steps"]]

    @property
    def step_times(self) -> list[float]:
        return [s["time_s"] for s in self.metrics["steps"]]

    @property
    def tokens_per_s(self) -> float:
        """Tokens of the global batch per second of step time, first step excluded."""
        return self.metrics["tokens_per_s"]

    @property
    def num_params(self) -> int:
        return self.metrics["model"]["num_params"]

    def memory_bytes(self, rank: int = 0) -> dict[str, int]:
        """Bytes this rank held, by kind: params, grads, optim, master, activation."""
        m = self.metrics["memory"][rank]
        return {kind: m[f"{kind}_bytes"] for kind in KINDS}

    def comm_bytes(self, op: str, rank: int = 0, key: str = "bytes") -> float:
        """Payload bytes (or `key="bus_bytes"`, `"calls"`, `"time_s"`) of `op` on `rank`."""
        return self.metrics["comm"][rank].get(op, {}).get(key, 0)

    def summary(self) -> str:
        from hplab.train import summary_table

        return summary_table(self.metrics)

    def plot_loss(self, ax=None, label: str | None = None):
        return viz.plot_loss_curves({label or self.label(): self}, ax=ax)

    def plot_memory(self, predicted: dict[str, float] | None = None, ax=None):
        return viz.plot_memory_breakdown({f"measured ({self.label()})": self.memory_bytes()},
                                         predicted=predicted, ax=ax)

    def label(self) -> str:
        c = self.config
        parts = [f"dp={c['dp']}"] + [f"{k}={c[k]}" for k in ("tp", "pp", "zero") if c.get(k)
                                     and c[k] != (1 if k != "zero" else 0)]
        return " ".join(parts)


def train(nproc: int = 1, progress: bool = True, timeout_s: float = 600.0, **flags) -> Run:
    """Run `torchrun --nproc_per_node nproc hplab/train.py` with `flags` (python names:
    `bucket_mb=1` is `--bucket-mb 1`, `recompute=True` is `--recompute`) and return its Run."""
    with tempfile.TemporaryDirectory(prefix="hplab-") as tmp:
        path = Path(tmp) / "metrics.json"
        args = _flags({k: v for k, v in flags.items() if k != "metrics"}) + ["--metrics", str(path)]
        label = f"train.py on {nproc} process{'es' if nproc > 1 else ''} " + " ".join(
            _flags({k: v for k, v in flags.items() if k in ("dp", "tp", "pp", "zero",
                                                             "bucket_mb")}))
        output, seconds = launch(nproc, HPLAB_DIR / "train.py", args, label.strip(), progress,
                                 timeout_s)
        metrics = json.loads(path.read_text())
    return Run(metrics, seconds, output)


def load_run(path: str | Path) -> Run:
    """A Run from a metrics file written earlier with `--metrics PATH`."""
    return Run(json.loads(Path(path).read_text()))


# --- collectives: measured time against message size, and the α-β model ---------------------

@dataclass
class AlphaBetaFit:
    """The α-β model fitted to one collective's measurements."""

    op: str
    n: int
    alpha_s: float  # latency of one step of the algorithm
    beta_bytes_per_s: float  # link bandwidth
    max_relative_error: float  # of the model against the measured points

    def predict(self, nbytes) -> np.ndarray:
        steps, factor = alpha_beta_terms(self.op, self.n)
        return steps * self.alpha_s + factor * np.asarray(nbytes, dtype=float) / self.beta_bytes_per_s

    def formula(self) -> str:
        steps, factor = alpha_beta_terms(self.op, self.n)
        return (f"T = {steps}·α + {factor:.2f}·S/β,  α = {self.alpha_s * 1e6:.0f} µs, "
                f"β = {self.beta_bytes_per_s / 1e9:.2f} GB/s")


def fit_alpha_beta(op: str, n: int, sizes, times) -> AlphaBetaFit:
    """Least squares on *relative* error (the sizes span decades): find a, b ≥ 0 with
    T ≈ a + b·S, then α = a / steps and β = factor / b."""
    S, T = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    A = np.stack([np.ones_like(S), S], axis=1) / T[:, None]
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(T), rcond=None)
    a, b = max(a, 1e-9), max(b, 1e-15)
    steps, factor = alpha_beta_terms(op, n)
    fit = AlphaBetaFit(op, n, a / steps, factor / b, 0.0)
    fit.max_relative_error = float(np.max(np.abs(fit.predict(S) - T) / T))
    return fit


@dataclass
class Collectives:
    """Measured seconds per call of each collective, by message size (payload bytes)."""

    data: dict
    seconds: float = 0.0
    output: str = field(default="", repr=False)

    @property
    def world_size(self) -> int:
        return self.data["world_size"]

    @property
    def ops(self) -> list[str]:
        return list(self.data["results"])

    def sizes(self, op: str) -> list[int]:
        return [r["bytes"] for r in self.data["results"][op]]

    def times(self, op: str) -> list[float]:
        return [r["time_s"] for r in self.data["results"][op]]

    def ledger(self, op: str) -> dict:
        """What rank 0's CommLedger recorded for `op` over the whole benchmark."""
        return self.data["ledger"].get(op, {})

    def fit(self, op: str) -> AlphaBetaFit:
        return fit_alpha_beta(op, self.world_size, self.sizes(op), self.times(op))

    def bus_bandwidth(self, op: str) -> list[float]:
        """nccl-tests' bus bandwidth: factor · S / T, comparable across operations."""
        _, factor = alpha_beta_terms(op, self.world_size)
        return [factor * s / t for s, t in zip(self.sizes(op), self.times(op))]

    def plot(self, ops: list[str] | None = None, ax=None):
        return viz.plot_collective_times(self, ops=ops, ax=ax)


def collectives(nproc: int = 4, min_bytes: int = 2**10, max_bytes: int = 2**22,
                repeats: int = 5, ops: list[str] | None = None, progress: bool = True,
                timeout_s: float = 600.0) -> Collectives:
    """Time every collective on `nproc` processes for sizes from min_bytes to max_bytes
    (powers of two); returns the measurement with α-β fits (see `hplab/collectives_bench.py`)."""
    with tempfile.TemporaryDirectory(prefix="hplab-") as tmp:
        path = Path(tmp) / "collectives.json"
        args = ["--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
                "--repeats", str(repeats), "--out", str(path)]
        if ops:
            args += ["--ops", *ops]
        output, seconds = launch(nproc, HPLAB_DIR / "collectives_bench.py", args,
                                 f"collectives on {nproc} processes", progress, timeout_s)
        data = json.loads(path.read_text())
    return Collectives(data, seconds, output)


# --- a small measurement the labs need: this machine's matmul FLOP/s -------------------------

def measure_peak_flops(n: int = 512, repeats: int = 10, threads: int | None = 1) -> float:
    """FLOP/s of an n×n fp32 matmul on this process's device, the best of `repeats`.

    CPUs publish no single "peak FLOP/s" the way GPU data sheets do, so MFU on a laptop is
    measured against what a large matmul actually reaches: 2n³ FLOPs per product. `threads=1`
    matches the training processes (torchrun gives each one OMP thread).
    """
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * n**3 / best


def mfu(run: Run, peak_flops_per_process: float) -> float:
    """Model FLOPs utilisation: model FLOPs per second / (processes × peak FLOP/s)."""
    model = run.metrics["model"]
    per_token = training_flops_per_token(model["num_params"], model["n_layer"], model["n_embd"],
                                         model["n_positions"])
    return run.tokens_per_s * per_token / (run.world_size * peak_flops_per_process)
