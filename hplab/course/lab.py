"""Notebook helpers: launch a real multi-process job, watch it, read what it measured.

`run = lab.train(nproc=4, dp=4, steps=20)` runs `python hplab/train.py --nproc 4 --dp 4
--steps 20 --metrics ...` (train.py launches its ranks as torchrun would) as four real processes
(gloo on CPU, NCCL on GPUs) behind a progress bar and returns a `Run`, the metrics file with the
views the labs plot (`run.losses`, `run.memory_bytes()`, `run.comm_bytes("all_reduce")`).
`lab.collectives(nproc=4)` runs `hplab/course/collectives_bench.py --nproc 4` and fits α
and β.

Why processes, not threads in the kernel? That is how training really runs: the launcher sets
`RANK`, `WORLD_SIZE` and the rendezvous address and each process joins the group from scratch.
Their output is captured (`hplab.course.jobs`: a kernel would not see it); a failed or hung
job raises LaunchError.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hplab.course import viz  # plots; matplotlib itself loads only when one is drawn
from hplab.course.jobs import REPO_DIR, LaunchError, as_flags, launch, launch_json  # noqa: F401
from hplab.course.timeline import read_timeline

# in one home, hplab.plan.formulas; lab 00 and tests call them as lab.<name>
from hplab.plan.formulas import alpha_beta_terms, training_flops_per_token


# --- training runs ------------------------------------------------------------------------
@dataclass
class Run:
    """One finished training run: its metrics file (see DESIGN.md) and convenient views."""

    metrics: dict
    seconds: float = 0.0
    output: str = field(default="", repr=False)
    trace_dir: str | None = None  # with `train(trace=True)`: rank0.json, ... (see timeline.py)

    world_size = property(lambda self: self.metrics["world_size"])
    config = property(lambda self: self.metrics["config"])
    num_params = property(lambda self: self.metrics["model"]["num_params"])
    tokens_per_s = property(lambda self: self.metrics["tokens_per_s"])  # first step excluded
    losses = property(lambda self: [s["loss"] for s in self.metrics["steps"]])
    val_losses = property(
        lambda self: [
            (e["step"], e["loss"])  # `eval_every=N`: the loss after
            for e in self.metrics.get("eval", [])
        ]
    )  # `step` steps

    def memory_bytes(self, rank: int = 0) -> dict[str, int]:
        """Bytes this rank held, by kind: params, grads, optim, master, activation."""
        return {kind: self.metrics["memory"][rank][f"{kind}_bytes"] for kind in viz.KIND_LABELS}

    def offloaded_bytes(self, rank: int = 0) -> dict[str, int]:
        """Of `memory_bytes`, by kind, the bytes `--offload` kept in host memory."""
        return self.metrics["memory"][rank].get("offloaded_bytes", {})

    def comm_bytes(self, op: str, rank: int = 0, key: str = "bytes") -> float:
        """Payload bytes (or `key="bus_bytes"`, `"calls"`, `"time_s"`) of `op` on `rank`."""
        return self.metrics["comm"][rank].get(op, {}).get(key, 0)

    def summary(self) -> str:
        from hplab.observe.metrics import summary_table

        return summary_table(self.metrics)

    def timeline(self) -> list[list[dict]]:
        """Per rank, the traced spans (`course.timeline.read_timeline`); plot: viz.plot_timeline."""
        return read_timeline(self.trace_dir)

    def plot_loss(self, ax=None, label: str | None = None):
        return viz.plot_loss_curves({label or self.label(): self}, ax=ax)

    def label(self) -> str:
        c = self.config
        return " ".join(
            [f"dp={c['dp']}"]
            + [
                f"{k}={c[k]}"
                for k, default in (("tp", 1), ("pp", 1), ("zero", 0))
                if c.get(k) and c[k] != default
            ]
        )


def train(
    nproc: int = 1,
    progress: bool = True,
    timeout_s: float = 600.0,
    trace: bool | str = False,
    fault: str | None = None,
    **flags,
) -> Run:
    """Run `python hplab/train.py --nproc nproc` with `flags` (python names:
    `bucket_mb=1` is `--bucket-mb 1`, `recompute=True` is `--recompute`) and return its Run.
    `trace=True` (or a folder) adds `--trace` (a new temporary folder): see `Run.timeline()`.
    `fault="9:1:kill"` injects failures (HPLAB_FAULT, `hplab.runtime.faults`); `metrics=PATH`
    keeps the metrics file there too."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a whole number of processes, at least 1; got {nproc!r}")
    shown = as_flags(
        {
            k: v
            for k, v in flags.items()
            if k not in ("steps", "batch_size", "save", "resume", "metrics", "seed")
        }
    )
    label = " ".join([f"train.py on {nproc} process{'es' if nproc > 1 else ''}", *shown])
    trace = tempfile.mkdtemp(prefix="hplab-trace-") if trace is True else trace or None
    args = as_flags({k: v for k, v in flags.items() if k != "metrics"} | {"trace": trace})
    return Run(
        *launch_json(
            nproc,
            REPO_DIR / "hplab" / "train.py",
            args,
            "--metrics",
            label,
            progress,
            timeout_s,
            {"HPLAB_FAULT": fault or ""},
            flags.get("metrics"),
        ),
        trace_dir=trace,
    )


