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
    """Data parallel over the mesh's dp group (also correct for dp = 1: one process).

    With --precision bf16/fp16 the model (and so the DDP buckets) is in half precision, and
    the optimizer steps fp32 master copies (hplab/precision.py)."""

    def __init__(self, model, mesh, args):
        from hplab.ddp import DataParallel
        from hplab.precision import MasterWeights, MixedPrecision

        super().__init__(model, mesh, args)
        self.precision = MixedPrecision(args.precision)
        # fp32 masters copied before the cast, so no precision is lost (None in fp32)
        self.master = MasterWeights(model.parameters()) if self.precision.mixed else None
        model.to(self.precision.param_dtype)
        self.ddp = DataParallel(model, mesh.dp, bucket_bytes=args.bucket_mb * 2**20)
        self.optimizer = make_optimizer(self.master.params if self.master else self.ddp.params,
                                        args.lr, args.weight_decay)

    def train_step(self, x, y) -> float:
        microbatches = list(zip(x.chunk(self.args.microbatches), y.chunk(self.args.microbatches)))
        losses = []
        for i, (xm, ym) in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with self.ddp.no_sync() if not last else contextlib.nullcontext():
                losses.append(self.forward_backward(self.ddp, xm, ym,
                                                    self.precision.loss_scale / len(microbatches)))
        self.ddp.finish_gradient_sync()
        params = self.ddp.params
        grads = self.master.take_grads(params, 1 / self.precision.loss_scale) if self.master \
            else [p.grad for p in params]
        overflow = self.precision.found_overflow(grads)  # fp16: skip the step, shrink the scale
        if not overflow:
            if self.args.grad_clip > 0:
                clip_grad_norm(grads, self.args.grad_clip)
            self.optimizer.step()
            if self.master:
                self.master.copy_to(params)
        self.precision.update(overflow)
        self.measure_memory()  # after the step: params, grads and optimizer state all exist
        self.ddp.zero_grad()
        if self.master:
            self.master.zero_grad()
        local = float(torch.stack(losses).mean())
        return self.mesh.dp.all_reduce_scalar(local) / self.mesh.dp_size

    def memory_tensors(self):
        held = self.ddp.memory_tensors()
        return {**held, "optim": optimizer_state_tensors(self.optimizer),
                "master": self.master.params if self.master else []}


# --- ZeRO (zero.py): a ZeroEngine goes here -------------------------------------------------

class ZeroEngine(Engine):
    """ZeRO stage 1, 2 or 3 over the dp group (hplab/zero.py), with mixed precision and
    offload. One unit per transformer block, the rest (embeddings, ln_f, tied head) in the
    root unit. One step:

        for each microbatch: forward, loss × scale / microbatches, backward
                             (stage 3 gathers each block just in time; stages 2, 3
                             reduce-scatter each block's gradients as backward finishes it)
        shard gradients      fp32, unscaled: this rank's 1/N (stage 1 reduce-scatters here)
        fp16 overflow?       skip the step on every rank and halve the loss scale
        clip                 squares of the shards summed over the dp group
        optimizer step       on the master shards (on the CPU with --offload)
        update params        stages 1, 2: all-gather; stage 3: keep the shard
    """

    def __init__(self, model, mesh, args):
        from hplab.precision import MixedPrecision
        from hplab.zero import ZeRO

        super().__init__(model, mesh, args)
        self.precision = MixedPrecision(args.precision)
        blocks = list(getattr(getattr(model, "transformer", None), "h", []))
        self.zero = ZeRO(model, mesh.dp, args.zero,
                         lambda params: make_optimizer(params, args.lr, args.weight_decay),
                         layers=blocks, param_dtype=self.precision.param_dtype,
                         offload=args.offload)
        self.optimizer = self.zero.optimizer

    def train_step(self, x, y) -> float:
        m = self.args.microbatches
        losses = []
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            losses.append(self.forward_backward(self.model, xm, ym,
                                                self.precision.loss_scale / m))
            self.zero.backward_done()
        grads = self.zero.shard_gradients(unscale=1 / self.precision.loss_scale)
        overflow = self.precision.found_overflow(grads, self.mesh.dp)
        if not overflow:
            if self.args.grad_clip > 0:
                clip_grad_norm(grads, self.args.grad_clip, self.mesh.dp)
            self.optimizer.step()
            self.zero.update_params()
        self.precision.update(overflow)
        self.measure_memory()  # after the step: params, grads and optimizer state all exist
        self.zero.zero_grad()
        local = float(torch.stack(losses).mean())
        return self.mesh.dp.all_reduce_scalar(local) / self.mesh.dp_size

    def memory_tensors(self):
        return self.zero.memory_tensors()



