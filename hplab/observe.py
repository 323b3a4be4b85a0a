"""Observers: what train.py attaches to a run to measure it, from the outside.

A strategy file says how a strategy works and nothing else; what a run *measured* — the metrics
file's timelines, routing, attention time, pipeline trace — is recorded here by objects that
hook into the model (forward hooks, a wrapped attention) or the pipeline executor (its action
hooks) and add nothing to the code they watch. Each has `step()`, a context manager around one
training step, and keeps what it saw per step.

    Recorder          --trace: a Chrome trace per rank of two steps (torch.profiler)
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path


class Recorder:
    """Profiles the 2nd and 3rd of `steps` (the first pays one-time costs; a 1-step run: that
    one) into `directory`/rank{rank}.json, with a range per step and per forward of the model,
    its embedding, each block and its head (hooks). Without a `directory` it does nothing."""

    def __init__(self, model, directory: str | None, rank: int, steps: range):
        self.path = Path(directory or ".") / f"rank{rank}.json"
        self.window = (steps[1:3] or steps[:1]) if directory else range(0)
        self.modules = [
            ("model", model),
            ("embedding", model.transformer.wte),
            *((f"block {i}", b) for i, b in enumerate(model.transformer.h)),
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
