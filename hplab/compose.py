"""The one place where the building blocks are put together, and the one training step.

Each strategy file (`ddp.py`, `zero.py`, `fsdp.py`, `tp.py`, `pp.py`) is a building block used
the way PyTorch's own is, and knows nothing of the others. `parallelize` composes them for a
layout, in a fixed order (torchtitan's):

    pipeline split → tensor parallel → recompute → DDP / ZeroOptimizer / fully_shard (dp group)

Every rank first builds the *whole* model from the seed, so the initial weights never depend on
the layout. The pipeline split decides which layers this rank runs (the rest are freed); tensor
parallel cuts each kept layer into this rank's slices; recompute is a flag the blocks read; last,
data parallel wraps *what is left*: ranks of one dp group hold the same slices of the same
stage, so each slice's gradient is averaged (or reduce-scattered) with exactly its replicas.

One training step, the same for every layout (`train_step`):

    forward + backward of each microbatch   (a pipeline schedule replaces this loop)
    finalize_grads                          every synchronisation after backward, in one place
    fp16: unscale, skip on overflow         every rank agrees
    clip by the global norm                 each element counted once (`clip_grad_norm_`)
    optimizer.step(); optimizer.zero_grad()

What the optimizer steps ("stepped tensors") is the model's parameters, their fp32 masters, or
ZeRO's master shards; either way they sit in `param_groups` that carry `replicated_over`: the
mesh families over which the same numbers live on other ranks (a global norm counts them once).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn

from hplab import fsdp, pp, tp
from hplab.ddp import DDP
from hplab.dist import Mesh
from hplab.memory import MemoryLedger, optimizer_state_tensors
from hplab.precision import MasterWeightOptimizer, MixedPrecision
from hplab.zero import ZeroOptimizer


class NotSupported(ValueError):
    """A combination of settings hplab refuses; `settings` names the config fields involved
    (train.py turns them into the flags the user typed)."""

    def __init__(self, reason: str, settings: tuple[str, ...] = ()):
        super().__init__(reason)
        self.settings = settings


@dataclass
class ParallelConfig:
    """Everything `parallelize` and `train_step` need to know (train.py fills it from flags)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    sequence_parallel: bool = False
    bucket_mb: float = 25.0
    precision: str = "fp32"
    recompute: bool = False
    offload: bool = False
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 0.0

    @classmethod
    def from_namespace(cls, namespace) -> "ParallelConfig":
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})


def check_config(config: ParallelConfig, n_layer: int) -> None:
    """The refusals and pipeline checks that need no process (plain sentences)."""
    c = config
    refusals = [
        (c.zero == 3 and c.pp > 1, ("zero", "pp"), "ZeRO-3 with a pipeline would gather every "
         "layer again for every microbatch's forward and backward (DeepSpeed and Colossal-AI "
         "refuse it too); use ZeRO-1 or 2"),
        (c.sequence_parallel and (c.pp > 1 or c.zero > 0), ("sequence_parallel", "pp", "zero"),
         "sequence parallel runs with tensor and data parallel only (no pipeline, no ZeRO)"),
        (c.sequence_parallel and c.tp == 1, ("sequence_parallel", "tp"), "sequence parallel "
         "splits the sequence over the tensor-parallel group, so it needs 2 or more tp ranks"),
        (c.zero == 2 and c.pp > 1 and c.schedule == "zb-h1", ("zero", "schedule"), "ZeRO-2 "
         "reduce-scatters each layer's gradients as backward finishes them, and ZB-H1 defers "
         "weight gradients; use ZeRO-1"),
        (c.offload and c.zero == 0, ("offload", "zero"), "offload moves ZeRO's sharded "
         "optimizer state to the CPU, so it needs ZeRO 1, 2 or 3"),
    ]
    for refused, settings, reason in refusals:
        if refused:
            raise NotSupported(f"not supported: {reason}", settings)
    if c.pp > 1:
        pp.build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages)
        pp.split_layers(n_layer, c.pp * c.virtual_stages)


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas, the same in every layout. foreach=False keeps the update
    element-wise identical whether it runs on whole tensors or on flat shards of them."""
    return torch.optim.AdamW(params, **adamw_settings(lr, weight_decay))


def adamw_settings(lr: float, weight_decay: float) -> dict:
    return dict(lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, foreach=False)


# --- the composition ----------------------------------------------------------------------

@dataclass
class Parallel:
    """One rank's share of training, as `parallelize` composed it."""

    model: nn.Module  # what runs forward: DDP(gpt), the fully-sharded gpt, or DDP(stages)
    optimizer: torch.optim.Optimizer
    gpt: nn.Module  # the underlying model (single-device parameter names)
    mesh: Mesh
    config: ParallelConfig
    precision: MixedPrecision
    memory: MemoryLedger
    pipeline: "pp.PipelineExecutor | None" = None
    tied_comm: object = None
    step_start: float = 0.0  # when this rank's last pipeline step began (perf_counter)


