"""Plots of time, rank by rank: a pipeline schedule's actions (simulated and measured Gantt
charts, the bubble measured, replayed and by formula) and a traced run's compute and
communication lanes (`train.py --trace`). `hplab.course.viz` re-exports them all.
"""

from statistics import median

from hplab.course import figure
from hplab.plan.formulas import bubble_formula, bubble_fraction

PIPELINE_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2", "recv": "#BBBBBB"}
TIMELINE_COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "wait": "#BBBBBB",
    "comm": "#DD8452",
}


def _pipeline(run_or_metrics) -> dict:  # the metrics file's `pipeline` entry
    if p := getattr(run_or_metrics, "metrics", run_or_metrics).get("pipeline"):
        return p
    raise ValueError("this run has no pipeline trace: run train.py with --pp > 1")


def schedule_as_run(pipeline: dict) -> list:
    """The action lists the run executed: its schedule, each receive posted as far ahead as the
    run posted it (`receives_ahead`; a run that did not record it posted them just before)."""
    from hplab.parallel.schedule import build_schedule, receives_ahead

    p = pipeline
    plans = build_schedule(p["schedule"], p["stages"], p["microbatches"], p["virtual_stages"])
    return [receives_ahead(plan, p.get("receives_ahead", 0)) for plan in plans]


def measured_bubbles(run_or_metrics) -> list[float]:
    """Each rank's measured bubble: the median over the steps after the first (the first
    warms up; one step on a shared CPU varies by several points), or the last step's where the
    run recorded only that."""
    p = _pipeline(run_or_metrics)
    per_step = p.get("bubble_fraction_per_step")
    if not per_step:
        return p["bubble_fraction"]
    return [median(steps[1:] or steps) for steps in per_step]


def link_of(run_or_metrics) -> str:
    """The emulated link a run had (`--link`), e.g. "20MB/s,200us" or "h100-80g", or ""."""
    return getattr(run_or_metrics, "metrics", run_or_metrics).get("config", {}).get("link") or ""


def wire_of(run_or_metrics) -> str:
    """The emulated wire's numbers: --link's, or those a machine's balance gave ("": none)."""
    metrics = getattr(run_or_metrics, "metrics", run_or_metrics)
    return (metrics.get("link_balance") or {}).get("network") or link_of(metrics)


def under_the_link(run_or_metrics) -> str:
    """What a plot's title adds for a run under an emulated link: " (emulated link ...)", or
    " (at the h100-80g's balance)" for a machine's."""
    metrics = getattr(run_or_metrics, "metrics", run_or_metrics)
    if balance := metrics.get("link_balance"):
        return f" (at the {balance['machine']}'s balance)"
    return f" (emulated link {text})" if (text := link_of(metrics)) else ""


def message_seconds(run_or_metrics) -> float:
    """One pipeline message's time on the run's emulated link, α + n/β, with n the bytes of one
    send (the ledger's, rank 0); 0 without a link."""
    from hplab.runtime.link import parse_wire

    metrics = getattr(run_or_metrics, "metrics", run_or_metrics)
    if not (text := wire_of(metrics)):
        return 0.0
    network = parse_wire(text)
    if network.between is not None and network.node < metrics["world_size"]:
        raise ValueError(
            f"the run's ranks span nodes ({text}): a message's time depends on the tier it "
            "crosses; time it per hop (hplab.runtime.wire.Topology.hop)"
        )
    send = metrics["comm"][0]["send"]
    return network.inside.cost(send["bytes"] / send["calls"])


def _gantt_lane(ax, r: int, events: list[tuple]) -> None:
    """Rank r's lane: a bar per F, B, W labelled with its microbatch (later chunks paler), a thin
    grey bar per wait for a message, a tick per send."""
    for kind, mb, chunk, start, end in events:
        if kind == "send":
            ax.plot([start, start], [r - 0.42, r + 0.42], color="k", lw=0.6)
            continue
        wait = kind == "recv"  # F, B, W, or (measured only) a wait for a message
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


def _gantt(ax, rows: list[list[tuple]], unit: str, p: dict, about: str, measured: bool):
    """rows[r] = [(kind, microbatch, local chunk, start, end), ...]: a lane per rank, bars labelled
    with their microbatch, later (interleaved) chunks paler; titled with `p`'s schedule, `about`."""
    from matplotlib.patches import Patch

    ax = figure.axes(ax, figsize=(9, 0.5 * len(rows) + 1.5))
    for r, events in enumerate(rows):
        _gantt_lane(ax, r, events)
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
    return figure.finish(
        ax,
        dict(axis="x"),
        dict(handles=handles, fontsize=7, loc="lower right", framealpha=0.9),
        xlabel=unit,
    )


