"""The one place where strategies are put together into a training step.

Each strategy file (`ddp.py`, `zero.py`, `tp.py`, `pp.py`) explains one idea and knows nothing
of the others. This module composes them for a layout, in a fixed order (torchtitan's):

    pipeline split → tensor parallel → recompute → data parallel / ZeRO (over the dp group)

and returns an `Engine`: an object whose `train_step(x, y)` runs one optimizer step on this
rank's share of the global batch and returns the global batch's mean loss.

What every engine does in one step, whatever the layout:

    for each microbatch:  forward, loss / microbatches, backward   (gradients accumulate)
    synchronise gradients across the data-parallel group
    clip by global norm (if asked), optimizer step, zero the gradients
"""

from __future__ import annotations

import contextlib

import torch

from hplab.dist import Mesh
from hplab.memory import MemoryLedger, optimizer_state_tensors


class NotAvailableYet(ValueError):
    """A flag whose strategy is not built yet."""


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas, the same in every layout. foreach=False keeps the update
    element-wise identical whether it runs on whole tensors or on flat shards of them."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             foreach=False)


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, comm=None) -> float:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm.

    When each rank holds only part of the gradients (ZeRO shards, tensor-parallel slices), pass
    the communicator over which the squared norms must be summed."""
    squares = sum(float(g.float().pow(2).sum()) for g in grads if g is not None)
    if comm is not None:
        squares = comm.all_reduce_scalar(squares)
    norm = squares ** 0.5
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            if g is not None:
                g.mul_(max_norm / (norm + 1e-6))
    return norm


class Engine:
    """One rank's share of training. Subclasses define how a step's gradients are made and
    synchronised; `memory_tensors()` says what the rank holds, for the MemoryLedger."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, args):
        self.model, self.mesh, self.args = model, mesh, args
        self.memory = MemoryLedger(mesh.device)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    def memory_tensors(self) -> dict[str, list]:
        raise NotImplementedError

    def measure_memory(self) -> dict[str, int]:
        return self.memory.measure(self.memory_tensors())

    def forward_backward(self, model, x, y, scale: float) -> torch.Tensor:
        """Forward (activations measured), loss × scale, backward; returns the unscaled loss."""
        with self.memory.track_activations(exclude=self.model.parameters()):
            _, loss = model(x, y)
        (loss * scale).backward()
        self.memory.release_activations()
        return loss.detach()


class DataParallelEngine(Engine):
    """Data parallel over the mesh's dp group (also correct for dp = 1: one process)."""

    def __init__(self, model, mesh, args):
        from hplab.ddp import DataParallel

        super().__init__(model, mesh, args)
        self.ddp = DataParallel(model, mesh.dp, bucket_bytes=args.bucket_mb * 2**20)
        self.optimizer = make_optimizer(self.ddp.params, args.lr, args.weight_decay)

    def train_step(self, x, y) -> float:
        microbatches = list(zip(x.chunk(self.args.microbatches), y.chunk(self.args.microbatches)))
        losses = []
        for i, (xm, ym) in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with self.ddp.no_sync() if not last else contextlib.nullcontext():
                losses.append(self.forward_backward(self.ddp, xm, ym, 1 / len(microbatches)))
        self.ddp.finish_gradient_sync()
        if self.args.grad_clip > 0:
            clip_grad_norm([p.grad for p in self.ddp.params], self.args.grad_clip)
        self.optimizer.step()
        self.measure_memory()  # after the step: params, grads and optimizer state all exist
        self.ddp.zero_grad()
        local = float(torch.stack(losses).mean())
        return self.mesh.dp.all_reduce_scalar(local) / self.mesh.dp_size

    def memory_tensors(self):
        held = self.ddp.memory_tensors()
        return {**held, "optim": optimizer_state_tensors(self.optimizer), "master": []}


# --- ZeRO (zero.py): a ZeroEngine goes here -------------------------------------------------


# --- tensor parallel (tp.py): a TensorParallelEngine goes here --------------------------------


# --- pipeline parallel (pp.py): a PipelineEngine goes here ------------------------------------


def refuse_unavailable(args) -> None:
    """Flags of strategies not built yet get one clear line instead of a wrong run."""
    wanted = {
        "--zero 1/2/3 (ZeRO)": args.zero > 0,
        "--tp > 1 (tensor parallel)": args.tp > 1,
        "--pp > 1 (pipeline parallel)": args.pp > 1,
        f"--precision {args.precision} (mixed precision)": args.precision != "fp32",
        "--offload": args.offload,
        "--sequence-parallel": args.sequence_parallel,
        "--save / --resume (unified checkpoints)": bool(args.save or args.resume),
        "--config": bool(args.config),
    }
    missing = [name for name, asked in wanted.items() if asked]
    if missing:
        raise NotAvailableYet(f"not available yet: {', '.join(missing)} — this hplab build "
                              "has data parallel (--dp) with --recompute and --microbatches")


def build_engine(model: torch.nn.Module, mesh: Mesh, args) -> Engine:
    """Compose the layout `args` asks for around `model` (already on this rank's device)."""
    refuse_unavailable(args)
    model.recompute = args.recompute
    return DataParallelEngine(model, mesh, args)
