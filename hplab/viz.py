"""The plots the labs show: what a run measured, next to what theory predicts.

Every function draws one self-contained figure: a title that says what was run, axes with
units, and a legend that tells measured values (solid markers) from formulas (dashed lines,
hatched bars). Pass `ax=` to draw into your own matplotlib axes; each function returns the
axes. matplotlib is imported inside the functions, so `import hplab.viz` costs nothing.
"""

from __future__ import annotations

MiB = 2**20
KIND_LABELS = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
               "master": "master weights", "activation": "activations"}


def _axes(ax, figsize=(6.4, 4.0)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _losses(run_or_metrics) -> list[float]:
    metrics = getattr(run_or_metrics, "metrics", run_or_metrics)
    return [s["loss"] for s in metrics["steps"]]


# --- training runs ------------------------------------------------------------------------

def plot_loss_curves(runs: dict, ax=None, title: str = "Training loss"):
    """One loss curve per run ({label: Run or metrics dict}); equal layouts overlap exactly,
    so later curves are drawn thinner and dashed to keep the earlier ones visible."""
    ax = _axes(ax)
    styles = [dict(lw=3.5, alpha=0.5), dict(lw=1.8, ls="--"), dict(lw=1.2, ls=":"),
              dict(lw=1.0, ls="-.")]
    for i, (label, run) in enumerate(runs.items()):
        losses = _losses(run)
        ax.plot(range(len(losses)), losses, label=label, **styles[i % len(styles)])
    ax.set(xlabel="step", ylabel="loss (cross-entropy, nats)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_memory_breakdown(measured: dict[str, dict[str, float]],
                          predicted: dict[str, float] | None = None, ax=None,
                          title: str = "Memory per rank, by kind",
                          predicted_label: str = "formula"):
    """Grouped bars in MiB: one group per kind (params, grads, optim, master, activation), one
    bar per measured entry ({label: {kind: bytes}}), and a hatched bar for the formula where
    it gives that kind."""
    import numpy as np

    ax = _axes(ax, (7.2, 4.0))
    kinds = [k for k in KIND_LABELS if any(m.get(k, 0) for m in measured.values())
             or (predicted and predicted.get(k))]
    series = list(measured.items()) + ([(predicted_label, predicted)] if predicted else [])
    width = 0.8 / len(series)
    x = np.arange(len(kinds))
    for i, (label, values) in enumerate(series):
        is_formula = predicted is not None and i == len(series) - 1
        shown = [j for j, k in enumerate(kinds) if not is_formula or k in values]
        heights = [values.get(kinds[j], 0) / MiB for j in shown]
        bars = ax.bar(x[shown] + (i - (len(series) - 1) / 2) * width, heights, width,
                      label=label, hatch="//" if is_formula else None, fill=not is_formula,
                      edgecolor="black" if is_formula else None)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(x, [KIND_LABELS[k] for k in kinds])
    ax.set(ylabel="MiB", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return ax


def plot_throughput(x, series: dict[str, list[float]], xlabel: str, ax=None,
                    title: str = "Throughput", ylabel: str = "tokens / s", logx: bool = False,
                    ideal: dict[str, list[float]] | None = None):
    """Measured throughput (markers) against a parameter, with optional ideal lines (dashed)."""
    ax = _axes(ax)
    for label, ys in series.items():
        ax.plot(x, ys, "o-", label=f"{label} (measured)")
    for label, ys in (ideal or {}).items():
        ax.plot(x, ys, "--", color="gray", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if all(isinstance(v, (int, float)) for v in x):
        ax.set_xticks(list(x))  # the values run, not a continuous axis
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


# --- collectives ----------------------------------------------------------------------------

def plot_collective_times(result, ops: list[str] | None = None, ax=None):
    """Seconds per call against message size, log-log: measured points and the fitted α-β
    model of each operation (`result` is a `hplab.lab.Collectives`)."""
    import numpy as np

    ax = _axes(ax, (7.2, 4.6))
    for i, op in enumerate(ops or result.ops):
        color = f"C{i}"
        sizes = np.asarray(result.sizes(op), dtype=float)
        ax.loglog(sizes, np.asarray(result.times(op)) * 1e3, "o", color=color, ms=4,
                  label=f"{op} (measured)")
        fit = result.fit(op)
        grid = np.geomspace(sizes.min(), sizes.max(), 100)
        ax.loglog(grid, fit.predict(grid) * 1e3, "--", color=color,
                  label=f"α-β: α={fit.alpha_s * 1e6:.0f} µs, β={fit.beta_bytes_per_s / 1e9:.2f} GB/s")
    ax.set(xlabel="message size S (payload bytes)", ylabel="time per call (ms)",
           title=f"Collectives on {result.world_size} processes ({result.data['backend']})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    return ax


# --- formulas worth exploring: ZeRO memory, pipeline bubble -----------------------------------

def plot_zero_memory(num_params: float, world_sizes=(1, 2, 4, 8, 16, 32, 64),
                     precision: str = "bf16", highlight: tuple[int, int] | None = None, ax=None,
                     device_bytes: float | None = None):
    """Model-state memory per device (formula: `hplab.plan.model_state_bytes`, [ZeRO] Sec. 5)
    against data-parallel size, one line per ZeRO stage. `highlight=(stage, world_size)` marks
    one point; `device_bytes` draws a device's capacity."""
    from hplab.plan import model_state_bytes

    ax = _axes(ax)
    GiB = 2**30
    names = {0: "DDP (stage 0)", 1: "ZeRO-1: optimizer state", 2: "ZeRO-2: + gradients",
             3: "ZeRO-3: + parameters"}
    for stage in range(4):
        ys = [model_state_bytes(num_params, n, stage, precision)["total_bytes"] / GiB
              for n in world_sizes]
        ax.plot(world_sizes, ys, "o--", ms=3, label=names[stage])
    if highlight:
        stage, n = highlight
        y = model_state_bytes(num_params, n, stage, precision)["total_bytes"] / GiB
        ax.plot([n], [y], "k*", ms=14, label=f"stage {stage}, N_d={n}: {y:.1f} GiB")
    if device_bytes:
        ax.axhline(device_bytes / GiB, color="red", lw=1, label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(world_sizes), [str(n) for n in world_sizes])
    ax.set_yscale("log")
    ax.set(xlabel="data-parallel size N_d", ylabel="model states per device (GiB)",
           title=f"ZeRO memory, formula: Ψ = {num_params / 1e9:.2g} B params, {precision} + Adam")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return ax


def plot_bubble_fraction(pp: int, max_microbatches: int = 32, schedule: str = "1f1b",
                         highlight: int | None = None, ax=None):
    """Pipeline bubble (p−1)/(m+p−1) of the step time against microbatches m (formula,
    [PTD-P] Sec. 2.2: idle (p−1) slots out of m+p−1)."""
    ax = _axes(ax)
    ms = list(range(1, max_microbatches + 1))
    for p in sorted({2, 4, 8, pp}):
        ys = [(p - 1) / (m + p - 1) for m in ms]
        ax.plot(ms, ys, lw=2.5 if p == pp else 1, label=f"pp = {p}")
    if highlight:
        y = (pp - 1) / (highlight + pp - 1)
        ax.plot([highlight], [y], "k*", ms=14, label=f"pp={pp}, m={highlight}: {y:.0%} idle")
    ax.set(xlabel="microbatches per step m", ylabel="idle fraction of the step",
           title=f"Pipeline bubble ({schedule}), formula (p−1)/(m+p−1)", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    return ax