def simulated_costs(pipeline: dict, per_chunk: bool = False) -> dict:
    """F, B, W costs per whole stage (seconds) for `simulate`, from a measured trace: the mean
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


def _replayed_trace(pipeline: dict) -> tuple[dict, dict, dict]:
    """Each action of the run's schedule (in order, its trace event) with its measured seconds;
    when each message was sent; each message a rank waited for, with that wait's start and end."""
    from hplab.course.timeline import WAITED_S
    from hplab.parallel.schedule import input_message, message_key

    p = pipeline
    own = {}
    sent = {}
    waits = {}
    for plan, events in zip(schedule_as_run(p), p["trace"]):
        actions = iter(a for a in plan if not a.kind.startswith("recv"))
        wait = None
        for e in events:  # a wait is recorded just before the F or B it feeds
            if e["kind"] == "recv":
                wait = e
                continue
            a = next(actions)
            own[a] = e["end_s"] - e["start_s"]
            if a.kind.startswith("send"):
                sent[message_key(a)] = e["start_s"]
            if wait and wait["end_s"] - wait["start_s"] > WAITED_S:  # the message came
                key = input_message(a, p["stages"] * p["virtual_stages"])
                waits[key] = (wait["start_s"], wait["end_s"])
            wait = None
    return own, sent, waits


def measured_actions(pipeline: dict) -> dict:
    """For `simulate`'s `own`: each action of the run's schedule (in order, its trace event)
    with its measured seconds, and each message a rank waited for (its key) with its delay, from
    its send to the end of that wait."""
    own, sent, waits = _replayed_trace(pipeline)
    return own | {key: end - sent[key] for key, (_, end) in waits.items()}


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
    latency: float = 0.0,
):
    """The ideal timeline of a schedule (`simulate` of its action lists; each message arrives
    `latency` after its send), with the simulated bubble and the formula in the title."""
    from hplab.parallel.pp import build_schedule
    from hplab.plan.simulate import simulate

    plans = build_schedule(schedule, pp, microbatches, virtual_stages)
    sim = simulate(plans, f, b, w, latency=latency)
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
    axes = figure.axes(axes, (10, len(p["trace"]) + 2.5), nrows=2, sharex=True)
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
    link = under_the_link(run_or_metrics)
    _gantt(axes[0], rows, "time (ms)", p, f"bubble per rank {bubbles}{link}", measured=True)
    costs = {k: c * 1e3 for k, c in simulated_costs(p).items()}  # w = 0 unless zb-h1 traced W
    message = message_seconds(run_or_metrics)
    plot_simulated_pipeline(
        p["schedule"],
        p["stages"],
        p["microbatches"],
        p["virtual_stages"],
        ax=axes[1],
        unit="time (ms)",
        latency=message * 1e3,
        **costs,
    )
    about = f"each message α + n/β = {message * 1e3:.2f} ms" if message else "free messages"
    axes[1].set_title(
        f"simulated with the measured mean F, B, W, {about}: "
        + axes[1].get_title().split(" — ")[1].split(";")[0],
        fontsize=9,
    )
    return axes


def replayed_bubbles(
    run_or_metrics, each_action: bool = False, latency: float | None = None
) -> list[float]:
    """Each rank's bubble when `simulate` replays the run's schedule with the costs it measured
    (`simulated_costs(per_chunk=True)`: each chunk's F, B, W and the message delay), or with
    `each_action`, every action's and every awaited message's own (`measured_actions`).
    `latency`: every message's time instead (an emulated link's: `message_seconds`), counted
    from the later of its send and the posting of its receive, as the link counts it."""
    from hplab.plan.simulate import simulate

    p = _pipeline(run_or_metrics)
    costs = simulated_costs(p, per_chunk=True)
    own = measured_actions(p) if each_action else {}
    if latency is not None:  # every message takes it: drop the measured delays (their keys)
        costs["latency"], own = latency, {a: t for a, t in own.items() if hasattr(a, "kind")}
    sim = simulate(schedule_as_run(p), **costs, own=own, rendezvous=latency is not None)
    return [sim.bubble_fraction(r) for r in range(p["stages"])]


