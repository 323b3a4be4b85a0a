"""The plots the labs show: what a run measured (solid markers) next to what theory predicts
(dashed lines, hatched bars). Each function draws one figure, into `ax=` if given, and returns
its axes; matplotlib loads only to draw. The plots of time per rank (pipeline schedules, traced
runs) are in `timeline_plots.py`; they are imported here, so `viz.plot_timeline` works as well.
"""

import numpy as np

from hplab.course import figure
from hplab.course.timeline_plots import (  # noqa: F401 (viz.<name>, as the labs call them)
    PIPELINE_COLORS,
    TIMELINE_COLORS,
    idle_shares,
    measured_actions,
    measured_bubbles,
    message_seconds,
    plot_pipeline_bubbles,
    plot_pipeline_gantt,
    plot_simulated_pipeline,
    plot_timeline,
    replayed_bubbles,
    simulated_costs,
    under_the_link,
    wire_of,
)
from hplab.plan.formulas import (
    alpha_beta_terms,
    bubble_fraction,
    collective_time_s,
    model_state_bytes,
)

MiB = 2**20
GiB = 2**30
KIND_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optim": "optimizer state",
    "master": "master weights",
    "activation": "activations",
}


def plot_loss_curves(runs: dict, ax=None, title: str = "Training loss"):
    """A loss curve per run ({label: Run or metrics}); later ones thinner, dashed (they overlap).
    A run with validation losses (`--eval-every`) gets them beside, dots in the same colour."""
    ax = figure.axes(ax)
    styles = [
        dict(lw=3.5, alpha=0.5),
        dict(lw=1.8, ls="--"),
        dict(lw=1.2, ls=":"),
        dict(lw=1.0, ls="-."),
    ]
    for i, (label, run) in enumerate(runs.items()):
        metrics = getattr(run, "metrics", run)
        style = styles[i % len(styles)]
        (line,) = ax.plot(
            *zip(*((s["step"], s["loss"]) for s in metrics["steps"])), label=label, **style
        )
        if evals := metrics.get("eval"):  # after `step` steps: the weights of that train point
            ax.plot(
                *zip(*((e["step"], e["loss"]) for e in evals)),
                marker="o",
                **style,
                ms=3 * style["lw"],
                color=line.get_color(),
                label=f"{label}, validation",
            )
    return figure.finish(ax, xlabel="step", ylabel="loss (cross-entropy, nats)", title=title)