def parameter_groups(params, tied: nn.Parameter | None = None, is_first: bool = True) -> list:
    """Group parameters by where their copies live: tensor-parallel slices are replicated over
    dp only, everything else over dp and tp; the pipeline's tied embedding gets a group of its
    own (the same flat layout on both ends), replicated over pp on the last stage."""
    groups: dict[tuple, list] = {}
    for p in params:
        if not p.requires_grad:
            continue
        families = ("dp",) if getattr(p, "tp_split", None) is not None else ("dp", "tp")
        is_tied = p is tied
        if is_tied and not is_first:
            families += ("pp",)
        groups.setdefault((families, is_tied), []).append(p)
    return [{"params": ps, "replicated_over": list(fams), "tied": is_tied}
            for (fams, is_tied), ps in groups.items()]


def parallelize(model: nn.Module, mesh: Mesh, config: ParallelConfig) -> Parallel:
    """Compose the layout `config` asks for around `model` (the whole GPT, on mesh.device)."""
    check_config(config, model.config.n_layer)
    gpt, precision = model, MixedPrecision(config.precision)
    pipeline = tied_comm = tied = None
    is_first = True
    params_module = gpt
    if config.pp > 1:  # 1. the pipeline split (the schedule is checked before any cutting)
        plans = pp.build_schedule(config.schedule, config.pp, config.microbatches,
                                  config.virtual_stages)
    if config.tp > 1:  # 2. tensor parallel: every rank keeps its slices
        tp.parallelize(gpt, mesh.tp, tp.GPT_PLAN, sequence_parallel=config.sequence_parallel)
    if config.pp > 1:
        stages = pp.build_stages(gpt, mesh.pp_rank, config.pp, config.virtual_stages)
        pp.free_unowned_parameters(gpt, stages)
        params_module = nn.ModuleList(stages)
        ends = [s.wte for s in stages if s.is_first] + [s.lm_head for s in stages if s.is_last]
        tied = ends[0].weight if ends else None
        is_first = any(s.is_first for s in stages)
        tied_comm = pp.tied_embedding_group(mesh)
    gpt.recompute = config.recompute  # 3. recompute: a flag the blocks read

    # 4. data parallel over mesh.dp: DDP, ZeRO-1/2 as the optimizer, or ZeRO-3 as fully_shard
    settings = adamw_settings(config.lr, config.weight_decay)
    if config.zero == 3:
        for block in gpt.transformer.h:
            fsdp.fully_shard(block, mesh.dp, param_dtype=precision.compute_dtype,
                             offload=config.offload)
        wrapped = fsdp.fully_shard(gpt, mesh.dp, param_dtype=precision.compute_dtype,
                                   offload=config.offload)
        optimizer = make_optimizer(parameter_groups(gpt.parameters()), config.lr,
                                   config.weight_decay)
    else:
        params_module.to(precision.param_dtype)  # half-precision copies; fp32 masters below
        groups = parameter_groups(params_module.parameters(), tied, is_first)
        if config.zero:
            wrapped = gpt if config.pp == 1 else params_module
            optimizer = ZeroOptimizer(groups, torch.optim.AdamW, mesh.dp, stage=config.zero,
                                      bucket_mb=config.bucket_mb, offload=config.offload,
                                      **settings)
        else:
            wrapped = DDP(params_module, mesh.dp, bucket_mb=config.bucket_mb)
            optimizer = MasterWeightOptimizer(groups, torch.optim.AdamW, **settings) \
                if precision.mixed else make_optimizer(groups, config.lr, config.weight_decay)
    memory = MemoryLedger(mesh.device)
    if config.pp > 1:
        pipeline = pp.PipelineExecutor(stages, plans[mesh.pp_rank], mesh.pp, memory=memory,
                                       dtype=precision.param_dtype)
    return Parallel(wrapped, optimizer, gpt, mesh, config, precision, memory, pipeline,
                    tied_comm)


