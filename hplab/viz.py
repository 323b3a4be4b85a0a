"""The plots the labs show: what a run measured (solid markers) next to what theory predicts
(dashed lines, hatched bars). Each function draws one figure, into `ax=` if given, and returns
its axes; matplotlib loads only to draw.
"""

from statistics import median

import numpy as np

from hplab.formulas import bubble_formula, bubble_fraction, model_state_bytes

MiB, GiB = 2**20, 2**30
KIND_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optim": "optimizer state",
    "master": "master weights",
    "activation": "activations",
}
PIPELINE_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2", "recv": "#BBBBBB"}
TIMELINE_COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "wait": "#BBBBBB",
    "comm": "#DD8452",
}


def _axes(ax, figsize=(6.4, 4.0), **grid):  # `ax`, or new axes (`grid`: plt.subplots options)
    import matplotlib.pyplot as plt

    return plt.subplots(**grid, figsize=figsize, layout="constrained")[1] if ax is None else ax


def _finish(ax, grid: dict | None = None, legend: dict | None = None, **settings):
    """`ax.set(**settings)` (labels, limits, title), a light grid and a legend; returns ax."""
    ax.set(**settings)
    ax.grid(alpha=0.3, **(grid or {}))
    ax.legend(**(legend or {}))
    return ax


def plot_loss_curves(runs: dict, ax=None, title: str = "Training loss"):
    """A loss curve per run ({label: Run or metrics}); later ones thinner, dashed (they overlap).
    A run with validation losses (`--eval-every`) gets them beside, dots in the same colour."""
    ax = _axes(ax)
    styles = [
        dict(lw=3.5, alpha=0.5),
        dict(lw=1.8, ls="--"),
        dict(lw=1.2, ls=":"),
        dict(lw=1.0, ls="-."),
    ]
    for i, (label, run) in enumerate(runs.items()):
        metrics, style = getattr(run, "metrics", run), styles[i % len(styles)]
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
    return _finish(ax, xlabel="step", ylabel="loss (cross-entropy, nats)", title=title)


def plot_memory_breakdown(
    measured: dict[str, dict[str, float]],
    predicted: dict[str, float] | None = None,
    ax=None,
    title: str = "Memory per rank, by kind",
    predicted_label="formula",
):
    """Grouped bars in MiB: a group per kind (params, grads, optim, master, activation), a bar
    per measured entry ({label: {kind: bytes}}), a hatched bar for the formula where it has one."""
    ax = _axes(ax, (7.2, 4.0))
    kinds = [k for k in KIND_LABELS if any(m.get(k) for m in [*measured.values(), predicted or {}])]
    series = [(label, values, False) for label, values in measured.items()]
    series += [(predicted_label, predicted, True)] if predicted else []
    width, x = 0.8 / len(series), np.arange(len(kinds))
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
    return _finish(ax, dict(axis="y"), ylabel="MiB", title=title)


