"""The one place where strategies are put together into a training step.

Each strategy file (`ddp.py`, `zero.py`, `tp.py`, `pp.py`) explains one idea and knows nothing
of the others. This module composes them for a layout, in a fixed order (torchtitan's):

    pipeline split → tensor parallel → recompute → data parallel / ZeRO (over the dp group)

Every rank first builds the *whole* model from the seed (so the initial weights never depend on
the layout). Then: the pipeline split decides which layers this rank's stage runs; tensor
parallel cuts every layer into this rank's slices (`tp.parallelize_gpt`, run before the stage
keeps its layers, because it swaps the embedding and head modules the stage takes); recompute
is a flag the blocks read; last, data parallel (DDP buckets or a flat all-reduce) or ZeRO 1-2
wraps *what is left*: ranks of one dp group hold the same slices of the same stage, so each
slice's gradient is averaged (or reduce-scattered) with exactly its replicas.

Which engine runs a layout:

    --pp > 1                   PipelineEngine: stages (TP-cut when --tp > 1), dp sync by a
                               flat all-reduce (--zero 0) or ZeRO 1/2; ZeRO-3 is refused
    --zero 1-3                 ZeroEngine (TP-cut first when --tp > 1)
    --tp > 1                   TensorParallelEngine: TP, then DDP buckets over mesh.dp
    otherwise                  DataParallelEngine (also one process)

and returns an `Engine`: an object whose `train_step(x, y)` runs one optimizer step on this
rank's share of the global batch and returns the global batch's mean loss.

What every engine does in one step, whatever the layout:

    for each microbatch:  forward, loss / microbatches, backward   (gradients accumulate)
    synchronise gradients across the data-parallel group
    clip by global norm (if asked), optimizer step, zero the gradients

Every engine also has a collective pair for unified checkpoints (hplab/checkpoint.py):
`full_state()` gathers the single-device view (hplab names, full fp32 tensors, and each
parameter's optimizer state) from whatever slices / stages / shards the ranks hold, and
`load_full_state(...)` lets each rank of *any* layout cut out what it holds.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hplab.dist import Mesh
from hplab.memory import MemoryLedger, optimizer_state_tensors


class NotAvailableYet(ValueError):
    """A combination of flags that hplab refuses, with the reason."""


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


def is_tp_split(p: torch.Tensor) -> bool:
    """A tensor-parallel slice of a bigger parameter (tp.py marks them)."""
    return getattr(p, "tp_split", None) is not None


def global_grad_norm(pieces, mesh: Mesh, replicated_over_dp: bool, skip=None) -> float:
    """The L2 norm of the whole model's gradient, from the (parameter, gradient piece) pairs
    this rank holds. Every element must be counted exactly once over all ranks, so a piece
    counts here unless another rank holds the same numbers: a parameter replicated over the
    tp group counts on tp rank 0 only, a DDP replica on dp rank 0 only, `skip` (the LM head's
    copy of the tied embedding) not at all. ZeRO shards and TP slices are disjoint: all count.
    One all-reduce over the world sums the squares."""
    squares = 0.0
    if not replicated_over_dp or mesh.dp_rank == 0:
        for p, g in pieces:
            if g is None or p is skip or (mesh.tp_rank != 0 and not is_tp_split(p)):
                continue
            squares += float(g.float().pow(2).sum())
    return mesh.world.all_reduce_scalar(squares) ** 0.5


def scale_to_norm(grads, norm: float, max_norm: float) -> None:
    if norm > max_norm:
        for g in grads:
            if g is not None:
                g.mul_(max_norm / (norm + 1e-6))


@torch.no_grad()
def whole(p: torch.Tensor, piece: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The full tensor, on the CPU, of this rank's `piece` of parameter `p` (or of one of its
    optimizer-state tensors, which have the parameter's shape): glued back over the tp group
    when `p` is a tensor-parallel slice (a collective: every tp rank calls it)."""
    if is_tp_split(p):
        from hplab import tp

        return tp.unshard(piece.to(mesh.device), p.tp_split, mesh.tp).cpu()
    return piece.detach().cpu().clone()