# --- after backward: every synchronisation in one place ----------------------------------

def finish_gradient_sync(model: nn.Module) -> None:
    """Wait until data parallel's gradient averaging is complete (DDP or fully_shard); harmless
    when it already is (both finish by themselves at the end of backward)."""
    if isinstance(model, DDP):
        model.finish_gradient_sync()
    else:
        fsdp.finish_gradient_sync(model)


def stepped_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups of the tensors the optimizer really steps (masters, shards)."""
    return getattr(optimizer, "inner", optimizer).param_groups


@torch.no_grad()
def finalize_grads(model: nn.Module, mesh: Mesh, optimizer=None, tied_comm=None) -> None:
    """Every synchronisation after backward (Megatron's `finalize_model_grads`), in order:

    1. data parallel: DDP's last buckets (or ZeRO-3's reduce-scatters) are finished;
    2. sequence parallel: parameters replicated over tp saw only s/tp tokens on each rank,
       so their gradients are partial sums: add them over the tp group;
    3. ZeRO-1/2 (and fp32 masters): the optimizer reduces its gradients into its shards;
    4. the pipeline's tied embedding: its gradients on the first and the last stage are
       summed, so both copies take the same step.
    """
    finish_gradient_sync(model)
    partial = [p.grad for p in model.parameters()
               if getattr(p, "sequence_parallel_partial", False) and p.grad is not None]
    if partial and mesh.tp_size > 1:
        flat = torch.cat([g.reshape(-1) for g in partial])
        mesh.tp.all_reduce(flat)
        torch._foreach_copy_(partial, [t.view_as(g) for t, g in
                                       zip(flat.split([g.numel() for g in partial]), partial)])
    if optimizer is not None and hasattr(optimizer, "reduce_gradients"):
        optimizer.reduce_gradients()
    if tied_comm is not None and optimizer is not None:
        for group in stepped_groups(optimizer):
            for t in group["params"] if group.get("tied") else ():
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
                tied_comm.all_reduce(t.grad)


@torch.no_grad()
def clip_grad_norm_(optimizer, mesh: Mesh, max_norm: float) -> float:
    """Scale the stepped gradients so the whole model's gradient has L2 norm ≤ max_norm;
    return the norm. Every element counts once over all ranks: a tensor counts here unless
    a rank with a lower coordinate holds the same numbers (`replicated_over`; ZeRO and FSDP
    shards are disjoint over dp). One all-reduce over the world sums the squares."""
    squares, grads = 0.0, []
    for group in stepped_groups(optimizer):
        for t in group["params"]:
            if t.grad is None:
                continue
            grads.append(t.grad)
            families = set(group.get("replicated_over", ("dp", "tp")))
            if getattr(t, "dp_sharded", False):
                families.discard("dp")
            if all(getattr(mesh, f"{family}_rank") == 0 for family in families):
                squares += float(t.grad.float().pow(2).sum())
    norm = mesh.world.all_reduce_scalar(squares) ** 0.5
    if norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


# --- one step, every layout ----------------------------------------------------------------

def no_sync(model: nn.Module):
    return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()


def train_step(par: Parallel, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step on this rank's share of the global batch; returns the global batch's
    mean loss (the same on every rank)."""
    config, mesh, m = par.config, par.mesh, par.config.microbatches
    if x.shape[0] % m:
        raise ValueError(f"this rank's batch of {x.shape[0]} sequences does not split into "
                         f"{m} microbatches: use a batch that is a multiple of dp × microbatches")
    scale = par.precision.loss_scale
    if par.pipeline is not None:  # the schedule runs every microbatch's forward and backward
        par.pipeline.loss_scale = scale
        par.step_start = time.perf_counter()
        with no_sync(par.model):
            losses = par.pipeline.run(list(x.chunk(m)), list(y.chunk(m)))
        loss = mesh.pp.all_reduce_scalar(sum(losses)) / m  # only the last stage has them
    else:
        losses = []
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
            with no_sync(par.model) if i < m - 1 else contextlib.nullcontext():
                with par.memory.track_activations(exclude=par.model.parameters()):
                    _, microbatch_loss = par.model(xm, ym)
                (microbatch_loss * scale / m).backward()
                par.memory.release_activations()
            losses.append(microbatch_loss.detach())
        loss = float(torch.stack(losses).mean())
    finalize_grads(par.model, mesh, par.optimizer, par.tied_comm)
    grads = [t.grad for g in stepped_groups(par.optimizer) for t in g["params"]
             if t.grad is not None]
    if scale != 1.0:
        torch._foreach_mul_(grads, 1 / scale)
    overflow = par.precision.found_overflow(grads, mesh.world)  # fp16: every rank agrees
    if not overflow:
        if config.grad_clip > 0:
            clip_grad_norm_(par.optimizer, mesh, config.grad_clip)
        par.optimizer.step()
    par.precision.update(overflow)
    par.memory.measure(memory_tensors(par))  # after the step: everything exists
    par.optimizer.zero_grad()
    return mesh.dp.all_reduce_scalar(loss) / mesh.dp_size