# --- tensor parallel (tp.py): a TensorParallelEngine goes here --------------------------------

class TensorParallelEngine(DataParallelEngine):
    """Tensor parallel inside each tp group, then data parallel across the groups (tp × dp).

    Order matters: the model is cut first, so each rank holds its slices; data parallel then
    wraps the *sliced* model and averages each slice's gradient with the ranks that hold the
    same slice (mesh.dp: same tp rank, other batch shard). One step:

        forward / backward           tp collectives inside every layer (tp.py)
        data-parallel gradient sync  DDP buckets over mesh.dp
        sequence-parallel grads      replicated parameters summed over mesh.tp
        clip by global norm          slices summed over mesh.tp, replicated ones counted once
        AdamW on this rank's slices
    """

    def __init__(self, model, mesh, args):
        from hplab import tp

        if mesh.tp_size == 1:
            raise ValueError("--sequence-parallel splits the sequence over the tensor-parallel "
                             "group: use it with --tp 2 or more")
        if args.zero > 0 or getattr(args, "offload", False):
            raise NotAvailableYet("--zero / --offload together with --tp is not available yet: "
                                  "use --zero 0 with --tp, or --tp 1 with --zero")
        self.tp = tp
        tp.parallelize_gpt(model, mesh.tp, sequence_parallel=args.sequence_parallel)
        super().__init__(model, mesh, args)  # data parallel over mesh.dp, AdamW on the slices

    def train_step(self, x, y) -> float:
        microbatches = list(zip(x.chunk(self.args.microbatches), y.chunk(self.args.microbatches)))
        losses = []
        for i, (xm, ym) in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with self.ddp.no_sync() if not last else contextlib.nullcontext():
                losses.append(self.forward_backward(self.ddp, xm, ym,
                                                    self.precision.loss_scale / len(microbatches)))
        self.ddp.finish_gradient_sync()
        params = self.ddp.params
        if self.args.sequence_parallel:
            self.tp.sync_sequence_parallel_grads(params, self.mesh.tp)
        grads = self.master.take_grads(params, 1 / self.precision.loss_scale) if self.master \
            else [p.grad for p in params]
        overflow = self.precision.found_overflow(grads, self.mesh.tp)  # slices differ per rank
        if not overflow:
            if self.args.grad_clip > 0:
                norm = self.tp.grad_norm_squared(params, grads, self.mesh.tp) ** 0.5
                if norm > self.args.grad_clip:
                    for g in grads:
                        g.mul_(self.args.grad_clip / (norm + 1e-6))
            self.optimizer.step()
            if self.master:
                self.master.copy_to(params)
        self.precision.update(overflow)
        self.measure_memory()
        self.ddp.zero_grad()
        if self.master:
            self.master.zero_grad()
        local = float(torch.stack(losses).mean())  # the same on every rank of the tp group
        return self.mesh.dp.all_reduce_scalar(local) / self.mesh.dp_size


# --- pipeline parallel (pp.py): a PipelineEngine goes here ------------------------------------

def check_pipeline(args, n_layer: int) -> None:
    """The pipeline checks that need no process: a schedule that can run p stages with these
    microbatches and virtual stages, and at least one layer per model chunk (PipelineError)."""
    if args.pp > 1:
        from hplab import pp

        pp.build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
        pp.split_layers(n_layer, args.pp * args.virtual_stages)