def plot_memory_stacked(
    measured: dict[str, dict[str, float]],
    predicted: dict[str, dict[str, float]] | None = None,
    ax=None,
    title: str = "Memory per rank, stacked by kind",
):
    """One stacked bar per configuration ({label: {kind: bytes}}, solid: measured), with the
    formula's stacked bar (hatched, same colours) beside it where `predicted` has the label."""
    ax = _axes(ax, (max(6.4, 1.6 * len(measured) + 2), 4.2))
    colours = dict(zip(KIND_LABELS, ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")))
    labels, x, width = list(measured), np.arange(len(measured)), 0.38 if predicted else 0.6
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
    return _finish(ax, dict(axis="y"), dict(fontsize=8), ylabel="MiB per rank", title=title)


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
    ax = _axes(ax)
    for label, ys in series.items():
        ax.plot(x, ys, "o-", label=f"{label} (measured)")
    for label, ys in (ideal or {}).items():
        ax.plot(x, ys, "--", color="gray", label=label)
    if all(isinstance(v, (int, float)) for v in x):
        ax.set_xticks(list(x))  # the values run, not a continuous axis
    return _finish(ax, xlabel=xlabel, ylabel=ylabel, title=title, ylim=(0, None))


def plot_collective_times(result, ops: list[str] | None = None, ax=None):
    """Time per call against message size (log-log) of each op in a `lab.Collectives`, α-β fit."""
    ax = _axes(ax, (7.2, 4.6))
    for i, op in enumerate(ops or result.ops):
        sizes, fit = np.asarray(result.sizes(op), dtype=float), result.fit(op)
        ax.loglog(
            sizes,
            np.asarray(result.times(op)) * 1e3,
            "o",
            color=f"C{i}",
            ms=4,
            label=f"{op} (measured)",
        )
        grid = np.geomspace(sizes.min(), sizes.max(), 100)
        ax.loglog(
            grid,
            fit.predict(grid) * 1e3,
            "--",
            color=f"C{i}",
            label=f"α-β: α={fit.alpha_s * 1e6:.0f} µs, β={fit.beta_bytes_per_s / 1e9:.2f} GB/s",
        )
    return _finish(
        ax,
        dict(which="both"),
        dict(fontsize=7, ncol=2),
        xlabel="message size S (payload bytes)",
        ylabel="time per call (ms)",
        title=f"Collectives on {result.world_size} processes ({result.data['backend']})",
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

    ax = _axes(ax)
    for stage, name in enumerate(
        ("DDP (stage 0)", "ZeRO-1: optimizer state", "ZeRO-2: + gradients", "ZeRO-3: + parameters")
    ):
        ax.plot(world_sizes, [gib(stage, n) for n in world_sizes], "o--", ms=3, label=name)
    if highlight:
        (stage, n), y = highlight, gib(*highlight)
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
    return _finish(
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
    ax, ms = _axes(ax), list(range(1, max_microbatches + 1))
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
    return _finish(
        ax,
        xlabel="microbatches per step m",
        ylabel="idle fraction of the step",
        title="Pipeline bubble fraction (1f1b): (p−1)/(m+p−1)",
        ylim=(0, 1),
    )


def _pipeline(run_or_metrics) -> dict:  # the metrics file's `pipeline` entry
    if p := getattr(run_or_metrics, "metrics", run_or_metrics).get("pipeline"):
        return p
    raise ValueError("this run has no pipeline trace: run train.py with --pp > 1")


def _gantt(ax, rows: list[list[tuple]], unit: str, p: dict, about: str, measured: bool):
    """rows[r] = [(kind, microbatch, local chunk, start, end), ...]: a lane per rank, bars labelled
    with their microbatch, later (interleaved) chunks paler; titled with `p`'s schedule, `about`."""
    from matplotlib.patches import Patch

    ax = _axes(ax, figsize=(9, 0.5 * len(rows) + 1.5))
    for r, events in enumerate(rows):
        for kind, mb, chunk, start, end in events:
            if kind == "send":
                ax.plot([start, start], [r - 0.42, r + 0.42], color="k", lw=0.6)
            else:  # F, B, W, or (measured only) a wait for a message
                wait = kind == "recv"
                ax.barh(
                    r,
                    end - start,
                    left=start,
                    height=0.3 if wait else 0.8,
                    color=PIPELINE_COLORS[kind],
                    edgecolor="white",
                    lw=0.5,
                    alpha=1.0 if wait else 1.0 / (1 + 0.8 * chunk),
                )  # later chunks paler
                if not wait:
                    ax.text(
                        (start + end) / 2,
                        r,
                        str(mb),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if not chunk else "black",
                        clip_on=True,
                    )
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    v = f", v={p['virtual_stages']}" if p["virtual_stages"] > 1 else ""
    ax.set_title(
        f"{'measured: ' * measured}{p['schedule']}, p={p['stages']}, "
        f"m={p['microbatches']}{v} — {about}",
        fontsize=9,
    )
    names = dict(F="F forward", B="B backward", W="W weight grads", recv="waiting for a message")
    kinds = [*("FBW" if p["schedule"] == "zb-h1" else "FB")] + ["recv"] * measured
    handles = [Patch(color=PIPELINE_COLORS[k], label=names[k]) for k in kinds]
    return _finish(
        ax,
        dict(axis="x"),
        dict(handles=handles, fontsize=7, loc="lower right", framealpha=0.9),
        xlabel=unit,
    )


def simulated_costs(pipeline: dict, per_chunk: bool = False) -> dict:
    """F, B, W costs per whole stage (seconds) for pp.simulate, from a measured trace: the mean
    duration of each kind over all ranks, times the chunks per rank. `per_chunk`: instead, the
    median of each model chunk (real stages differ: the last runs the LM head and the loss),
    and `latency`, the median delay of the messages a rank waited for (`measured_actions`)."""
    events = [e for rank in pipeline["trace"] for e in rank]

    def seconds(kind: str, chunk: int | None = None) -> list[float]:
        return [
            e["end_s"] - e["start_s"]
            for e in events
            if e["kind"] == kind and chunk in (None, e["chunk"])
        ]

    if not per_chunk:
        v = pipeline.get("virtual_stages", 1)
        return {k.lower(): sum(d) / len(d) * v if (d := seconds(k)) else 0.0 for k in "FBW"}
    chunks = range(1 + max(e["chunk"] for e in events))
    delays = [d for key, d in measured_actions(pipeline).items() if isinstance(key, tuple)]
    return {
        **{k.lower(): [median(seconds(k, c) or [0.0]) for c in chunks] for k in "FBW"},
        "latency": median(delays or [0.0]),
    }


def measured_actions(pipeline: dict) -> dict:
    """For pp.simulate's `own`: each action of the run's schedule (in order, its trace event)
    with its measured seconds, and each message a rank waited for (its key) with its delay, from
    its send to the end of that wait."""
    from hplab.schedule import WAITED_S, build_schedule, input_message, message_key

    p, own, sent, arrived = pipeline, {}, {}, {}
    for plan, events in zip(
        build_schedule(p["schedule"], p["stages"], p["microbatches"], p["virtual_stages"]),
        p["trace"],
    ):
        actions, wait = iter(a for a in plan if not a.kind.startswith("recv")), None
        for e in events:  # a wait is recorded just before the F or B it feeds
            if e["kind"] == "recv":
                wait = e
                continue
            a = next(actions)
            own[a] = e["end_s"] - e["start_s"]
            if a.kind.startswith("send"):
                sent[message_key(a)] = e["start_s"]
            if wait and wait["end_s"] - wait["start_s"] > WAITED_S:  # the message came
                arrived[input_message(a, p["stages"] * p["virtual_stages"])] = wait["end_s"]
            wait = None
    return own | {key: end - sent[key] for key, end in arrived.items()}


def plot_simulated_pipeline(
    schedule: str,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    f: float = 1.0,
    b: float = 1.0,
    w: float = 1.0,
    ax=None,
    unit: str = "time (F = 1)",
):
    """The ideal timeline of a schedule (pp.simulate of its action lists, no message cost),
    with the simulated bubble and the formula in the title."""
    from hplab.pp import build_schedule, simulate

    sim = simulate(build_schedule(schedule, pp, microbatches, virtual_stages), f, b, w)
    rows = [
        [(a.kind, a.microbatch, a.chunk // pp, s, e) for a, s, e in lane if a.kind in "FBW"]
        for lane in sim.timeline
    ]
    formula = bubble_formula(schedule, pp, microbatches, virtual_stages, f, b, w)
    p = dict(schedule=schedule, stages=pp, microbatches=microbatches, virtual_stages=virtual_stages)
    return _gantt(
        ax,
        rows,
        unit,
        p,
        f"simulated bubble {sim.bubble_fraction(0):.1%} of the step; "
        f"formula {formula['formula']} → {formula['of_step']:.1%}",
        measured=False,
    )


def plot_pipeline_gantt(run_or_metrics, axes=None):
    """Measured (top): the last step's F, B, W per rank (numbers: microbatches), grey waits for a
    message, ticks at sends, each rank's bubble (1 − compute / step time). Ideal (bottom): the
    schedule simulated with this run's mean F, B, W, no message cost: the gap is communication."""
    p = _pipeline(run_or_metrics)
    axes = _axes(axes, (10, len(p["trace"]) + 2.5), nrows=2, sharex=True)
    rows = [
        [
            (
                e["kind"],
                e["microbatch"],
                e["chunk"] // p["stages"],
                e["start_s"] * 1e3,
                e["end_s"] * 1e3,
            )
            for e in events
        ]
        for events in p["trace"]
    ]
    bubbles = ", ".join(f"{b:.0%}" for b in p["bubble_fraction"])
    _gantt(axes[0], rows, "time (ms)", p, f"bubble per rank {bubbles}", measured=True)
    costs = {k: c * 1e3 for k, c in simulated_costs(p).items()}  # w = 0 unless zb-h1 traced W
    plot_simulated_pipeline(
        p["schedule"],
        p["stages"],
        p["microbatches"],
        p["virtual_stages"],
        ax=axes[1],
        unit="time (ms)",
        **costs,
    )
    axes[1].set_title(
        "ideal (simulated with the measured mean F, B, W): " + axes[1].get_title().split(" — ")[1],
        fontsize=9,
    )
    return axes


def replayed_bubbles(run_or_metrics, each_action: bool = False) -> list[float]:
    """Each rank's bubble when pp.simulate replays the run's schedule with the costs it measured
    (`simulated_costs(per_chunk=True)`: each chunk's F, B, W and the message delay), or with
    `each_action`, every action's and every awaited message's own (`measured_actions`)."""
    from hplab.pp import build_schedule, simulate

    p = _pipeline(run_or_metrics)
    sim = simulate(
        build_schedule(p["schedule"], p["stages"], p["microbatches"], p["virtual_stages"]),
        **simulated_costs(p, per_chunk=True),
        own=measured_actions(p) if each_action else None,
    )
    return [sim.bubble_fraction(r) for r in range(p["stages"])]


def idle_shares(run_or_metrics) -> list[float]:
    """Each rank's share of the step between its actions (`idle_between_actions`): what the
    replays leave out."""
    from hplab.schedule import COMPUTE, idle_between_actions

    trace = _pipeline(run_or_metrics)["trace"]
    end = max(e["end_s"] for events in trace for e in events if e["kind"] in COMPUTE)
    return [idle_between_actions(events, 0.0, end) for events in trace]


def plot_pipeline_bubbles(runs: dict, ax=None):
    """Per run {label: Run or metrics dict with a pipeline trace}: the measured bubble, the
    schedule replayed with the run's own costs (`replayed_bubbles`: each action's own, then
    the medians per chunk) and the formula for equal stages and free messages. Bars: mean over
    ranks; whiskers: the least and most idle rank."""
    ax = _axes(ax, figsize=(max(6.4, 1.3 * len(runs) + 2), 4.0))
    for i, run in enumerate(runs.values()):
        p = _pipeline(run)
        formula = bubble_fraction(
            p["schedule"], p["stages"], p["microbatches"], p["virtual_stages"]
        )
        for dx, ranks, style, label in (
            (-0.3, p["bubble_fraction"], dict(color="#4C72B0"), "measured"),
            (
                -0.1,
                replayed_bubbles(run, each_action=True),
                dict(color="#7FA7D9"),
                "simulated with every F, B, W and message delay this run measured",
            ),
            (
                0.1,
                replayed_bubbles(run),
                dict(color="#C6DBF2"),
                "simulated with this run's median F, B, W per stage and message delay",
            ),
            (
                0.3,
                [formula],
                dict(color="white", edgecolor="#4C72B0", hatch="//"),
                "formula: equal stages, free messages",
            ),
        ):
            mean = sum(ranks) / len(ranks)
            ax.bar(
                i + dx,
                mean,
                0.2,
                **style,
                label=None if i else label,
                yerr=[[mean - min(ranks)], [max(ranks) - mean]] if len(ranks) > 1 else None,
                capsize=3,
            )
            if dx == -0.1:  # on top of that replay: what it leaves out, measured on its own
                idle = idle_shares(run)
                ax.bar(
                    i + dx,
                    sum(idle) / len(idle),
                    0.2,
                    bottom=mean,
                    color="white",
                    edgecolor="#7FA7D9",
                    hatch="..",
                    label=None
                    if i
                    else "+ each rank's time between its actions (measured): late start, Python",
                )
    ax.plot([], [], "k|", ms=10, label="whiskers: least and most idle rank")
    ax.set_xticks(range(len(runs)), list(runs), rotation=20, ha="right", fontsize=8)
    return _finish(
        ax,
        dict(axis="y"),
        dict(fontsize=7, loc="upper left"),
        ylim=(0, 1.3),
        ylabel="idle fraction of the step (bars: mean over ranks)",
        title="Pipeline bubble fraction: measured, replayed, formula",
    )


def plot_timeline(trace, ax=None, during=("backward",)):
    """A run traced with `--trace DIR` (the folder, a `lab.Run` or `read_timeline`'s spans): per
    rank a compute lane (forward, backward; grey: waiting for a collective) above a communication
    lane (each collective from launch to completion, numbered within its step), and in the title
    each rank's hidden fraction: the share of communication that ran during `during`."""
    from matplotlib.patches import Patch

    from hplab.timeline import _union, hidden_fraction, read_timeline

    ranks = trace if isinstance(trace, list) else read_timeline(getattr(trace, "trace_dir", trace))
    ax = _axes(ax, (10, 0.9 * len(ranks) + 1.6))
    end = max(s["end_s"] for spans in ranks for s in spans) * 1e3
    for r, spans in enumerate(ranks):
        for kind, y, height in (
            ("forward", r - 0.2, 0.34),
            ("backward", r - 0.2, 0.34),
            ("wait", r - 0.2, 0.1),
        ):
            ax.broken_barh(
                [
                    (s * 1e3, (e - s) * 1e3)
                    for s, e in _union(x for x in spans if x["kind"] == kind)
                ],
                (y - height / 2, height),
                color=TIMELINE_COLORS[kind],
            )
        comm = [s for s in spans if s["kind"] == "comm"]  # one by one: they may overlap
        ax.broken_barh(
            [(s["start_s"] * 1e3, (s["end_s"] - s["start_s"]) * 1e3) for s in comm],
            (r + 0.05, 0.3),
            color=TIMELINE_COLORS["comm"],
            edgecolor="white",
            lw=0.4,
        )
        free = 0.0  # labels where they fit: op and number in the step ("all_reduce #3")
        for s in comm:
            text = f"{s['name'].split()[0]} #{s['name'].rsplit('#')[-1]}"
            if s["start_s"] * 1e3 >= free and (s["end_s"] - s["start_s"]) * 1e3 > end / 30:
                ax.text(s["start_s"] * 1e3, r + 0.2, " " + text, va="center", fontsize=6)
                free = s["start_s"] * 1e3 + len(text) * end / 140
        for s in spans:
            if s["kind"] == "step":
                ax.axvline(s["start_s"] * 1e3, color="k", lw=0.6, ls=":")
    ax.set_yticks(
        [y for r in range(len(ranks)) for y in (r - 0.2, r + 0.2)],
        [f"rank {r} {lane}" for r in range(len(ranks)) for lane in ("compute", "comm")],
    )
    ax.invert_yaxis()
    hidden = ", ".join(f"{hidden_fraction(spans, during):.0%}" for spans in ranks)
    names = dict(
        forward="forward",
        backward="backward",
        wait="waiting for a collective",
        comm="collective, launch to completion",
    )
    return _finish(
        ax,
        dict(axis="x"),
        dict(
            handles=[Patch(color=c, label=names[k]) for k, c in TIMELINE_COLORS.items()],
            fontsize=7,
            ncol=4,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.18),
        ),
        xlabel="time (ms; dotted: step starts)",
        title=f"hidden behind {' + '.join(during)}, per rank: {hidden}",
    )


def plot_rank_grid(dp: int, tp: int, pp: int, ax=None):
    """Which global rank holds which (dp, tp, pp) coordinate (`hplab.dist`'s Megatron order: tp,
    dp, pp): a panel per pipeline stage, a row per dp rank (a tp group), a column per tp rank."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from hplab.config import Layout, check_sizes_and_choices
    from hplab.dist import global_rank

    check_sizes_and_choices(Layout(dp=dp, tp=tp, pp=pp))
    ax = _axes(ax, (max(4.0, 1.5 * pp * tp + 1.5), max(2.4, 1.0 * dp + 1.6)))
    colours, gap = plt.get_cmap("tab20").colors, 0.8  # gap: between pipeline stages
    tp_line, dp_line = dict(lw=1.6, color="black"), dict(lw=1.2, ls="--", color="#C44E52")
    for p in range(pp):
        left = p * (tp + gap)
        for d in range(dp):
            y = dp - 1 - d  # dp rank 0 on top
            for t in range(tp):
                ax.add_patch(
                    Rectangle(
                        (left + t - 0.4, y - 0.4),
                        0.8,
                        0.8,
                        lw=0,
                        facecolor=colours[(d * tp + t) % len(colours)],
                        alpha=0.6,
                    )
                )
                ax.text(
                    left + t,
                    y + 0.08,
                    f"rank {global_rank(d, t, p, dp, tp)}",
                    ha="center",
                    va="center",
                    fontsize=10,
                    weight="bold",
                )
                ax.text(
                    left + t, y - 0.2, f"dp{d} tp{t} pp{p}", ha="center", va="center", fontsize=7
                )
            ax.add_patch(Rectangle((left - 0.46, y - 0.46), tp - 0.08, 0.92, fill=False, **tp_line))
        for t in range(tp):  # a dp group: a column (a tp group: a row, just above)
            ax.add_patch(
                Rectangle((left + t - 0.52, -0.52), 1.04, dp + 0.04, fill=False, **dp_line)
            )
        ax.text(
            left + (tp - 1) / 2,
            dp - 0.3,
            f"pipeline stage {p}",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set(xlim=(-0.7, pp * (tp + gap) - gap - 0.3), ylim=(-0.7, dp + 0.1), aspect="equal")
    ax.axis("off")
    ax.set_title(
        f"dp{dp} × tp{tp} × pp{pp} on {dp * tp * pp} ranks: rank = pp·{dp * tp} + dp·{tp} + tp",
        fontsize=10,
    )
    ax.legend(
        handles=[
            plt.Line2D([], [], **tp_line, label="tp group (a row)"),
            plt.Line2D([], [], **dp_line, label="dp group (a column)"),
            Rectangle(
                (0, 0),
                1,
                1,
                facecolor=colours[0],
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