@torch.no_grad()
def mine(p: torch.Tensor, full: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's piece of a full tensor for parameter `p` (its tp slice, or all of it)."""
    if is_tp_split(p):
        from hplab import tp

        return tp.shard(full.to(mesh.device), p.tp_split, mesh.tp)
    return full.clone()


@torch.no_grad()
def load_pairs(pairs, names: dict, model_state: dict, optimizer_state: dict, optimizer,
               mesh: Mesh) -> None:
    """Load full single-device tensors into (model parameter p, optimized parameter q) pairs —
    q is p's fp32 master copy in mixed precision, p itself otherwise: each gets this rank's
    piece of its value, and q the pieces of its optimizer state."""
    for p, q in pairs:
        name = names[id(p)]
        piece = mine(p, model_state[name].float(), mesh)
        p.copy_(piece)
        if q is not p:
            q.copy_(piece)
        if optimizer_state.get(name):
            optimizer.state[q] = {k: mine(p, t, mesh).to(q.device) if t.dim() else t.clone()
                                  for k, t in optimizer_state[name].items()}


def glue_state(params, names: dict, values: dict, states: dict, mesh: Mesh):
    """(model_state, optimizer_state) by single-device name from this rank's pieces: `values`
    and `states` map each parameter to its (dp-gathered) value and optimizer-state tensors,
    glued back over tp here. `params` in an order every rank shares (tp collectives match)."""
    model_state = {names[id(p)]: whole(p, values[p], mesh) for p in params}
    optimizer_state = {names[id(p)]: {k: whole(p, t, mesh) if t.dim() else t.clone()
                                      for k, t in states[p].items()} for p in params}
    return model_state, optimizer_state


def load_zero(zero, names: dict, model_state: dict, optimizer_state: dict, mesh: Mesh) -> None:
    """Give a ZeRO instance this rank's tp pieces of every full tensor; it keeps its shards."""
    values, states = {}, {}
    for p in zero.unit_of:
        name = names[id(p)]
        values[p] = mine(p, model_state[name].float(), mesh).cpu()
        states[p] = {k: mine(p, t, mesh).cpu() if t.dim() else t
                     for k, t in optimizer_state.get(name, {}).items()}
    zero.load_full_state(values, states)


def optimizer_state_of(optimizer, param) -> dict[str, torch.Tensor]:
    return dict(optimizer.state.get(param, {}))


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

    def param_names(self) -> dict[int, str]:
        """id(parameter) → its single-device name (a tied parameter: its first name)."""
        return {id(p): name for name, p in self.model.named_parameters()}

    def full_state(self) -> tuple[dict, dict]:
        """(model_state, optimizer_state): every parameter's full fp32 value and full optimizer
        state tensors under its single-device name, gathered from this layout's pieces. A
        collective (every rank calls it); the result is complete on rank 0."""
        raise NotImplementedError

    def load_full_state(self, model_state: dict, optimizer_state: dict) -> None:
        """The reverse: every rank gets the full dicts and keeps the pieces it holds."""
        raise NotImplementedError

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
        self.after_gradient_sync(params)
        grads = self.master.take_grads(params, 1 / self.precision.loss_scale) if self.master \
            else [p.grad for p in params]
        # fp16: skip the step, shrink the scale (every rank that holds other grads must agree)
        overflow = self.precision.found_overflow(grads, self.overflow_comm)
        if not overflow:
            if self.args.grad_clip > 0:
                self.clip_gradients(params, grads)
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

    # The three points where a layout inside data parallel (tensor parallel) differs:
    overflow_comm = None  # every dp rank sees the same averaged gradients

    def after_gradient_sync(self, params) -> None:
        """Gradients are complete after the dp all-reduce: nothing more to synchronise."""

    def clip_gradients(self, params, grads) -> None:
        clip_grad_norm(grads, self.args.grad_clip)

    def memory_tensors(self):
        held = self.ddp.memory_tensors()
        return {**held, "optim": optimizer_state_tensors(self.optimizer),
                "master": self.master.params if self.master else []}

    def optimized_pairs(self):
        """(model parameter, the tensor the optimizer steps for it: itself or its fp32 master)."""
        return list(zip(self.ddp.params, self.master.params if self.master else self.ddp.params))

    def full_state(self):
        pairs = list(self.optimized_pairs())  # same order on every rank: tp collectives match
        return glue_state([p for p, _ in pairs], self.param_names(),
                          {p: q.detach().float() for p, q in pairs},
                          {p: optimizer_state_of(self.optimizer, q) for p, q in pairs}, self.mesh)

    @torch.no_grad()
    def load_full_state(self, model_state, optimizer_state):
        load_pairs(self.optimized_pairs(), self.param_names(), model_state, optimizer_state,
                   self.optimizer, self.mesh)


# --- ZeRO (zero.py): a ZeroEngine goes here -------------------------------------------------

class ZeroEngine(Engine):
    """ZeRO stage 1, 2 or 3 over the dp group (hplab/zero.py), with mixed precision and
    offload; with --tp > 1 the model is cut by tensor parallel first, and ZeRO shards each
    rank's slices over the ranks holding the same slices. One unit per transformer block, the
    rest (embeddings, ln_f, tied head) in the root unit. One step:

        for each microbatch: forward, loss × scale / microbatches, backward
                             (stage 3 gathers each block just in time; stages 2, 3
                             reduce-scatter each block's gradients as backward finishes it)
        shard gradients      fp32, unscaled: this rank's 1/N (stage 1 reduce-scatters here)
        fp16 overflow?       skip the step on every rank and halve the loss scale
        clip                 squares of the shards (and tp slices) summed over the world
        optimizer step       on the master shards (on the CPU with --offload)
        update params        stages 1, 2: all-gather; stage 3: keep the shard
    """

    def __init__(self, model, mesh, args):
        from hplab.precision import MixedPrecision
        from hplab.zero import ZeRO

        super().__init__(model, mesh, args)
        if mesh.tp_size > 1:  # tensor parallel first: ZeRO then shards each rank's slices
            from hplab import tp

            tp.parallelize_gpt(model, mesh.tp)
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
        overflow = self.precision.found_overflow(grads, self.mesh.world)  # shards and slices
        if not overflow:
            if self.args.grad_clip > 0:  # shards over dp, slices over tp: count each once
                norm = global_grad_norm(self.zero.grad_pieces(), self.mesh,
                                        replicated_over_dp=False)
                scale_to_norm(grads, norm, self.args.grad_clip)
            self.optimizer.step()
            self.zero.update_params()
        self.precision.update(overflow)
        self.measure_memory()  # after the step: params, grads and optimizer state all exist
        self.zero.zero_grad()
        local = float(torch.stack(losses).mean())
        return self.mesh.dp.all_reduce_scalar(local) / self.mesh.dp_size

    def memory_tensors(self):
        return self.zero.memory_tensors()

    def full_state(self):
        values, states = self.zero.full_state()  # gathered over dp, still tp slices
        return glue_state(list(self.zero.unit_of), self.param_names(), values, states,
                          self.mesh)  # unit order: the same on every rank

    def load_full_state(self, model_state, optimizer_state):
        load_zero(self.zero, self.param_names(), model_state, optimizer_state, self.mesh)



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
        self.tp = tp
        tp.parallelize_gpt(model, mesh.tp, sequence_parallel=args.sequence_parallel)
        super().__init__(model, mesh, args)  # data parallel over mesh.dp, AdamW on the slices

    @property
    def overflow_comm(self):
        return self.mesh.tp  # each tp rank holds other slices

    def after_gradient_sync(self, params) -> None:
        if self.args.sequence_parallel:  # replicated parameters saw only s/T of the tokens
            self.tp.sync_sequence_parallel_grads(params, self.mesh.tp)

    def clip_gradients(self, params, grads) -> None:
        """Slices summed over mesh.tp, replicated parameters counted once."""
        norm = self.tp.grad_norm_squared(params, grads, self.mesh.tp) ** 0.5
        if norm > self.args.grad_clip:
            for g in grads:
                g.mul_(self.args.grad_clip / (norm + 1e-6))


# --- pipeline parallel (pp.py): a PipelineEngine goes here ------------------------------------

def check_pipeline(args, n_layer: int) -> None:
    """The pipeline checks that need no process: a schedule that can run p stages with these
    microbatches and virtual stages, and at least one layer per model chunk (PipelineError)."""
    if args.pp > 1:
        from hplab import pp

        pp.build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
        pp.split_layers(n_layer, args.pp * args.virtual_stages)


class PipelineEngine(Engine):
    """Pipeline parallel over mesh.pp (hplab/pp.py), composed with tensor parallel inside each
    stage and data parallel or ZeRO 1-2 over mesh.dp — the whole dp × tp × pp × zero layout.

    Built in the fixed order: the whole model from the seed → tensor parallel cuts every layer
    (mesh.tp) → the stage keeps its layers and frees the rest → recompute (a flag) → data
    parallel over mesh.dp: ranks of one dp group hold the same slices of the same stage.

    One step:

        pipeline schedule      this rank's action list: F, B (W) of its chunks, p2p messages;
                               TP collectives inside every layer; ZeRO-2 reduce-scatters
                               each block's gradients as soon as its B is done
        tied embedding         the first stage's wte and the last stage's LM head are one
                               weight: their gradients are summed between the two ranks
        data parallel          --zero 0: one all-reduce of the stage's flat gradients;
                               ZeRO 1: reduce-scatter now; ZeRO 2: wait for the last ones
        fp16 overflow?         checked over the world: every rank skips together
        clip                   global norm: squares summed over the world, each element once
        optimizer step         on the stage's parameters / fp32 masters / ZeRO shards
    """

    def __init__(self, model, mesh, args):
        from hplab import pp
        from hplab.precision import MasterWeights, MixedPrecision

        super().__init__(model, mesh, args)
        self.pp = pp
        p, v, m = mesh.pp_size, args.virtual_stages, args.microbatches
        self.plans = pp.build_schedule(args.schedule, p, m, v)  # checks p, m, v
        if mesh.tp_size > 1:
            from hplab import tp

            tp.parallelize_gpt(model, mesh.tp)
        self.stages = pp.build_stages(model, mesh.pp_rank, p, v)  # checks layers ≥ chunks
        pp.free_unowned_parameters(model, self.stages)
        self.params = pp.stage_parameters(self.stages)
        self.is_first = any(s.is_first for s in self.stages)
        ends = [s.wte for s in self.stages if s.is_first] + \
               [s.lm_head for s in self.stages if s.is_last]
        self.tied_module = ends[0] if ends else None  # this rank's copy of the tied weight
        self.tied = self.tied_module.weight if ends else None
        self.tied_comm = pp.tied_embedding_group(mesh)
        self.precision = MixedPrecision(args.precision)
        self.master = self.zero = None
        make = lambda params: make_optimizer(params, args.lr, args.weight_decay)  # noqa: E731
        if args.zero:
            from hplab.zero import ZeRO

            # The tied weight gets a unit of its own: same flat layout on the first and the
            # last stage, so its gradient shards can be summed between the two.
            units = [self.tied_module] * (self.tied is not None) + \
                [block for s in self.stages for block in s.blocks]
            self.zero = ZeRO(torch.nn.ModuleList(self.stages), mesh.dp, args.zero, make,
                             layers=units, param_dtype=self.precision.param_dtype,
                             offload=args.offload)
            self.optimizer = self.zero.optimizer
        else:
            with torch.no_grad():  # every dp replica starts from dp rank 0's weights
                for t in self.params:
                    mesh.dp.broadcast(t, src=0)
            self.master = MasterWeights(self.params) if self.precision.mixed else None
            model.to(self.precision.param_dtype)
            self.optimizer = make(self.master.params if self.master else self.params)
        self.executor = pp.PipelineExecutor(self.stages, self.plans[mesh.pp_rank], mesh.pp,
                                            memory=self.memory,
                                            dtype=self.precision.param_dtype)
        self.step_start = 0.0

    def train_step(self, x, y) -> float:
        import time

        m = self.args.microbatches
        if x.shape[0] % m:
            raise self.pp.PipelineError(
                f"this rank's batch of {x.shape[0]} sequences does not split into "
                f"--microbatches {m}: use a batch size that is a multiple of dp × microbatches")
        self.step_start = time.perf_counter()
        self.executor.loss_scale = self.precision.loss_scale
        losses = self.executor.run(list(x.chunk(m)), list(y.chunk(m)))
        unscale = 1 / self.precision.loss_scale
        if self.zero:
            self.zero.backward_done()  # ZeRO-2: the last reduce-scatters
            self._sum_tied_gradient()
            grads = self.zero.shard_gradients(unscale)
            pieces = lambda: self.zero.grad_pieces()  # noqa: E731
        else:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._sum_tied_gradient()
            self._all_reduce_over_dp([p.grad for p in self.params])
            grads = self.master.take_grads(self.params, unscale) if self.master \
                else [p.grad for p in self.params]
            pieces = lambda: zip(self.params, grads)  # noqa: E731
        overflow = self.precision.found_overflow(grads, self.mesh.world)
        if not overflow:
            if self.args.grad_clip > 0:  # the LM head's copy of the tied weight counts once
                norm = global_grad_norm(pieces(), self.mesh, replicated_over_dp=not self.zero,
                                        skip=None if self.is_first else self.tied)
                scale_to_norm(grads, norm, self.args.grad_clip)
            self.optimizer.step()
            if self.zero:
                self.zero.update_params()
            elif self.master:
                self.master.copy_to(self.params)
        self.precision.update(overflow)
        self.measure_memory()
        if self.zero:
            self.zero.zero_grad()
        else:
            for p in self.params:
                p.grad = None
            if self.master:
                self.master.zero_grad()
        loss = self.mesh.pp.all_reduce_scalar(sum(losses)) / m  # only the last stage has them
        return self.mesh.dp.all_reduce_scalar(loss) / self.mesh.dp_size

    @torch.no_grad()
    def _sum_tied_gradient(self) -> None:
        """Embedding (first stage) and LM head (last stage) are one weight split over two
        ranks: sum their gradients so both copies take the same step (Megatron's embedding
        group). Under ZeRO-2 the gradient already lives in its unit's shard; the unit has the
        same layout on both ends, so the shards are summed."""
        if self.tied_comm is None or self.tied is None:
            return
        if self.zero and self.zero.stage >= 2:
            self.tied_comm.all_reduce(self.zero.unit_of[self.tied].grad_shard)
        else:
            self.tied_comm.all_reduce(self.tied.grad)

    @torch.no_grad()
    def _all_reduce_over_dp(self, grads: list[torch.Tensor]) -> None:
        """Average the stage's gradients over mesh.dp with one all-reduce of a flat buffer (no
        overlap with the schedule: simple, and the trace stays pure pipeline)."""
        if self.mesh.dp_size == 1:
            return
        flat = torch.cat([g.flatten() for g in grads])
        self.mesh.dp.all_reduce(flat)
        flat /= self.mesh.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def memory_tensors(self):
        if self.zero:
            return self.zero.memory_tensors()
        return {"params": self.params, "grads": [p.grad for p in self.params],
                "optim": optimizer_state_tensors(self.optimizer),
                "master": self.master.params if self.master else []}

    def _local_state(self):
        """This rank's stage, glued back over tp (and dp-ZeRO shards): {name: ...} pairs."""
        names = self.param_names()
        if self.zero:
            values, states = self.zero.full_state()
            order = list(self.zero.unit_of)
        else:
            optimized = self.master.params if self.master else self.params
            values = {p: q.detach().float() for p, q in zip(self.params, optimized)}
            states = {p: optimizer_state_of(self.optimizer, q)
                      for p, q in zip(self.params, optimized)}
            order = self.params
        return glue_state(order, names, values, states, self.mesh)

    def full_state(self):
        """Each stage's state (tp and ZeRO pieces glued together first), sent to rank 0 by
        the (dp 0, tp 0) rank of every stage."""
        local = self._local_state()
        if self.mesh.dp_rank or self.mesh.tp_rank:
            local = ({}, {})
        everyone = [None] * dist.get_world_size() if self.mesh.rank == 0 else None
        dist.gather_object(local, everyone, dst=0)  # in memory, between our own processes
        if self.mesh.rank != 0:
            return {}, {}
        model_state, optimizer_state = {}, {}
        for stage_model, stage_optimizer in everyone:
            model_state.update(stage_model)
            optimizer_state.update(stage_optimizer)
        return model_state, optimizer_state

    @torch.no_grad()
    def load_full_state(self, model_state, optimizer_state):
        names = self.param_names()
        if self.zero:
            load_zero(self.zero, names, model_state, optimizer_state, self.mesh)
            return
        optimized = self.master.params if self.master else self.params
        load_pairs(zip(self.params, optimized), names, model_state, optimizer_state,
                   self.optimizer, self.mesh)

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
    """Combinations hplab refuses get one line with the reason, instead of a wrong run."""
    refused = {
        "--zero 3 with --pp: ZeRO-3 would gather every layer again for every microbatch's "
        "forward and backward (DeepSpeed and Colossal-AI refuse it too); use --zero 1 or 2":
            args.zero == 3 and args.pp > 1,
        "--sequence-parallel with --pp or --zero: sequence parallel runs with --tp and --dp "
        "only": args.sequence_parallel and (args.pp > 1 or args.zero > 0),
        "--zero 2 with --schedule zb-h1: ZeRO-2 sends each layer's gradients when backward "
        "finishes them, and ZB-H1 defers weight gradients; use --zero 1":
            args.zero == 2 and args.pp > 1 and args.schedule == "zb-h1",
    }
    reasons = [reason for reason, asked in refused.items() if asked]
    if reasons:
        raise NotAvailableYet("not supported: " + "; ".join(reasons))
    if args.offload and args.zero == 0:
        raise ValueError("--offload moves ZeRO's sharded optimizer state to the CPU: use it "
                         "with --zero 1, 2 or 3")


def build_engine(model: torch.nn.Module, mesh: Mesh, args) -> Engine:
    """Compose the layout `args` asks for around `model` (already on this rank's device)."""
    refuse_unavailable(args)
    model.recompute = args.recompute
    if args.pp > 1:
        return PipelineEngine(model, mesh, args)
    if args.zero > 0:
        return ZeroEngine(model, mesh, args)
    if args.tp > 1 or args.sequence_parallel:
        return TensorParallelEngine(model, mesh, args)
    return DataParallelEngine(model, mesh, args)