class PipelineEngine(Engine):
    """Pipeline parallel over mesh.pp (hplab/pp.py), with data parallel over mesh.dp.

    One step: this rank runs its action list of the schedule (forwards, backwards and the
    point-to-point messages of its chunks); the tied embedding / LM-head gradient is summed
    between the first and last stage; then the stage's gradients are averaged over the dp
    group with one plain all-reduce of a flat buffer (no overlap with the schedule: simple,
    and the schedule's trace stays pure pipeline); clip by the global norm (squares summed
    over the stages), optimizer step on the stage's own parameters.
    """

    def __init__(self, model, mesh, args):
        from hplab import pp

        super().__init__(model, mesh, args)
        self.pp = pp
        p, v, m = mesh.pp_size, args.virtual_stages, args.microbatches
        self.plans = pp.build_schedule(args.schedule, p, m, v)  # checks p, m, v
        self.stages = pp.build_stages(model, mesh.pp_rank, p, v)  # checks layers ≥ chunks
        pp.free_unowned_parameters(model, self.stages)
        self.params = pp.stage_parameters(self.stages)
        self.tied_comm = pp.tied_embedding_group(mesh)
        self.executor = pp.PipelineExecutor(self.stages, self.plans[mesh.pp_rank], mesh.pp,
                                            memory=self.memory)
        with torch.no_grad():  # data parallel: every replica starts from dp rank 0's weights
            for t in self.params:
                mesh.dp.broadcast(t, src=0)
        self.optimizer = make_optimizer(self.params, args.lr, args.weight_decay)
        self.step_start = 0.0

    def train_step(self, x, y) -> float:
        import time

        m = self.args.microbatches
        if x.shape[0] % m:
            raise self.pp.PipelineError(
                f"this rank's batch of {x.shape[0]} sequences does not split into "
                f"--microbatches {m}: use a batch size that is a multiple of dp × microbatches")
        self.step_start = time.perf_counter()
        losses = self.executor.run(list(x.chunk(m)), list(y.chunk(m)))
        self.pp.sync_tied_gradients(self.stages, self.tied_comm)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.mesh.dp_size > 1:
            flat = torch.cat([p.grad.flatten() for p in self.params])
            self.mesh.dp.all_reduce(flat)
            flat /= self.mesh.dp_size
            offset = 0
            for p in self.params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if self.args.grad_clip > 0:  # the norm counts the tied weight once; scale every copy
            norm = clip_grad_norm(self._unique_grads(), 0.0, self.mesh.pp)
            if norm > self.args.grad_clip:
                for p in self.params:
                    p.grad.mul_(self.args.grad_clip / (norm + 1e-6))
        self.optimizer.step()
        self.measure_memory()
        for p in self.params:
            p.grad = None
        loss = self.mesh.pp.all_reduce_scalar(sum(losses)) / m  # only the last stage has them
        return self.mesh.dp.all_reduce_scalar(loss) / self.mesh.dp_size

    def _unique_grads(self):
        """Gradients for the global norm: the tied weight counts once (on the first stage)."""
        first_stage = any(s.is_first for s in self.stages)
        tied = None if first_stage else next((s.lm_head.weight for s in self.stages
                                              if s.is_last), None)
        return [p.grad for p in self.params if p is not tied]

    def memory_tensors(self):
        return {"params": self.params, "grads": [p.grad for p in self.params],
                "optim": optimizer_state_tensors(self.optimizer), "master": []}

    def pipeline_report(self) -> dict:
        """This rank's trace of the last step and what it held, for the metrics file. Times
        are seconds from the earliest stage's step start (one clock: ranks on one machine)."""
        import torch.distributed as dist

        origin = self.mesh.pp.all_reduce_scalar(self.step_start, op=dist.ReduceOp.MIN)
        shift = self.step_start - origin
        trace = [{**e.as_dict(), "start_s": e.start_s + shift, "end_s": e.end_s + shift}
                 for e in self.executor.trace]
        end = max((e["end_s"] for e in trace if e["kind"] in self.pp.COMPUTE), default=0.0)
        end = self.mesh.pp.all_reduce_scalar(end, op=dist.ReduceOp.MAX)
        return {"trace": trace, "in_flight_max": self.executor.in_flight_max,
                "activation_bytes_in_flight_max": self.executor.activation_bytes_in_flight_max,
                "bubble_fraction": self.pp.measured_bubble(trace, 0.0, end)}


def refuse_unavailable(args) -> None:
    """Flags of strategies not built yet get one clear line instead of a wrong run."""
    wanted = {
        "--save / --resume (unified checkpoints)": bool(args.save or args.resume),
        "--zero with --pp": args.zero > 0 and args.pp > 1,
        "--tp / --sequence-parallel with --pp": args.pp > 1 and (
            args.tp > 1 or args.sequence_parallel),
        f"--precision {args.precision} with --pp": args.precision != "fp32" and args.pp > 1,
    }
    missing = [name for name, asked in wanted.items() if asked]
    if missing:
        raise NotAvailableYet(f"not available yet: {', '.join(missing)} — each strategy runs "
                              "on its own and with --dp; these combinations are not built yet")


def build_engine(model: torch.nn.Module, mesh: Mesh, args) -> Engine:
    """Compose the layout `args` asks for around `model` (already on this rank's device)."""
    refuse_unavailable(args)
    model.recompute = args.recompute
    if args.pp > 1:
        return PipelineEngine(model, mesh, args)
    if args.tp > 1 or args.sequence_parallel:
        return TensorParallelEngine(model, mesh, args)
    if args.zero > 0:
        return ZeroEngine(model, mesh, args)
    if args.offload:
        raise ValueError("--offload moves ZeRO's sharded optimizer state to the CPU: use it "
                         "with --zero 1, 2 or 3")
    return DataParallelEngine(model, mesh, args)
