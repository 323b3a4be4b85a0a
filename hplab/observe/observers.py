"""Observers: what train.py attaches to a run to measure it, from the outside.

A strategy file says how a strategy works and nothing else; what a run *measured* — the metrics
file's timelines, routing, attention time, pipeline trace — is recorded here by objects that
hook into the model (forward hooks, a wrapped attention) or the pipeline executor (its action
hooks) and add nothing to the code they watch. Each has `step()`, a context manager around one
training step, and keeps what it saw per step.

    Recorder          --trace: a Chrome trace per rank of two steps (torch.profiler)
    MemoryWatch       bytes per rank by kind: activations saved by each forward, model states
                      after each optimizer step (hplab.observe.memory's MemoryLedger)
    PipelineTrace     --pp: when each F, B, W, send and wait for a message ran, the last step's
                      measured bubble, the microbatches in flight
    RoutingStats      mixture of experts: the token-slots each expert took, per layer and step
    AttentionMeter    --cp: each rank's attention seconds and query-key pairs, per step
    Observers         all of the above, as train.py attaches them; `per_rank()` is this rank's
                      part of the metrics file
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from pathlib import Path

import torch.distributed as dist

from hplab.observe.memory import (
    KINDS,
    MemoryLedger,
    held_by,
    model_state_tensors,
    optimizer_state_tensors,
)
from hplab.parallel import cp, moe
from hplab.parallel.optim import WrappedOptimizer, stepped_groups
from hplab.parallel.schedule import COMPUTE
from hplab.runtime import link
from hplab.runtime.clock import clock_for


class Recorder:
    """Profiles the 2nd and 3rd of `steps` (the first pays one-time costs; a 1-step run: that
    one) into `directory`/rank{rank}.json, with a range per step and per forward of the model,
    its embedding, each block and its head (hooks). Without a `directory` it does nothing."""

    def __init__(self, model, directory: str | None, rank: int, steps: range):
        self.path = Path(directory or ".") / f"rank{rank}.json"
        self.window = (steps[1:3] or steps[:1]) if directory else range(0)
        self.modules = [
            ("model", model),
            ("embedding", model.get_input_embeddings()),
            *((f"block {i}", b) for i, b in enumerate(model.blocks)),
            ("head", model.lm_head),
        ]

    @contextlib.contextmanager
    def step(self, step: int):
        from torch.profiler import profile, record_function

        if step in self.window[:1]:
            self.hooks = [h for name, m in self.modules for h in label_forward(m, name)]
            self.profiler = profile()  # the CPU, and the GPU where there is one
            self.profiler.start()
            self.queued = waited_for_a_core_s("gloo")
            self.clock = clock_anchor()
            if link.WIRE:  # an emulated link: note its transfers for the trace
                link.WIRE.log = []
        with record_function(f"step {step}") if step in self.window else contextlib.nullcontext():
            yield
        if step in self.window[-1:]:
            queued = waited_for_a_core_s("gloo") - self.queued
            self.profiler.add_metadata_json("gloo_queued_s", str(queued))
            self.profiler.stop()
            for hook in self.hooks:
                hook.remove()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
            if link.WIRE:
                add_link_transfers(self.path, link.WIRE.log, self.clock)
                link.WIRE.log = None


def clock_anchor() -> float:
    """A range named after time.perf_counter() (µs) in the trace being recorded: it ties the
    profiler's clock to Python's, to place what hplab timed itself."""
    from torch.profiler import record_function

    now = time.perf_counter() * 1e6
    with record_function(f"hplab clock {now:.1f}"):
        return now


def add_link_transfers(path: Path, transfers: list, anchor_us: float) -> None:
    """Write the emulated link's transfers (what, start, end; hplab.runtime.link) into the Chrome
    trace at `path`, as events `link:<op>` on a row of their own, placed by the clock anchor."""
    trace = json.loads(path.read_text())
    marks = [e for e in trace["traceEvents"] if e.get("name", "").startswith("hplab clock")]
    offset = marks[0]["ts"] - anchor_us if marks else 0.0
    pid = marks[0]["pid"] if marks else 0
    trace["traceEvents"] += [
        dict(ph="X", cat="link", name=f"link:{what}", pid=pid, tid="link", ts=s * 1e6 + offset)
        | dict(dur=(e - s) * 1e6)
        for what, s, e in transfers
    ]
    path.write_text(json.dumps(trace))


def waited_for_a_core_s(thread_name: str = "") -> float:
    """Seconds this process's threads whose name holds `thread_name` ("gloo": pt_gloo_runloop,
    gloo_tcp_loop; "": all) were ready to run but waited for a free core (Linux's schedstat; 0
    elsewhere): what running more processes than cores costs."""
    total = 0.0
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if thread_name in (task / "comm").read_text():
                total += int((task / "schedstat").read_text().split()[1]) / 1e9
    return total


def label_forward(module, name: str) -> list:
    """Hooks that open a range `forward {name}` when `module`'s forward starts, close it after."""
    from torch.profiler import record_function

    open_ranges = []  # a stack: recompute runs a forward again inside backward

    def enter(*_):
        open_ranges.append(record_function(f"forward {name}").__enter__())

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def is_trace_folder(path: Path) -> bool:
    """Whether `path` holds nothing but Chrome traces named rank<N>.json (a previous --trace)."""
    with contextlib.suppress(ValueError, OSError, TypeError):  # unreadable, not JSON, not a dict
        return all(
            re.fullmatch(r"rank\d+\.json", f.name) and "traceEvents" in json.loads(f.read_text())
            for f in path.iterdir()
        )
    return False