def plot_memory_breakdown(
    measured: dict[str, dict[str, float]],
    predicted: dict[str, float] | None = None,
    ax=None,
    title: str = "Memory per rank, by kind",
    predicted_label="formula",
):
    """Grouped bars in MiB: a group per kind (params, grads, optim, master, activation), a bar
    per measured entry ({label: {kind: bytes}}), a hatched bar for the formula where it has one."""
    ax = figure.axes(ax, (7.2, 4.0))
    kinds = [k for k in KIND_LABELS if any(m.get(k) for m in [*measured.values(), predicted or {}])]
    series = [(label, values, False) for label, values in measured.items()]
    series += [(predicted_label, predicted, True)] if predicted else []
    width = 0.8 / len(series)
    x = np.arange(len(kinds))
    for i, (label, values, is_formula) in enumerate(series):
        shown = [j for j, k in enumerate(kinds) if not is_formula or k in values]
        bars = ax.bar(
            x[shown] + (i - (len(series) - 1) / 2) * width,
            [values.get(kinds[j], 0) / MiB for j in shown],
            width,
            label=label,
            **(dict(hatch="//", fill=False, edgecolor="black") if is_formula else {}),
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(x, [KIND_LABELS[k] for k in kinds])
    return figure.finish(ax, dict(axis="y"), ylabel="MiB", title=title)


def plot_memory_stacked(
    measured: dict[str, dict[str, float]],
    predicted: dict[str, dict[str, float]] | None = None,
    ax=None,
    title: str = "Memory per rank, stacked by kind",
):
    """One stacked bar per configuration ({label: {kind: bytes}}, solid: measured), with the
    formula's stacked bar (hatched, same colours) beside it where `predicted` has the label."""
    ax = figure.axes(ax, (max(6.4, 1.6 * len(measured) + 2), 4.2))
    colours = dict(zip(KIND_LABELS, ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")))
    labels = list(measured)
    x = np.arange(len(measured))
    width = 0.38 if predicted else 0.6
    for offset, source, is_formula in (
        (-width / 2 if predicted else 0, measured, False),
        (width / 2, predicted or {}, True),
    ):
        bottom = np.zeros(len(labels))
        for kind in KIND_LABELS:
            heights = np.array([source.get(label, {}).get(kind, 0) / MiB for label in labels])
            if heights.any():
                ax.bar(
                    x + offset,
                    heights,
                    width,
                    bottom=bottom,
                    edgecolor=colours[kind],
                    **(
                        dict(color="white", hatch="//")
                        if is_formula
                        else dict(color=colours[kind], label=KIND_LABELS[kind])
                    ),
                )
                bottom += heights
        for i, total in enumerate(bottom):
            if total:
                ax.text(x[i] + offset, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
    if predicted:
        ax.bar([0], [0], color="white", edgecolor="black", hatch="//", label="formula (hatched)")
    ax.set_xticks(x, labels, fontsize=8)
    return figure.finish(ax, dict(axis="y"), dict(fontsize=8), ylabel="MiB per rank", title=title)


def plot_throughput(
    x,
    series: dict[str, list[float]],
    xlabel: str,
    ax=None,
    title="Throughput",
    ylabel="tokens / s",
    ideal: dict | None = None,
):
    """Measured throughput (markers) against a parameter, with optional ideal lines (dashed)."""
    ax = figure.axes(ax)
    for label, ys in series.items():
        ax.plot(x, ys, "o-", label=f"{label} (measured)")
    for label, ys in (ideal or {}).items():
        ax.plot(x, ys, "--", color="gray", label=label)
    if all(isinstance(v, (int, float)) for v in x):
        ax.set_xticks(list(x))  # the values run, not a continuous axis
    return figure.finish(ax, xlabel=xlabel, ylabel=ylabel, title=title, ylim=(0, None))


def plot_collective_times(result, ops: list[str] | None = None, ax=None):
    """Time per call against message size (log-log) of each op in a `lab.Collectives`: the
    measured points, and dashed the α-β fit — or, under an emulated link, the ring's
    steps·α + factor·S/β with the link's own α and β (`hplab.runtime.link`; one tier), which
    the title names."""
    from hplab.runtime.link import parse

    ax = figure.axes(ax, (7.2, 4.6))
    link = parse(result.link) if result.link else None
    for i, op in enumerate(ops or result.ops):
        sizes = np.asarray(result.sizes(op), dtype=float)
        fit = result.fit(op)
        ax.loglog(sizes, np.asarray(result.times(op)) * 1e3, "o", color=f"C{i}", ms=4,
                  label=f"{op} (measured)")  # fmt: skip
        grid = np.geomspace(sizes.min(), sizes.max(), 100)
        if link:
            steps, factor = alpha_beta_terms(op, result.world_size)
            line = collective_time_s(op, grid, result.world_size, link.bandwidth, link.latency)
            label = f"{steps}·α + {factor:.2f}·S/β (link)"
        else:
            line = fit.predict(grid)
            label = f"α-β: α={fit.alpha_s * 1e6:.0f} µs, β={fit.beta_bytes_per_s / 1e9:.2f} GB/s"
        ax.loglog(grid, line * 1e3, "--", color=f"C{i}", label=label)
    where = f"emulated link {result.link}" if link else result.data["backend"]
    return figure.finish(
        ax,
        dict(which="both"),
        dict(fontsize=7, ncol=2),
        xlabel="message size S (payload bytes)",
        ylabel="time per call (ms)",
        title=f"Collectives on {result.world_size} processes ({where})",
    )


def plot_zero_memory(
    num_params: float,
    world_sizes=(1, 2, 4, 8, 16, 32, 64),
    precision: str = "bf16",
    highlight: tuple[int, int] | None = None,
    ax=None,
    device_bytes: float | None = None,
):
    """Model-state memory per device ([ZeRO] Sec. 5, `formulas.model_state_bytes`) against data-
    parallel size, a line per ZeRO stage; `highlight=(stage, world_size)` marks one point."""

    def gib(stage: int, n: int) -> float:
        return model_state_bytes(num_params, n, stage, precision)["total_bytes"] / GiB

    ax = figure.axes(ax)
    for stage, name in enumerate(
        ("DDP (stage 0)", "ZeRO-1: optimizer state", "ZeRO-2: + gradients", "ZeRO-3: + parameters")
    ):
        ax.plot(world_sizes, [gib(stage, n) for n in world_sizes], "o--", ms=3, label=name)
    if highlight:
        stage, n = highlight
        y = gib(*highlight)
        ax.plot([n], [y], "k*", ms=14, label=f"stage {stage}, N_d={n}: {y:.1f} GiB")
    if device_bytes:
        ax.axhline(
            device_bytes / GiB,
            color="red",
            lw=1,
            label=f"device memory: {device_bytes / 1e9:.0f} GB = {device_bytes / GiB:.1f} GiB",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(world_sizes), [str(n) for n in world_sizes])
    return figure.finish(
        ax,
        dict(which="both"),
        dict(fontsize=8),
        yscale="log",
        xlabel="data-parallel size N_d",
        ylabel="model states per device (GiB)",
        title=f"ZeRO memory, formula: Ψ = {num_params / 1e9:.4g} billion params, "
        f"{precision} + Adam",
    )


def plot_bubble_fraction(pp: int, max_microbatches: int = 32, highlight: int = 0, ax=None):
    """1F1B's bubble fraction, (p−1)/(m+p−1) of the step time, against microbatches m (formula,
    [PTD-P] Sec. 2.2: idle (p−1) slots out of m+p−1; `formulas.bubble_fraction`)."""
    ax, ms = figure.axes(ax), list(range(1, max_microbatches + 1))
    for p in sorted({2, 4, 8, pp}):
        ax.plot(
            ms,
            [bubble_fraction("1f1b", p, m) for m in ms],
            lw=2.5 if p == pp else 1,
            label=f"pp = {p}",
        )
    if highlight:
        y = bubble_fraction("1f1b", pp, highlight)
        ax.plot([highlight], [y], "k*", ms=14, label=f"pp={pp}, m={highlight}: {y:.0%} idle")
    return figure.finish(
        ax,
        xlabel="microbatches per step m",
        ylabel="idle fraction of the step",
        title="Pipeline bubble fraction (1f1b): (p−1)/(m+p−1)",
        ylim=(0, 1),
    )


def _rank_cell(ax, x: float, y: float, d: int, t: int, p: int, dp: int, tp: int, colour):
    """One rank's square at (x, y): its global rank and its (dp, tp, pp) coordinates."""
    from matplotlib.patches import Rectangle

    from hplab.parallel.mesh import global_rank

    ax.add_patch(Rectangle((x - 0.4, y - 0.4), 0.8, 0.8, lw=0, facecolor=colour, alpha=0.6))
    ax.text(
        x,
        y + 0.08,
        f"rank {global_rank(d, t, p, dp, tp)}",
        ha="center",
        va="center",
        fontsize=10,
        weight="bold",
    )
    ax.text(x, y - 0.2, f"dp{d} tp{t} pp{p}", ha="center", va="center", fontsize=7)


def _stage_panel(ax, p: int, left: float, dp: int, tp: int, colours, tp_line, dp_line):
    """Pipeline stage p's panel from x = left: a row per dp rank (framed: a tp group), a column
    per tp rank (framed, dashed: a dp group)."""
    from matplotlib.patches import Rectangle

    for d in range(dp):
        y = dp - 1 - d  # dp rank 0 on top
        for t in range(tp):
            _rank_cell(ax, left + t, y, d, t, p, dp, tp, colours[(d * tp + t) % len(colours)])
        ax.add_patch(Rectangle((left - 0.46, y - 0.46), tp - 0.08, 0.92, fill=False, **tp_line))
    for t in range(tp):  # a dp group: a column (a tp group: a row, just above)
        ax.add_patch(Rectangle((left + t - 0.52, -0.52), 1.04, dp + 0.04, fill=False, **dp_line))
    ax.text(
        left + (tp - 1) / 2, dp - 0.3, f"pipeline stage {p}", ha="center", va="bottom", fontsize=9
    )


def _rank_grid_legend(ax, colour, tp_line: dict, dp_line: dict) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    ax.legend(
        handles=[
            plt.Line2D([], [], **tp_line, label="tp group (a row)"),
            plt.Line2D([], [], **dp_line, label="dp group (a column)"),
            Rectangle(
                (0, 0),
                1,
                1,
                facecolor=colour,
                alpha=0.6,
                label="pp group (same colour in every stage)",
            ),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=3,
        fontsize=7,
        frameon=False,
    )


def plot_rank_grid(dp: int, tp: int, pp: int, ax=None):
    """Which global rank holds which (dp, tp, pp) coordinate (`hplab.parallel.mesh`'s Megatron
    order: tp, dp, pp): a panel per pipeline stage, a row per dp rank (a tp group), a column per tp
    rank. An impossible layout raises hplab.config.LayoutError."""
    import matplotlib.pyplot as plt

    from hplab.config import Layout, check_sizes_and_choices

    check_sizes_and_choices(Layout(dp=dp, tp=tp, pp=pp))
    ax = figure.axes(ax, (max(4.0, 1.5 * pp * tp + 1.5), max(2.4, 1.0 * dp + 1.6)))
    colours = plt.get_cmap("tab20").colors  # gap: between pipeline stages
    gap = 0.8
    tp_line = dict(lw=1.6, color="black")
    dp_line = dict(lw=1.2, ls="--", color="#C44E52")
    for p in range(pp):
        _stage_panel(ax, p, p * (tp + gap), dp, tp, colours, tp_line, dp_line)
    ax.set(xlim=(-0.7, pp * (tp + gap) - gap - 0.3), ylim=(-0.7, dp + 0.1), aspect="equal")
    ax.axis("off")
    ax.set_title(
        f"dp{dp} × tp{tp} × pp{pp} on {dp * tp * pp} ranks: rank = pp·{dp * tp} + dp·{tp} + tp",
        fontsize=10,
    )
    _rank_grid_legend(ax, colours[0], tp_line, dp_line)
    return ax


def explore(draw, **controls):
    """Controls (ipywidgets, by keyword) that redraw the figure `draw(**their values)` draws on
    each change, as a PNG in an Image widget (any backend; what `draw` returns is not printed).
    The starting figure also stays as a plain image, for views without widgets (GitHub)."""
    import base64

    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.core.pylabtools import print_figure
    from IPython.display import display

    image = widgets.Image(format="png")

    def redraw(_=None):
        draw(**{name: control.value for name, control in controls.items()})
        image.value = print_figure(plt.gcf(), "png", bbox_inches="tight")
        plt.close(plt.gcf())

    for control in controls.values():
        control.style.description_width = "initial"  # whole labels, never "microbatc..."
        control.observe(redraw, "value")
    redraw()
    row = widgets.HBox(list(controls.values()), layout=dict(flex_flow="row wrap"))
    starting_figure = base64.b64encode(image.value).decode()
    display(
        {
            **widgets.VBox([row, image])._repr_mimebundle_(),
            "image/png": starting_figure,
            "text/plain": "(controls that redraw this figure: run the notebook)",
        },
        raw=True,
    )
