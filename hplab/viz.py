"""The plots the labs show: what a run measured, next to what theory predicts.

Every function draws one self-contained figure: a title that says what was run, axes with
units, and a legend that tells measured values (solid markers) from formulas (dashed lines,
hatched bars). Pass `ax=` to draw into your own matplotlib axes; each function returns the
axes. matplotlib is imported inside the functions, so `import hplab.viz` costs nothing.
"""

from __future__ import annotations

from hplab.formulas import bubble_formula, bubble_fraction, model_state_bytes

MiB = 2**20
KIND_LABELS = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
               "master": "master weights", "activation": "activations"}


def _axes(ax, figsize=(6.4, 4.0)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _metrics(run_or_metrics) -> dict:
    """A metrics dict, from itself or from a `lab.Run`."""
    return getattr(run_or_metrics, "metrics", run_or_metrics)


# --- training runs ------------------------------------------------------------------------

def plot_loss_curves(runs: dict, ax=None, title: str = "Training loss"):
    """One loss curve per run ({label: Run or metrics dict}); equal layouts overlap exactly,
    so later curves are drawn thinner and dashed to keep the earlier ones visible."""
    ax = _axes(ax)
    styles = [dict(lw=3.5, alpha=0.5), dict(lw=1.8, ls="--"), dict(lw=1.2, ls=":"),
              dict(lw=1.0, ls="-.")]
    for i, (label, run) in enumerate(runs.items()):
        losses = [s["loss"] for s in _metrics(run)["steps"]]
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
    [PTD-P] Sec. 2.2: idle (p−1) slots out of m+p−1; `formulas.bubble_fraction`)."""
    ax = _axes(ax)
    ms = list(range(1, max_microbatches + 1))
    for p in sorted({2, 4, 8, pp}):
        ys = [bubble_fraction("1f1b", p, m) for m in ms]
        ax.plot(ms, ys, lw=2.5 if p == pp else 1, label=f"pp = {p}")
    if highlight:
        y = bubble_fraction("1f1b", pp, highlight)
        ax.plot([highlight], [y], "k*", ms=14, label=f"pp={pp}, m={highlight}: {y:.0%} idle")
    ax.set(xlabel="microbatches per step m", ylabel="idle fraction of the step",
           title=f"Pipeline bubble ({schedule}), formula (p−1)/(m+p−1)", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


# --- pipeline ---------------------------------------------------------------------------------
# Gantt charts of a pipeline step (hplab/pp.py): what the ranks really did (the metrics file's
# "pipeline" trace) next to the ideal timeline of the same schedule (pp.simulate), and the
# measured bubble per rank next to the formula.

PIPELINE_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2", "recv": "#BBBBBB"}


def _pipeline(run_or_metrics) -> dict:
    if not _metrics(run_or_metrics).get("pipeline"):
        raise ValueError("this run has no pipeline trace: run train.py with --pp > 1")
    return _metrics(run_or_metrics)["pipeline"]


def _draw_gantt(ax, rows: list[list[tuple]], unit: str, show_waits: bool = True):
    """rows[r] = [(kind, microbatch, local chunk, start, end), ...]; one lane per rank. Bars
    are labelled with their microbatch; a rank's later model chunks (interleaved) are paler."""
    for r, events in enumerate(rows):
        for kind, mb, chunk, start, end in events:
            if kind == "send":
                ax.plot([start, start], [r - 0.42, r + 0.42], color="k", lw=0.6)
                continue
            if kind == "recv" and not show_waits:
                continue
            ax.barh(r, end - start, left=start, height=0.8 if kind != "recv" else 0.3,
                    color=PIPELINE_COLORS[kind], edgecolor="white", lw=0.5,
                    alpha=1.0 if kind == "recv" else 1.0 / (1 + 0.8 * chunk))  # later chunks paler
            if kind != "recv":
                ax.text((start + end) / 2, r, str(mb), ha="center", va="center", fontsize=6,
                        color="white" if not chunk else "black", clip_on=True)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.grid(axis="x", alpha=0.3)


def _legend(ax, kinds, waits=True):
    from matplotlib.patches import Patch

    names = {"F": "F forward", "B": "B backward", "W": "W weight grads",
             "recv": "waiting for a message"}
    handles = [Patch(color=PIPELINE_COLORS[k], label=names[k]) for k in kinds]
    if waits:
        handles.append(Patch(color=PIPELINE_COLORS["recv"], label=names["recv"]))
    ax.legend(handles=handles, fontsize=7, loc="lower right", framealpha=0.9)