# --- memory: what a rank holds, read from outside every building block ----------------------


def held_tensors(par) -> dict[str, list]:
    """What this rank holds, by kind: the model's own tensors and each building block's."""
    model = par.model
    opt = par.optimizer
    inner = opt.inner if isinstance(opt, WrappedOptimizer) else opt
    blocks = [held_by(model), held_by(opt), model_state_tensors(par.decoder, inner)]
    held = {kind: [t for block in blocks for t in block.get(kind, ())] for kind in KINDS}
    if par.layout.zero == 3 and par.precision.mixed:  # fully_shard computes in half precision
        shards = {id(p) for p in par.decoder.parameters()}  # from fp32 shards: they are the masters
        held["master"] += [t for t in held["params"] if id(t) in shards]
        held["params"] = [t for t in held["params"] if id(t) not in shards]
    if par.layout.offload:  # the optimizer's side: what it steps, their gradients, its state
        stepped = [t for group in stepped_groups(opt) for t in group["params"]]
        host = stepped + [t.grad for t in stepped] + optimizer_state_tensors(inner)
        held["offloaded"] = [t for t in host if t is not None and t.device.type == "cpu"]
    return held


class MemoryWatch:
    """A rank's memory by kind (`ledger`, a MemoryLedger): the activations each forward saves
    for backward (hooks around the model's forward, or the pipeline executor's F actions), let
    go once that microbatch's backward has run, and the model states after every optimizer
    step (`par.on_step_end`). Pipelines: the most microbatches (and bytes) in flight."""

    def __init__(self, par):
        self.par = par
        self.ledger = MemoryLedger(par.mesh.device)
        self.in_flight: dict = {}  # pipeline: (microbatch, chunk) -> bytes until its release
        self.in_flight_max = self.bytes_in_flight_max = 0
        self.tracking = None
        if par.pipeline is not None:
            par.pipeline.observers.append(self._action)
        else:
            par.model.register_forward_pre_hook(self._before_forward)
            par.model.register_forward_hook(self._after_forward)
        par.on_step_end.append(self.measure)

    def _before_forward(self, module, args) -> None:
        self.ledger.release_activations()  # the last microbatch's backward has run
        self.tracking = self.ledger.track_activations(exclude=module.parameters())
        self.tracking.__enter__()

    def _after_forward(self, module, args, output) -> None:
        self.tracking.__exit__(None, None, None)

    @contextlib.contextmanager
    def _action(self, kind: str, action, stage):
        if kind != "F":
            yield
        else:
            with self.ledger.track_activations(exclude=stage.parameters()) as counted:
                yield
            self.in_flight[action.microbatch, action.chunk] = counted[0]
            self.in_flight_max = max(self.in_flight_max, len(self.in_flight))
            self.bytes_in_flight_max = max(self.bytes_in_flight_max, sum(self.in_flight.values()))
        if kind == self.par.pipeline.release:  # this microbatch's activations are gone
            self.ledger.release_activations(self.in_flight.pop((action.microbatch, action.chunk)))

    def measure(self, par) -> None:
        """After the optimizer step, before zero_grad: everything exists."""
        if par.pipeline is None:
            self.ledger.release_activations()
        self.ledger.measure(held_tensors(par))


# --- the pipeline's trace ---------------------------------------------------------------------


def measured_bubble(trace: list[dict], origin: float = 0.0, end: float | None = None) -> float:
    """1 - compute time / step time, from a rank's trace (times in seconds). The step runs
    from `origin` to `end` (default: this rank's first and last event)."""
    compute = [e for e in trace if e["kind"] in COMPUTE]
    if not compute:
        return 0.0
    end = max(e["end_s"] for e in compute) if end is None else end
    busy = sum(e["end_s"] - e["start_s"] for e in compute)
    return 1 - busy / (end - origin)