# --- collectives: measured time against message size, and the α-β model ---------------------
@dataclass
class AlphaBetaFit:
    """The α-β model fitted to one collective's measurements."""

    op: str
    n: int
    alpha_s: float  # latency of one step of the algorithm (of one call under a link)
    beta_bytes_per_s: float  # link bandwidth
    max_relative_error: float  # of the model against the measured points
    steps: int | None = None  # α's per call (None: the ring's, `alpha_beta_terms`)

    def predict(self, nbytes) -> np.ndarray:
        steps, factor = alpha_beta_terms(self.op, self.n)
        steps = self.steps or steps
        return steps * self.alpha_s + factor * np.asarray(nbytes, float) / self.beta_bytes_per_s

    def formula(self) -> str:
        steps, factor = alpha_beta_terms(self.op, self.n)
        steps = self.steps or steps
        return (
            f"T = {steps}·α + {factor:.2f}·S/β,  α = {self.alpha_s * 1e6:.0f} µs, "
            f"β = {self.beta_bytes_per_s / 1e9:.2f} GB/s"
        )


def fit_alpha_beta(op: str, n: int, sizes, times) -> AlphaBetaFit:
    """Least squares on *relative* error (the sizes span decades): find a, b ≥ 0 with
    T ≈ a + b·S, then α = a / steps and β = factor / b (the ring's steps and factor)."""
    S = np.asarray(sizes, dtype=float)
    T = np.asarray(times, dtype=float)
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / T, S / T], axis=1), np.ones_like(T), rcond=None)
    (a, b), (steps, factor) = (max(a, 1e-9), max(b, 1e-15)), alpha_beta_terms(op, n)
    error = float(np.max(np.abs(a + b * S - T) / T))
    return AlphaBetaFit(op, n, a / steps, factor / b, error, steps)


@dataclass
class Collectives:
    """Measured seconds per call of each collective, by message size (payload bytes)."""

    data: dict
    seconds: float = 0.0
    output: str = field(default="", repr=False)

    world_size = property(lambda self: self.data["world_size"])
    ops = property(lambda self: list(self.data["results"]))
    link = property(lambda self: self.data.get("link"))  # the emulated link's text, or None

    def sizes(self, op: str) -> list[int]:
        return [r["bytes"] for r in self.data["results"][op]]

    def times(self, op: str) -> list[float]:
        return [r["time_s"] for r in self.data["results"][op]]

    def ledger(self, op: str) -> dict:
        """What rank 0's CommLedger recorded for `op` over the whole benchmark."""
        return self.data["ledger"].get(op, {})

    def fit(self, op: str) -> AlphaBetaFit:
        """α and β fitted to `op`'s times: α per ring step (on loopback, or the emulated wire)."""
        sizes = self.sizes(op)
        times = self.times(op)
        return fit_alpha_beta(
            op,
            self.world_size,
            sizes,
            times,
        )

    def bus_bandwidth(self, op: str) -> list[float]:
        """nccl-tests' bus bandwidth: factor · S / T, comparable across operations."""
        _, factor = alpha_beta_terms(op, self.world_size)
        return [factor * s / t for s, t in zip(self.sizes(op), self.times(op))]

    def plot(self, ops: list[str] | None = None, ax=None):
        return viz.plot_collective_times(self, ops=ops, ax=ax)


def collectives(
    nproc: int = 4,
    min_bytes: int = 2**10,
    max_bytes: int = 2**22,
    repeats: int = 5,
    ops: list[str] | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
    link: str | None = None,
) -> Collectives:
    """Time every collective on `nproc` processes for sizes from min_bytes to max_bytes
    (powers of two), under an emulated `link` ("20MB/s,1ms") if given; returns the
    measurement with α-β fits (see `collectives_bench.py`, here)."""
    args = as_flags(dict(min_bytes=min_bytes, max_bytes=max_bytes, repeats=repeats, link=link))
    args += ["--ops", *ops] if ops else []
    return Collectives(
        *launch_json(
            nproc,
            Path(__file__).resolve().parent / "collectives_bench.py",
            args,
            "--out",
            f"collectives on {nproc} processes" + (f" --link {link}" if link else ""),
            progress,
            timeout_s,
        )
    )


# --- a small measurement the labs need: this machine's matmul FLOP/s -------------------------
def measure_peak_flops(
    n: int = 512, repeats: int = 10, threads: int | None = 1, device="cpu", dtype=None, clock=None
) -> float:
    """FLOP/s of an n×n matmul (2n³ FLOPs) on `device` in `dtype` (fp32 by default), the best
    of `repeats`, timed by that device's clock (`hplab.runtime.clock`: CUDA events on a GPU, where a
    call returns before its work is done). CPUs publish no "peak FLOP/s" the way GPU data
    sheets do, so a laptop's MFU is measured against what a large matmul reaches; `threads=1`
    matches each training process."""
    import torch

    from hplab.runtime.clock import clock_for

    clock, previous = clock or clock_for(device), torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        times = []
        for _ in range(repeats + 1):  # (1 more: a warm-up)
            start = clock.mark()
            a @ b
            times.append(clock.seconds(start, clock.mark()))
    finally:
        torch.set_num_threads(previous)
    return 2 * n**3 / min(times[1:])


def peak_of(run: Run) -> float:
    """The matmul peak of the device `run` trained on, in its precision: 512² fp32 on one CPU
    thread, 8192² on a GPU (its own GPU: a CPU's peak would not be the run's)."""
    import torch

    device = run.metrics.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LaunchError("this run trained on a GPU: measure its peak on a machine with one")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.config.get("precision"))
    if device == "cuda":
        return measure_peak_flops(8192, device=device, dtype=dtype, threads=None)
    return measure_peak_flops(512, device=device, dtype=dtype)


def mfu(run: Run, peak_flops_per_process: float | None = None) -> float:
    """Model FLOPs utilisation: model FLOPs per second / (processes × peak FLOP/s); the peak
    measured on the run's own device (`peak_of`) unless given."""
    peak = peak_flops_per_process or peak_of(run)
    m = run.metrics["model"]
    flops = training_flops_per_token(m["num_params"], m["n_layer"], m["n_embd"], m["n_positions"])
    return run.tokens_per_s * flops / (run.world_size * peak)
