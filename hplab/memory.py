"""Where a rank's memory goes, measured from the tensors it really holds.

Training memory has five kinds, and every parallel strategy is a way of moving some of them
off a device:

    params       the weights the forward pass uses (fp32, or bf16/fp16 copies)
    grads        their gradients
    optim        optimizer state (Adam: exp_avg and exp_avg_sq)
    master       fp32 master weights kept beside low-precision params (mixed precision)
    activation   tensors the forward pass saves for backward (layer inputs, attention, ...)

`MemoryLedger` counts **storages**, not tensors: two views of one buffer (a gradient that lives
in a DDP bucket, a ZeRO shard of a flat parameter, the tied embedding and LM head) are counted
once, at the size of the buffer actually allocated. A storage freed to zero bytes (ZeRO-3
between layers) counts zero. Nothing here is a formula: the formulas live in `hplab.formulas`
and `hplab.plan`, and the labs put both side by side.

Activations are what autograd saves for backward inside `track_activations()` (a saved-tensor
hook sees each one), parameters excluded: a weight saved for backward is not an activation.
0-dim optimizer counters (Adam's `step`) are bookkeeping of a few bytes and are not counted.

Peak: on CUDA, the caching allocator's `max_memory_allocated`. The CPU allocator keeps no such
statistics, so on CPU `peak_bytes` is the largest tally this ledger saw (model state plus the
activations of the forward pass in flight) and `peak_rss_bytes` the process's resident-set
peak, which also includes PyTorch itself.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from typing import Iterable

import torch

KINDS = ("params", "grads", "optim", "master")


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries skipped). Storages in
    `seen` are skipped and the new ones added, so a buffer is counted under one kind only."""
    seen = set() if seen is None else seen
    keys = {_storage_key(t) for t in tensors if t is not None}
    new = {key for key in keys - seen if key[2] != 0}  # not freed, not already counted
    seen |= new
    return sum(key[3] for key in new)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The per-parameter state tensors of a torch optimizer (exp_avg, exp_avg_sq, ...)."""
    states = optimizer.state.values() if optimizer is not None else ()
    return [v for state in states for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


def model_state_tensors(model: torch.nn.Module, optimizer=None) -> dict[str, list]:
    """What a plain (unsharded, fp32) rank holds: the model's parameters and grads, and the
    optimizer's state. Strategies that hold other things provide their own dict."""
    params = list(model.parameters())
    return {"params": params, "grads": [p.grad for p in params],
            "optim": optimizer_state_tensors(optimizer), "master": []}


def peak_rss_bytes() -> int:
    """The process's resident-set peak (what the OS saw, PyTorch runtime included)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class MemoryLedger:
    """One rank's memory by kind. Call `measure(state)` with a dict of kind → tensors (what
    `model_state_tensors` or a strategy's `memory_tensors()` returns), wrap forward passes in
    `track_activations()`, and read `as_dict()`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes = {kind: 0 for kind in KINDS}
        self.activation_bytes = 0  # saved for backward by the largest forward pass seen
        self.activations_in_flight = 0  # bytes saved and not yet released, right now
        self.peak_tally = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def model_state_bytes(self) -> int:
        return sum(self.bytes.values())

    def measure(self, state: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
        """Count the storages of each kind (each storage once, in the order of KINDS)."""
        seen: set = set()
        for kind in KINDS:
            self.bytes[kind] = storage_bytes(state.get(kind, ()), seen)
        self.peak_tally = max(self.peak_tally, self.model_state_bytes + self.activations_in_flight)
        return dict(self.bytes)

    @contextlib.contextmanager
    def track_activations(self, exclude: Iterable[torch.Tensor] = ()):
        """Measure the bytes autograd saves for backward inside this block (one forward pass).

        `exclude`: tensors whose storages are not activations (pass the model's parameters).
        The block yields a one-element list that holds the count once the block is over. Each
        distinct storage counts once; the total is kept as `activation_bytes` if it is the
        largest seen, and added to `activations_in_flight` until `release_activations`.

        The hook only keeps a reference: it runs for every saved tensor (dozens per layer; a
        storage look-up there cost a tenth of a small stage's forward + backward), so the
        storages are looked up once, at the end of the block (a parameter ZeRO-3 freed
        after its layer's forward then counts nothing). Holding the tensors until then also
        keeps a freed tensor's memory from being reused in the block under the same address.
        """
        saved: list[torch.Tensor] = []
        counted = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counted
        parameters = {_storage_key(t) for t in exclude}
        counted[0] = storage_bytes(saved, seen=parameters)
        self.activation_bytes = max(self.activation_bytes, counted[0])
        self.activations_in_flight += counted[0]
        self.peak_tally = max(self.peak_tally, self.model_state_bytes + self.activations_in_flight)

    def release_activations(self, nbytes: int | None = None) -> None:
        """Backward has consumed `nbytes` of saved activations (all of them by default)."""
        self.activations_in_flight = 0 if nbytes is None else self.activations_in_flight - nbytes

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak_tally

    def as_dict(self) -> dict[str, int]:
        """The metrics file's `memory` entry for this rank."""
        return {**{f"{kind}_bytes": self.bytes[kind] for kind in KINDS},
                "activation_bytes": self.activation_bytes, "peak_bytes": self.peak_bytes(),
                "peak_rss_bytes": peak_rss_bytes()}