class PipelineTrace:
    """When each of this rank's actions ran in each step (the executor's hooks): kinds F, B,
    W, send, and recv (a wait for a message). A step's actions hold the clock's marks as they
    come (on a GPU, CUDA events the stream stamps when it gets there); `trace()` reads them as
    {kind, microbatch, chunk, start_s, end_s}, seconds from the step's start."""

    def __init__(self, executor, clock=None):
        self.clock = clock or clock_for(executor.comm.device)
        self.steps: list[tuple] = []  # per step: (its start mark, the host's clock then, actions)
        executor.observers.append(self._action)

    @contextlib.contextmanager
    def _action(self, kind: str, action, stage):
        begin = self.clock.mark()
        if kind == "run":
            self.steps.append((begin, time.perf_counter(), []))
        yield
        if kind != "run":
            where = dict(kind=kind, microbatch=action.microbatch, chunk=action.chunk)
            self.steps[-1][2].append({**where, "start": begin, "end": self.clock.mark()})

    @property
    def actions(self) -> list[dict]:
        """The marks of the step under way (or of the last one)."""
        return self.steps[-1][2] if self.steps else []

    def trace(self, step: int = -1) -> list[dict]:
        start, _, actions = self.steps[step]
        seconds = functools.partial(self.clock.seconds, start)
        return [
            {k: v for k, v in e.items() if k not in ("start", "end")}
            | {"start_s": seconds(e["start"]), "end_s": seconds(e["end"])}
            for e in actions
        ]

    def report(self, comm, memory: MemoryWatch) -> dict:
        """The last step's trace, its times from the earliest stage's start (the host's clock
        when each rank began the step: one machine), the measured bubble of the last step and
        of every step, and the most microbatches (and bytes) in flight."""
        traced = [self.step_on_one_clock(comm, step) for step in range(len(self.steps))]
        trace, bubble = traced[-1] if traced else ([], 0.0)
        return {
            "trace": trace,
            "in_flight_max": memory.in_flight_max,
            "activation_bytes_in_flight_max": memory.bytes_in_flight_max,
            "bubble_fraction": bubble,
            "bubble_fraction_per_step": [b for _, b in traced],
        }

    def step_on_one_clock(self, comm, step: int) -> tuple[list[dict], float]:
        """A step's trace shifted to the pipeline's clock, and its bubble. The bubble counts
        from the first computation on any stage to the last: a rank that begins the step late
        (it finished the previous one later) shifts the whole pipeline, not its schedule's idle
        time."""
        mine = self.steps[step][1]
        shift = mine - comm.all_reduce_scalar(mine, op=dist.ReduceOp.MIN)
        trace = [
            {**e, "start_s": e["start_s"] + shift, "end_s": e["end_s"] + shift}
            for e in self.trace(step)
        ]
        computed = [e for e in trace if e["kind"] in COMPUTE]
        first = min((e["start_s"] for e in computed), default=0.0)
        first = comm.all_reduce_scalar(first, op=dist.ReduceOp.MIN)
        end = max((e["end_s"] for e in computed), default=0.0)
        end = comm.all_reduce_scalar(end, op=dist.ReduceOp.MAX)
        return trace, measured_bubble(trace, first, end)


# --- experts and attention --------------------------------------------------------------------


class RoutingStats:
    """Observes every MoE layer of `model` from outside (a forward hook): in `per_step`, per
    training step (`with stats.step():`) and layer, the token-slots each expert took, the slots
    dropped, and the auxiliary loss (mean over the step's microbatches). Evaluation and full
    recompute's second forward: uncounted."""

    def __init__(self, model):
        self.model = model
        self.layers = moe.moe_layers(model)
        self.per_step = []
        self.now = None
        for index, layer in enumerate(self.layers):
            layer.register_forward_hook(functools.partial(self._record, index))

    @contextlib.contextmanager
    def step(self):
        n = len(self.layers)
        E = self.layers[0].n_experts if self.layers else 0
        self.now = dict(
            tokens_per_expert=[[0] * E for _ in range(n)],
            dropped=[0] * n,
            slots=[0] * n,
            aux_loss=0.0,
            forwards=0,
        )
        try:
            yield
        finally:
            step, self.now = self.now, None
            step["aux_loss"] /= max(step.pop("forwards"), 1)
            self.per_step.append(step)

    def _record(self, index: int, layer, args, output) -> None:
        if self.now is None or getattr(self.model, "recomputing", False):  # (counted once)
            return
        routing = layer.routing
        now = self.now
        now["tokens_per_expert"][index] = [
            a + b
            for a, b in zip(now["tokens_per_expert"][index], routing["tokens_per_expert"].tolist())
        ]
        now["dropped"][index] += routing["dropped"]
        now["slots"][index] += routing["slots"]
        now["aux_loss"] += float(layer.aux_loss.detach())
        now["forwards"] += index == 0