def memory_tensors(par: Parallel) -> dict[str, list]:
    """What this rank holds, by kind, read from the outside of every building block."""
    held = {"params": list(par.gpt.parameters()), "grads": [], "optim": [], "master": []}
    blocks = [par.model.memory_tensors() if isinstance(par.model, DDP) else
              fsdp.memory_tensors(par.model)]
    if hasattr(par.optimizer, "memory_tensors"):
        blocks.append(par.optimizer.memory_tensors())
    for block in blocks:
        for kind, tensors in block.items():
            held[kind] += list(tensors)
    held["grads"] += [p.grad for p in par.gpt.parameters()]
    held["optim"] += optimizer_state_tensors(getattr(par.optimizer, "inner", par.optimizer))
    if par.config.zero == 3 and par.precision.mixed:  # fully_shard computes in half precision
        shards = {id(p) for p in par.gpt.parameters()}  # from fp32 shards: they are the masters
        held["master"] += [t for t in held["params"] if id(t) in shards]
        held["params"] = [t for t in held["params"] if id(t) not in shards]
    return held


def pipeline_report(par: Parallel) -> dict:
    """This rank's pipeline trace of the last step and what it held, for the metrics file.
    Times are seconds from the earliest stage's step start (one clock: one machine)."""
    comm, executor = par.mesh.pp, par.pipeline
    origin = comm.all_reduce_scalar(par.step_start, op=dist.ReduceOp.MIN)
    shift = par.step_start - origin
    trace = [{**e.as_dict(), "start_s": e.start_s + shift, "end_s": e.end_s + shift}
             for e in executor.trace]
    end = max((e["end_s"] for e in trace if e["kind"] in pp.COMPUTE), default=0.0)
    end = comm.all_reduce_scalar(end, op=dist.ReduceOp.MAX)
    return {"trace": trace, "in_flight_max": executor.in_flight_max,
            "activation_bytes_in_flight_max": executor.activation_bytes_in_flight_max,
            "bubble_fraction": pp.measured_bubble(trace, 0.0, end)}