def simulated_costs(pipeline: dict) -> dict:
    """F, B, W costs per whole stage (seconds) for pp.simulate, from a measured trace: the mean
    duration of each kind over all ranks, times the chunks per rank."""
    v = pipeline.get("virtual_stages", 1)
    durations = {"F": [], "B": [], "W": []}
    for events in pipeline["trace"]:
        for e in events:
            if e["kind"] in durations:
                durations[e["kind"]].append(e["end_s"] - e["start_s"])
    mean = {k: (sum(d) / len(d) if d else 0.0) for k, d in durations.items()}
    return {"f": mean["F"] * v, "b": mean["B"] * v, "w": mean["W"] * v}


def plot_simulated_pipeline(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1,
                            f: float = 1.0, b: float = 1.0, w: float = 1.0, ax=None,
                            unit: str = "time (F = 1)"):
    """The ideal timeline of a schedule (pp.simulate of its action lists, no message cost),
    with the simulated bubble and the formula in the title."""
    from hplab import pp as pipeline

    ax = _axes(ax, figsize=(9, 0.5 * pp + 1.5))
    plans = pipeline.build_schedule(schedule, pp, microbatches, virtual_stages)
    sim = pipeline.simulate(plans, f, b, w)
    rows = [[(a.kind, a.microbatch, a.chunk // pp, s, e) for a, s, e in lane if a.kind in "FBW"]
            for lane in sim.timeline]
    _draw_gantt(ax, rows, unit, show_waits=False)
    formula = bubble_formula(schedule, pp, microbatches, virtual_stages, f, b, w)
    ax.set_title(f"{schedule}, p={pp}, m={microbatches}"
                 + (f", v={virtual_stages}" if virtual_stages > 1 else "")
                 + f" — simulated bubble {sim.bubble_fraction(0):.1%} of the step; "
                   f"formula {formula['formula']} → {formula['of_step']:.1%}", fontsize=9)
    _legend(ax, ["F", "B", "W"] if schedule == "zb-h1" else ["F", "B"], waits=False)
    return ax


def plot_pipeline_trace(run_or_metrics, ax=None):
    """The measured timeline of the last training step: every F, B, W of every rank (numbers
    are microbatches), thin grey bars where a rank waited for a message, black ticks at sends.
    The title gives each rank's measured bubble (1 − compute / step time)."""
    p = _pipeline(run_or_metrics)
    ax = _axes(ax, figsize=(9, 0.5 * len(p["trace"]) + 1.5))
    v = p.get("virtual_stages", 1)
    stages = p.get("stages", len(p["trace"]))
    rows = [[(e["kind"], e["microbatch"], e["chunk"] // stages, e["start_s"] * 1e3,
              e["end_s"] * 1e3) for e in events] for events in p["trace"]]
    _draw_gantt(ax, rows, "time (ms)")
    bubbles = ", ".join(f"{b:.0%}" for b in p["bubble_fraction"])
    ax.set_title(f"measured: {p['schedule']}, p={stages}, m={p['microbatches']}"
                 + (f", v={v}" if v > 1 else "") + f" — bubble per rank {bubbles}", fontsize=9)
    _legend(ax, ["F", "B", "W"] if p["schedule"] == "zb-h1" else ["F", "B"])
    return ax


def plot_pipeline_gantt(run_or_metrics, axes=None):
    """Measured timeline (top) over the ideal timeline of the same schedule (bottom), both in
    ms: the simulation uses the mean F, B, W durations this run measured, and no message cost,
    so the difference between the two is what communication and waiting cost."""
    import matplotlib.pyplot as plt

    p = _pipeline(run_or_metrics)
    ranks, stages = len(p["trace"]), p.get("stages", len(p["trace"]))
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(10, ranks + 2.5), sharex=True,
                               layout="constrained")
    plot_pipeline_trace(run_or_metrics, ax=axes[0])
    costs = {k: c * 1e3 for k, c in simulated_costs(p).items()}
    if p["schedule"] != "zb-h1":  # the measured B includes the weight gradients
        costs["w"] = 0.0
    plot_simulated_pipeline(p["schedule"], stages, p["microbatches"],
                            p.get("virtual_stages", 1), ax=axes[1], unit="time (ms)", **costs)
    axes[1].set_title("ideal (simulated with the measured mean F, B, W): "
                      + axes[1].get_title().split(" — ")[1], fontsize=9)
    return axes


def plot_pipeline_bubbles(runs: dict, ax=None):
    """Measured bubble per run (bars: mean over ranks, whiskers: min and max rank) next to
    the formula (hatched), for runs {label: Run or metrics dict} with a pipeline trace."""
    ax = _axes(ax, figsize=(max(6.4, 1.1 * len(runs) + 2), 4.0))
    labels = list(runs)
    for i, label in enumerate(labels):
        p = _pipeline(runs[label])
        measured = p["bubble_fraction"]
        mean = sum(measured) / len(measured)
        ax.bar(i - 0.2, mean, 0.4, color="#4C72B0", label="measured" if i == 0 else None,
               yerr=[[mean - min(measured)], [max(measured) - mean]], capsize=3)
        formula = bubble_fraction(p["schedule"], p.get("stages", len(p["trace"])),
                                  p["microbatches"], p.get("virtual_stages", 1))
        ax.bar(i + 0.2, formula, 0.4, color="white", edgecolor="#4C72B0", hatch="//",
               label="formula (F = B = W)" if i == 0 else None)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="idle fraction of the step", ylim=(0, 1),
           title="Pipeline bubble: measured per run vs formula")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_memory_stacked(measured: dict[str, dict[str, float]],
                        predicted: dict[str, dict[str, float]] | None = None, ax=None,
                        title: str = "Memory per rank, stacked by kind"):
    """One stacked bar per configuration ({label: {kind: bytes}}, solid: measured), with the
    formula's stacked bar (hatched, same colours) beside it where `predicted` has the label."""
    import numpy as np

    ax = _axes(ax, (max(6.4, 1.6 * len(measured) + 2), 4.2))
    colours = dict(zip(KIND_LABELS, ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")))
    labels = list(measured)
    x = np.arange(len(labels))
    width = 0.38 if predicted else 0.6
    for offset, source, is_formula in ((-width / 2 if predicted else 0, measured, False),
                                       (width / 2, predicted or {}, True)):
        bottom = np.zeros(len(labels))
        for kind in KIND_LABELS:
            heights = np.array([source.get(label, {}).get(kind, 0) / MiB for label in labels])
            if not heights.any():
                continue
            ax.bar(x + offset, heights, width, bottom=bottom, color="white" if is_formula else
                   colours[kind], edgecolor=colours[kind], hatch="//" if is_formula else None,
                   label=None if is_formula else KIND_LABELS[kind])
            bottom += heights
        for i, total in enumerate(bottom):
            if total:
                ax.text(x[i] + offset, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
    if predicted:
        ax.bar([0], [0], color="white", edgecolor="black", hatch="//", label="formula (hatched)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set(ylabel="MiB per rank", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


# --- the device mesh ----------------------------------------------------------------------

def plot_rank_grid(dp: int, tp: int, pp: int, ax=None):
    """Which global rank holds which (dp, tp, pp) coordinate, numbered as `hplab.dist` does
    (Megatron order: tp ranks adjacent, then dp, then pp). One panel per pipeline stage; in a
    panel, row = dp rank, column = tp rank. A tp group is a row (solid outline), a dp group a
    column (dashed outline), a pp group the same cell in every panel (same colour)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    from hplab.dist import check_layout, global_rank

    check_layout(dp * tp * pp, dp, tp, pp)
    ax = _axes(ax, (max(4.0, 1.5 * pp * tp + 1.5), max(2.4, 1.0 * dp + 1.6)))
    colours = plt.get_cmap("tab20").colors
    gap = 0.8  # between pipeline stages
    for p in range(pp):
        left = p * (tp + gap)
        for d in range(dp):
            y = dp - 1 - d  # dp rank 0 on top
            for t in range(tp):
                rank = global_rank(d, t, p, dp, tp)
                ax.add_patch(Rectangle((left + t - 0.4, y - 0.4), 0.8, 0.8, lw=0,
                                       facecolor=colours[(d * tp + t) % len(colours)], alpha=0.6))
                ax.text(left + t, y + 0.08, f"rank {rank}", ha="center", va="center",
                        fontsize=10, weight="bold")
                ax.text(left + t, y - 0.2, f"dp{d} tp{t} pp{p}", ha="center", va="center",
                        fontsize=7)
            ax.add_patch(Rectangle((left - 0.46, y - 0.46), tp - 0.08, 0.92, fill=False,
                                   lw=1.6, edgecolor="black"))  # a tp group: one row
        for t in range(tp):
            ax.add_patch(Rectangle((left + t - 0.52, -0.52), 1.04, dp + 0.04, fill=False,
                                   lw=1.2, ls="--", edgecolor="#C44E52"))  # a dp group: a column
        ax.text(left + (tp - 1) / 2, dp - 0.3, f"pipeline stage {p}", ha="center", va="bottom",
                fontsize=9)
    ax.set_xlim(-0.7, pp * (tp + gap) - gap - 0.3)
    ax.set_ylim(-0.7, dp + 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"dp{dp} × tp{tp} × pp{pp} on {dp * tp * pp} ranks: "
                 f"rank = pp·{dp * tp} + dp·{tp} + tp", fontsize=10)
    ax.legend(handles=[Line2D([], [], color="black", lw=1.6, label="tp group (a row)"),
                       Line2D([], [], color="#C44E52", lw=1.2, ls="--",
                              label="dp group (a column)"),
                       Rectangle((0, 0), 1, 1, facecolor=colours[0], alpha=0.6,
                                 label="pp group (same colour in every stage)")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
    return ax