class AttentionMeter:
    """Observes every attention core of a model from outside: per training step (`with
    meter.step():`), its forward seconds on this rank, the seconds of them blocked in the cp
    group's calls (the ledger's time), the query-key pairs attended (all heads, layers), and
    the CPU time this thread spent in them (on a CPU: the computing, without the waits for the
    ring or for a core that a shared machine adds)."""

    def __init__(self, model, comm, style: str, split: str, clock=None):
        keys = ("attention_s", "attention_blocked_s", "attention_pairs", "attention_cpu_s")
        self.per_step = {key: [] for key in keys}
        self.now = dict.fromkeys(self.per_step, 0)  # (calls outside a step count nowhere)
        self.comm = comm
        self.style = style
        self.split = split
        self.clock = clock or clock_for(comm.device)  # this step's (start, end)
        self.spans = []
        for attention in model.attentions():
            attention.attend = functools.partial(self._timed, attention.attend)

    @contextlib.contextmanager
    def step(self):
        self.now = dict.fromkeys(self.per_step, 0)
        self.spans = []
        yield
        self.now["attention_s"] = sum(self.clock.seconds(*span) for span in self.spans)
        for key, value in self.now.items():
            self.per_step[key].append(value)

    def _timed(self, attend, q, k, v):
        comm = self.comm
        b, heads, n, _ = q.shape
        start = self.clock.mark()
        was = self._blocked_s()
        cpu = time.thread_time()
        y = attend(q, k, v)
        self.spans.append((start, self.clock.mark()))
        self.now["attention_cpu_s"] += time.thread_time() - cpu
        self.now["attention_blocked_s"] += self._blocked_s() - was
        self.now["attention_pairs"] += b * (  # ring: all heads; Ulysses: heads/N, the sequence
            heads * cp.pairs_computed(comm.rank, comm.size, self.split, n)
            if self.style == "ring"
            else heads // comm.size * cp.pairs_computed(0, 1, self.split, n * comm.size)
        )
        return y

    def _blocked_s(self) -> float:  # this rank's seconds in the cp group's calls so far
        return sum(op.time_s for op in self.comm.ledger.by_group[self.comm.name].values())


# --- all of them, as train.py attaches them ----------------------------------------------------


class Observers:
    """Everything train.py measures in a run of `par` (its TrainState, hplab/training.py): attach
    them before the first step, run each step inside `step(i)`, then `per_rank()`."""

    def __init__(self, par, trace_dir: str | None, steps: range):
        self.par = par
        self.pipeline = PipelineTrace(par.pipeline) if par.pipeline is not None else None
        self.memory = MemoryWatch(par)  # (inside the pipeline trace: its F includes counting)
        self.recorder = Recorder(par.decoder, trace_dir, par.mesh.rank, steps)
        self.routing = RoutingStats(par.decoder)  # tokens per expert, per step (none if dense)
        layout = par.layout
        self.attention = (
            AttentionMeter(par.decoder, par.mesh.cp, layout.cp_style, layout.cp_split)
            if layout.cp > 1
            else None
        )

    @contextlib.contextmanager
    def step(self, step: int):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.recorder.step(step))
            stack.enter_context(self.routing.step())
            if self.attention is not None:
                stack.enter_context(self.attention.step())
            yield

    def per_rank(self, steps_run: int) -> dict:
        """This rank's part of the metrics file (rank 0 gathers every rank's)."""
        mesh = self.par.mesh
        ledger = self.par.mesh.ledger
        cp_bytes = ledger.by_group_dict().get("cp", {})
        return {
            "memory": self.memory.ledger.as_dict(),
            "comm": ledger.as_dict(),
            "comm_by_group": ledger.by_group_dict(),
            "mesh": mesh.describe(),
            "experts": self.routing.per_step,  # this rank's routing, per step
            "pipeline": self.pipeline and self.pipeline.report(mesh.pp, self.memory),
            "context_parallel": self.attention
            and {
                **self.attention.per_step,
                "bytes_per_step": {op: o["bytes"] / steps_run for op, o in cp_bytes.items()},
            },
        }