def idle_shares(run_or_metrics) -> list[float]:
    """Each rank's share of the step between its actions (`idle_between_actions`): what the
    replays leave out."""
    from hplab.course.timeline import idle_between_actions
    from hplab.parallel.schedule import COMPUTE

    trace = _pipeline(run_or_metrics)["trace"]
    end = max(e["end_s"] for events in trace for e in events if e["kind"] in COMPUTE)
    return [idle_between_actions(events, 0.0, end) for events in trace]


def _bubble_bars(run) -> list[tuple]:
    """A run's bars: (offset, the bubble of each rank, bar style, legend label)."""
    p = _pipeline(run)
    message = message_seconds(run)
    formula = bubble_fraction(p["schedule"], p["stages"], p["microbatches"], p["virtual_stages"])
    return [
        (-0.3, measured_bubbles(run), dict(color="#4C72B0"), "measured (median of the steps)"),
        (
            -0.1,
            replayed_bubbles(run, each_action=True),
            dict(color="#6F95CC"),
            "that step replayed: each F, B, W, send and message as it took",
        ),
        (
            0.1,
            replayed_bubbles(run, each_action=True, latency=message),
            dict(color="#B5CDEB"),
            "the same, each message "
            + (
                f"α + n/β = {message * 1e3:.2f} ms once both ends launched it"
                if message
                else "free"
            ),
        ),
        (
            0.3,
            [formula],
            dict(color="white", edgecolor="#4C72B0", hatch="//"),
            "formula: equal stages, free messages",
        ),
    ]


def plot_pipeline_bubbles(runs: dict, ax=None):
    """Per run {label: Run or metrics dict with a pipeline trace}: the measured bubble of the
    last step, that step replayed by the simulator with its own actions' times and messages'
    delays, then with its link's time per message instead (`replayed_bubbles`), and the formula
    for equal stages and free messages.
    Bars: mean over ranks; whiskers: the least and most idle rank."""
    ax = figure.axes(ax, figsize=(max(6.4, 1.3 * len(runs) + 2), 4.0))
    for i, run in enumerate(runs.values()):
        for dx, ranks, style, label in _bubble_bars(run):
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
    ax.plot([], [], "k|", ms=10, label="whiskers: least and most idle rank")
    ax.set_xticks(range(len(runs)), list(runs), fontsize=8)
    link = under_the_link(next(iter(runs.values()))) if runs else ""
    return figure.finish(
        ax,
        dict(axis="y"),
        dict(fontsize=7, loc="upper left"),
        ylim=(0, 1.0),
        ylabel="idle fraction of the step (bars: mean over ranks)",
        title=f"Pipeline bubble: measured, simulated, formula{link}",
    )


def _compute_lane(ax, r: int, spans: list[dict]) -> None:
    """Rank r's compute lane: forward, backward and (thin, grey) waits for a collective."""
    from hplab.course.timeline import _union

    for kind, y, height in (
        ("forward", r - 0.2, 0.34),
        ("backward", r - 0.2, 0.34),
        ("wait", r - 0.2, 0.1),
    ):
        ax.broken_barh(
            [(s * 1e3, (e - s) * 1e3) for s, e in _union(x for x in spans if x["kind"] == kind)],
            (y - height / 2, height),
            color=TIMELINE_COLORS[kind],
        )


def _comm_lane(ax, r: int, spans: list[dict], end: float) -> None:
    """Rank r's communication lane: each collective from launch to completion, labelled where
    the label fits (`end`: the last time of the plot, ms), and dotted lines at step starts."""
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


def plot_timeline(trace, ax=None, during=("backward",)):
    """A run traced with `--trace DIR` (the folder, a `lab.Run` or `read_timeline`'s spans): per
    rank a compute lane (forward, backward; grey: waiting for a collective) above a communication
    lane (each collective from launch to completion, numbered within its step), and in the title
    each rank's hidden fraction: the share of communication that ran during `during`."""
    from matplotlib.patches import Patch

    from hplab.course.timeline import hidden_fraction, read_timeline

    ranks = trace if isinstance(trace, list) else read_timeline(getattr(trace, "trace_dir", trace))
    ax = figure.axes(ax, (10, 0.9 * len(ranks) + 1.6))
    end = max(s["end_s"] for spans in ranks for s in spans) * 1e3
    for r, spans in enumerate(ranks):
        _compute_lane(ax, r, spans)
        _comm_lane(ax, r, spans, end)
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
    return figure.finish(
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
