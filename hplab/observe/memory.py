"""Where a rank's memory goes, measured from the tensors it really holds.

Training memory has five kinds; every parallel strategy moves some of them off a device:

    params       the weights the forward pass uses (fp32, or bf16/fp16 copies)
    grads        their gradients
    optim        optimizer state (Adam: exp_avg and exp_avg_sq)
    master       fp32 master weights kept beside low-precision params (mixed precision)
    activation   tensors the forward pass saves for backward (layer inputs, attention, ...)

`MemoryLedger` counts **storages**, not tensors: views of one buffer (a gradient in a DDP
bucket, a ZeRO shard of a flat parameter, the tied embedding and LM head) count once, at the size
really allocated; a storage freed to zero bytes (ZeRO-3 between layers) counts zero. Activations
are what autograd saves for backward inside `track_activations()`, parameters excluded; Adam's
0-dim `step` is not counted. No formulas here: the labs set `hplab.plan.formulas` beside these.

Offload (`--offload`) keeps the optimizer's side in host memory: `offloaded_bytes` says, of each
kind, how many bytes are there (the storages a strategy lists as `offloaded`; a subset).

Peak: on CUDA, the allocator's `max_memory_allocated`; on CPU, which keeps no such statistics,
the largest tally this ledger saw (model state plus activations in flight), and `peak_rss_bytes`
the process's resident-set peak, PyTorch included.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterable

import torch

from hplab.parallel.ddp import DDP
from hplab.parallel.precision import MasterWeightOptimizer
from hplab.parallel.zero import ZeroOptimizer

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


def held_by(block) -> dict[str, list]:
    """What a building block holds beyond the model's own tensors, by kind, read from outside
    it: DDP its gradient buckets (each `.grad` a view of one); ZeRO-1/2 its flat buckets,
    gradient shards and fp32 master shards (a master that is a view of the params counts once,
    as params); the fp32-master optimizer its masters; any other module its parameters (a
    fully-sharded one's shards), buffers and the full-size parameters fully_shard gathered
    now (0 bytes between uses). A plain optimizer: nothing of its own."""
    if isinstance(block, DDP):
        return {
            "params": list(block.module.parameters()),
            "grads": [b.buffer for b in block.buckets],
        }
    if isinstance(block, ZeroOptimizer):
        buckets = block.buckets
        return {
            "params": [b.flat for b in buckets] + block.frozen,
            "grads": [t for b in buckets for t in (b.grad_shard, b.master.grad)]
            + [p.grad for g in block.param_groups for p in g["params"]],
            "optim": optimizer_state_tensors(block.inner),
            "master": [b.master for b in buckets],
        }
    if isinstance(block, MasterWeightOptimizer):
        return {"master": list(block.masters.values())}
    if isinstance(block, torch.nn.Module):  # (fully-sharded or not)
        params = list(block.parameters())
        units = (m._hplab_fsdp for m in block.modules() if hasattr(m, "_hplab_fsdp"))
        gathered = [e.buffer for unit in units for e in unit.params]
        return {
            "params": params + list(block.buffers()) + gathered,
            "grads": [p.grad for p in params],
        }
    return {}


def model_state_tensors(model: torch.nn.Module, optimizer=None) -> dict[str, list]:
    """What a plain (unsharded, fp32) rank holds; strategies hold more (`held_by`)."""
    params = list(model.parameters())
    return {
        "params": params,
        "grads": [p.grad for p in params],
        "optim": optimizer_state_tensors(optimizer),
        "master": [],
    }


def peak_rss_bytes() -> int:
    """The process's resident-set peak (what the OS saw, PyTorch runtime included)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class MemoryLedger:
    """One rank's memory by kind. Call `measure(state)` with a dict of kind → tensors (what
    `model_state_tensors` or `held_by` returns), wrap forward passes in
    `track_activations()`, and read `as_dict()`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes = dict.fromkeys(KINDS, 0)
        self.offloaded = dict.fromkeys(KINDS, 0)  # of each kind, the bytes in host memory
        self.activation_bytes = 0  # saved for backward by the largest forward pass seen
        self.activations_in_flight = 0  # bytes saved and not yet released, right now
        self.peak_tally = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _note_peak(self) -> None:
        tally = sum(self.bytes.values()) + self.activations_in_flight
        self.peak_tally = max(self.peak_tally, tally)

    def measure(self, state: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
        """Count the storages of each kind (each storage once, in the order of KINDS), and of
        them those that are also in `state["offloaded"]`."""
        seen: set = set()
        host = {_storage_key(t) for t in state.get("offloaded", ()) if t is not None}
        for kind in KINDS:
            before = set(seen)
            self.bytes[kind] = storage_bytes(state.get(kind, ()), seen)
            self.offloaded[kind] = sum(key[3] for key in (seen - before) & host)
        self._note_peak()
        return dict(self.bytes)

    @contextlib.contextmanager
    def track_activations(self, exclude: Iterable[torch.Tensor] = ()):
        """Count the bytes autograd saves for backward inside this block (one forward pass),
        `exclude` (the parameters) not counted. Yields a one-element list, filled when the block
        ends; the count is kept as `activation_bytes` if the largest yet, and in
        `activations_in_flight` until `release_activations`. The hook only keeps references:
        storages are looked up at the end, so a parameter ZeRO-3 freed meanwhile counts nothing
        and no freed address is reused inside the block."""
        saved = []
        counted = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            """Keep a reference; hand autograd the tensor, or for one a node made (it has a
            grad_fn) an alias without one. Each saved tensor keeps this hook, so neither the
            alias nor `saved` (emptied below) may lead back to the graph: a node holding itself
            is a cycle Python cannot collect, and a graph kept for a later backward (the
            pipeline's split backward) would never be freed."""
            saved.append(t)
            return t if t.grad_fn is None else t.detach()

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # unpack: as is
                yield counted
            counted[0] = storage_bytes(saved, seen={_storage_key(t) for t in exclude})
        finally:
            saved.clear()  # (the hook, kept by the graph, keeps this list)
        self.activation_bytes = max(self.activation_bytes, counted[0])
        self.activations_in_flight += counted[0]
        self._note_peak()

    def release_activations(self, nbytes: int | None = None) -> None:
        """Backward has consumed `nbytes` of saved activations (all of them by default)."""
        self.activations_in_flight = 0 if nbytes is None else self.activations_in_flight - nbytes

    def peak_bytes(self) -> int:
        cuda = self.device.type == "cuda"
        return int(torch.cuda.max_memory_allocated(self.device)) if cuda else self.peak_tally

    def as_dict(self) -> dict[str, int]:
        """The metrics file's `memory` entry for this rank."""
        return {
            **{f"{kind}_bytes": self.bytes[kind] for kind in KINDS},
            "activation_bytes": self.activation_bytes,
            "peak_bytes": self.peak_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            "offloaded_bytes": dict(self.offloaded),
        }
