"""The one place where the building blocks are put together, and the one training step.

Each strategy file (`ddp`, `zero`, `fsdp`, `tp`, `pp`) is a building block used like PyTorch's
own, knowing nothing of the others; `parallelize` composes them in torchtitan's order:

    pipeline split → tensor parallel → recompute → DDP / ZeroOptimizer / fully_shard (dp group)

Every rank first builds the *whole* model from the seed, so the initial weights never depend on
the layout. The pipeline split keeps this rank's layers, tensor parallel its slices of them;
data parallel wraps *what is left*: the ranks of one dp group hold the same slices of the same
stage, so each slice's gradient is averaged (or reduce-scattered) with exactly its replicas.

`train_step`, one step of any layout: forward + backward per microbatch (or the pipeline
schedule), `finalize_grads`, fp16 unscale and overflow skip, clip, step, lr step, zero_grad.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hplab import cp, fsdp, moe, pp, tp
from hplab.ddp import DDP
from hplab.dist import Mesh
from hplab.formulas import learning_rate
from hplab.memory import KINDS, MemoryLedger, model_state_tensors
from hplab.precision import MasterWeightOptimizer, MixedPrecision
from hplab.zero import ZeroOptimizer


class NotSupported(ValueError):
    """A refused combination; `settings` names its config fields (train.py shows the flags)."""

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
    ep: int = 1  # expert parallel: dp ranks that share out each layer's experts (moe.py)
    cp: int = 1  # context parallel: ranks sharing each sequence, by `cp_style` and `cp_split`
    cp_style: str = "ring"
    cp_split: str = "zigzag"
    bucket_mb: float = 25.0
    precision: str = "fp32"
    recompute: bool = False
    offload: bool = False
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    no_decay_bias_norm: bool = False  # no weight decay on biases, layer norms, embeddings
    warmup_steps: int = 0  # the lr schedule: formulas.learning_rate
    lr_decay: str = "constant"
    decay_steps: int = 0
    min_lr: float = 0.0

    @classmethod
    def from_namespace(cls, namespace) -> ParallelConfig:
        return cls(**{f.name: getattr(namespace, f.name, f.default) for f in fields(cls)})


def check_config(config: ParallelConfig, model) -> None:
    """The refusals and checks that need no process (plain sentences); `model`: its config."""
    c, experts = config, getattr(model, "n_experts", 0)
    refusals = [
        (
            c.zero == 3 and c.pp > 1,
            ("zero", "pp"),
            "ZeRO-3 with a pipeline would gather every "
            "layer again for every microbatch's forward and backward (DeepSpeed and Colossal-AI "
            "refuse it too); use ZeRO-1 or 2",
        ),
        (
            c.sequence_parallel and (c.pp > 1 or c.zero > 0),
            ("sequence_parallel", "pp", "zero"),
            "sequence parallel runs with tensor and data parallel only (no pipeline, no ZeRO)",
        ),
        (
            c.sequence_parallel and c.tp == 1,
            ("sequence_parallel", "tp"),
            "sequence parallel "
            "splits the sequence over the tensor-parallel group, so it needs 2 or more tp ranks",
        ),
        (
            c.zero == 2 and c.pp > 1 and c.schedule == "zb-h1",
            ("zero", "schedule"),
            "ZeRO-2 "
            "reduce-scatters each layer's gradients as backward finishes them, and ZB-H1 defers "
            "weight gradients; use ZeRO-1",
        ),
        (
            c.offload and c.zero == 0,
            ("offload", "zero"),
            "offload moves ZeRO's sharded optimizer state to the CPU, so it needs ZeRO 1, 2 or 3",
        ),
        (
            experts and (c.pp > 1 or c.cp > 1 or c.zero == 3 or c.recompute or c.sequence_parallel),
            ("pp", "cp", "zero", "recompute", "sequence_parallel"),
            "experts run with data, expert "
            "and tensor parallel and ZeRO-1/2 only (no pipeline, context or sequence parallel, "
            "ZeRO-3 or recompute)",
        ),
        (
            c.ep > 1 and c.zero > 0,
            ("ep", "zero"),
            "ZeRO shards over the whole dp group, whose "
            "ranks hold different experts under expert parallel",
        ),
        (
            c.cp > 1 and c.sequence_parallel,
            ("cp", "sequence_parallel"),
            "context parallel already splits the sequence: use it without sequence parallel",
        ),
    ]
    for refused, settings, reason in refusals:
        if refused:
            raise NotSupported(f"not supported: {reason}", settings)
    moe.check_layout(experts, getattr(model, "moe_top_k", 1), c.ep, c.dp)
    if c.tp > 1:
        tp.check_divisible(
            model.n_head, model.n_embd, c.tp, model.n_positions if c.sequence_parallel else None
        )
    if c.cp > 1:  # (Ulysses shares each tensor-parallel rank's heads)
        cp.check_divisible(model.n_positions, model.n_head // c.tp, c.cp, c.cp_style, c.cp_split)
    if c.pp > 1:
        pp.build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages)
        pp.split_layers(model.n_layer, c.pp * c.virtual_stages)


ADAMW = dict(betas=(0.9, 0.95), foreach=False)  # foreach=False: the same update on shards


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, the same in every layout."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **ADAMW)


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
    scheduler: torch.optim.lr_scheduler.LRScheduler
    pipeline: pp.PipelineExecutor | None = None
    tied_comm: object = None
    step_start: float = 0.0  # when this rank's last pipeline step began (perf_counter)


def mark_no_decay(model: nn.Module) -> None:
    """No weight decay on biases, layer norms, embeddings (the tied LM head too), marked by role
    on the whole model: tp slices and pp stages keep it, `copy_markers` passes it to shards."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "bias" or isinstance(module, (nn.LayerNorm, nn.Embedding)):
                p.hplab_no_decay = True


def parameter_groups(
    params, tied: nn.Parameter | None = None, is_first: bool = True, weight_decay: float = 0.0
) -> list:
    """Group parameters by where their copies live (`replicated_over`): tensor-parallel slices
    over dp, the rest over dp and tp; the pipeline's tied embedding alone (+pp on the last);
    and by weight decay (0 if `mark_no_decay` marked it: ZeRO's shards never mix groups)."""
    groups: dict[tuple, list] = {}
    for p in (p for p in params if p.requires_grad):
        families = ("edp",) if moe.is_expert(p) else ("dp",)  # experts: their replicas only
        families += () if getattr(p, "tp_split", None) is not None else ("tp",)
        families += ("pp",) if p is tied and not is_first else ()
        decay = 0.0 if getattr(p, "hplab_no_decay", False) else weight_decay
        groups.setdefault((families, p is tied, decay), []).append(p)
    return [
        {"params": ps, "replicated_over": list(fams), "tied": is_tied, "weight_decay": decay}
        for (fams, is_tied, decay), ps in groups.items()
    ]


def parallelize(model: nn.Module, mesh: Mesh, config: ParallelConfig) -> Parallel:
    """Compose the layout `config` asks for around `model` (the whole GPT, on mesh.device)."""
    c, gpt, precision = config, model, MixedPrecision(config.precision)
    check_config(c, gpt.config)  # (the schedule too: before any cutting)
    memory = MemoryLedger(mesh.device)
    params_module, pipeline, tied_comm, tied, is_first = gpt, None, None, None, True
    if c.no_decay_bias_norm:  # by role, while the model is whole
        mark_no_decay(gpt)
    if c.tp > 1:  # tensor parallel: every rank keeps its slices of every layer
        tp.parallelize(
            gpt,
            mesh.tp,
            tp.MOE_GPT_PLAN if gpt.config.n_experts else tp.GPT_PLAN,
            sequence_parallel=c.sequence_parallel,
        )
    if c.cp > 1:  # context parallel: this rank's tokens; attention by ring or Ulysses
        cp.parallelize(gpt, mesh.cp, c.cp_style, c.cp_split)
    if c.pp > 1:  # the pipeline split: this rank's stages (the other layers are freed)
        stages = pp.build_stages(gpt, mesh.pp_rank, c.pp, c.virtual_stages)
        pp.free_unowned_parameters(gpt, stages)
        params_module = nn.ModuleList(stages)
        ends = [s.wte for s in stages if s.is_first] + [s.lm_head for s in stages if s.is_last]
        tied = ends[0].weight if ends else None
        is_first = any(s.is_first for s in stages)
        tied_comm = pp.tied_embedding_group(mesh)
        plan = pp.build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages)[mesh.pp_rank]
        pipeline = pp.PipelineExecutor(stages, plan, mesh.pp, memory, precision.param_dtype)
    gpt.recompute = c.recompute  # recompute: a flag the blocks read
    moe.parallelize(gpt, mesh.ep, mesh.dp)  # experts: this rank's E/ep (ep groups within dp)
    # data parallel over mesh.dp: DDP, ZeRO-1/2 as the optimizer, or ZeRO-3 as fully_shard
    if c.zero == 3:  # (no pipeline: params_module is gpt; its parameters become fp32 shards)
        for block in [*gpt.transformer.h, gpt]:  # the blocks first, then the root
            wrapped = fsdp.fully_shard(
                block, mesh.dp, param_dtype=precision.compute_dtype, offload=c.offload
            )
    else:  # no DDP under ZeRO-1/2 (its optimizer syncs) or ep (finalize_grads syncs experts)
        params_module.to(precision.param_dtype)  # half-precision copies; fp32 masters below
        plain = c.zero or c.ep > 1
        wrapped = params_module if plain else DDP(params_module, mesh.dp, c.bucket_mb)
    groups = parameter_groups(params_module.parameters(), tied, is_first, c.weight_decay)
    settings = dict(lr=c.lr, weight_decay=c.weight_decay, **ADAMW)
    if c.zero in (1, 2):
        optimizer = ZeroOptimizer(
            groups,
            torch.optim.AdamW,
            mesh.dp,
            stage=c.zero,
            bucket_mb=c.bucket_mb,
            offload=c.offload,
            **settings,
        )
    elif precision.mixed and c.zero == 0:  # (ZeRO-3: the fp32 shards are the masters)
        optimizer = MasterWeightOptimizer(groups, torch.optim.AdamW, **settings)
    else:
        optimizer = torch.optim.AdamW(groups, **settings)
    # step i's lr: lr · factor(i); ZeRO / master-weight optimizers pass it on to their inner one
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda i: (
            learning_rate(i, c.lr, c.warmup_steps, c.lr_decay, c.decay_steps, c.min_lr) / c.lr
        ),
    )
    return Parallel(
        wrapped, optimizer, gpt, mesh, c, precision, memory, scheduler, pipeline, tied_comm
    )


def finish_gradient_sync(model: nn.Module) -> None:
    """Wait for DDP's or fully_shard's gradient averaging (each also finishes it by itself)."""
    if isinstance(model, DDP):
        return model.finish_gradient_sync()
    fsdp.finish_gradient_sync(model)


def stepped_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups of the tensors the optimizer really steps (masters, shards)."""
    return getattr(optimizer, "inner", optimizer).param_groups


def _all_reduce_grads(grads: list[torch.Tensor], comm, scale: float = 1.0) -> None:
    """Sum `grads` over `comm` as one message, times `scale`, in place."""
    flat = _flatten_dense_tensors(grads)
    comm.all_reduce(flat)
    torch._foreach_copy_(grads, _unflatten_dense_tensors(flat.mul_(scale), grads))


@torch.no_grad()
def finalize_grads(model: nn.Module, mesh: Mesh, optimizer=None, tied_comm=None) -> None:
    """Every synchronisation after backward (Megatron's `finalize_model_grads`), in order:
    1. data parallel: DDP's last buckets (or ZeRO-3's reduce-scatters) are finished; under
       expert parallel (no DDP) dense gradients are averaged over dp, experts' over edp;
    2. sequence parallel: tp-replicated parameters saw s/tp tokens per rank: sum their grads;
    3. ZeRO-1/2 (and fp32 masters): the optimizer reduces its gradients into its shards;
       context parallel: each rank's loss saw its s/cp tokens: average the grads over cp;
    4. the pipeline's tied embedding: first and last stage sum its gradients (same step)."""
    finish_gradient_sync(model)
    if mesh.ep_size > 1:
        moe.sync_gradients(list(model.parameters()), mesh.dp, mesh.edp)
    partial = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel_partial", False) and p.grad is not None
    ]
    if partial and mesh.tp_size > 1:
        _all_reduce_grads(partial, mesh.tp)
    if hasattr(optimizer, "reduce_gradients"):  # ZeroOptimizer, MasterWeightOptimizer
        optimizer.reduce_gradients()
    stepped = (
        [t for g in stepped_groups(optimizer) for t in g["params"]]
        if optimizer
        else list(model.parameters())
    )  # (ZeRO: this rank's shards, the same on every cp rank)
    if mesh.cp_size > 1 and (grads := [t.grad for t in stepped if t.grad is not None]):
        _all_reduce_grads(grads, mesh.cp, 1 / mesh.cp_size)
    for group in stepped_groups(optimizer) if tied_comm and optimizer is not None else ():
        for t in group["params"] if group.get("tied") else ():
            if t.grad is None:
                t.grad = torch.zeros_like(t)
            tied_comm.all_reduce(t.grad)


@torch.no_grad()
def clip_grad_norm_(optimizer, mesh: Mesh, max_norm: float) -> float:
    """Scale the stepped gradients so the whole model's gradient has L2 norm ≤ max_norm; return
    the norm. Each element counts once: here unless a rank with a lower coordinate holds the
    same numbers (`replicated_over`; ZeRO and FSDP shards are disjoint over dp)."""
    squares, grads = 0.0, []
    for group in stepped_groups(optimizer):
        for t in (t for t in group["params"] if t.grad is not None):
            grads.append(t.grad)
            families = set(group.get("replicated_over", ("dp", "tp"))) | {"cp"}  # all: cp
            families -= {"dp"} if getattr(t, "dp_sharded", False) else set()
            if all(getattr(mesh, f"{family}_rank") == 0 for family in families):
                squares += float(t.grad.float().pow(2).sum())
    norm = mesh.world.all_reduce_scalar(squares) ** 0.5
    if norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def train_step(par: Parallel, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step on this rank's share of the global batch; returns its mean loss."""
    config, mesh, m, scale = par.config, par.mesh, par.config.microbatches, par.precision.loss_scale
    x, y = context_shard(par, x, y)
    no_sync = par.model.no_sync if isinstance(par.model, DDP) else contextlib.nullcontext
    if x.shape[0] % m:
        raise ValueError(
            f"this rank's batch of {x.shape[0]} sequences does not split into "
            f"{m} microbatches: use a batch that is a multiple of dp × microbatches"
        )
    if par.pipeline is not None:  # the schedule runs every microbatch's forward and backward
        par.pipeline.loss_scale = scale
        par.step_start = time.perf_counter()
        with no_sync():
            losses = par.pipeline.run(list(x.chunk(m)), list(y.chunk(m)))
        loss = mesh.pp.all_reduce_scalar(sum(losses)) / m  # only the last stage has them
    else:
        losses = []
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
            with no_sync() if i < m - 1 else contextlib.nullcontext():
                with par.memory.track_activations(exclude=par.model.parameters()):
                    _, microbatch_loss = par.model(xm, ym)
                (microbatch_loss * scale / m).backward()
                par.memory.release_activations()
            losses.append(microbatch_loss.detach())
        loss = float(torch.stack(losses).mean())
    finalize_grads(par.model, mesh, par.optimizer, par.tied_comm)
    grads = [
        t.grad for g in stepped_groups(par.optimizer) for t in g["params"] if t.grad is not None
    ]
    torch._foreach_mul_(grads, 1 / scale)  # (exact when the scale is 1)
    overflow = par.precision.found_overflow(grads, mesh.world)  # fp16: every rank agrees
    if not overflow:
        if config.grad_clip > 0:
            clip_grad_norm_(par.optimizer, mesh, config.grad_clip)
        par.optimizer.step()
        par.scheduler.step()  # a skipped step does not advance the schedule (as Megatron's)
    par.precision.update(overflow)
    par.memory.measure(memory_tensors(par))  # after the step: everything exists
    par.optimizer.zero_grad()
    loss = mesh.cp.all_reduce_scalar(loss) / mesh.cp_size  # every rank's tokens count as many
    return mesh.dp.all_reduce_scalar(loss) / mesh.dp_size


def context_shard(par: Parallel, x: torch.Tensor, y: torch.Tensor):
    """This rank's tokens of its dp share [b, s] of the batch (all of them without cp)."""
    c, rank = par.config, par.mesh.cp_rank
    return (x, y) if c.cp == 1 else tuple(cp.shard(t, rank, c.cp, c.cp_split) for t in (x, y))


@torch.no_grad()
def evaluate(par: Parallel, x: torch.Tensor, y: torch.Tensor) -> float:
    """`train_step`'s forward only, nothing random: the global batch's mean cross-entropy (no MoE
    balance loss). Each cp, dp and microbatch share has as many tokens: averaging means is exact."""
    m, mesh = par.config.microbatches, par.mesh
    microbatches = list(zip(*(t.chunk(m) for t in context_shard(par, x, y))))
    if par.pipeline is not None:  # only the last stage has losses
        loss = mesh.pp.all_reduce_scalar(sum(par.pipeline.forward_only(microbatches))) / m
    else:  # (ZeRO-3: each unit is gathered for its forward and freed after it, as in training)
        loss = sum(float(par.gpt.loss_fn(par.model(xm)[0], ym)) for xm, ym in microbatches) / m
    return mesh.dp.all_reduce_scalar(mesh.cp.all_reduce_scalar(loss) / mesh.cp_size) / mesh.dp_size


def memory_tensors(par: Parallel) -> dict[str, list]:
    """What this rank holds, by kind, read from the outside of every building block."""
    model, opt = par.model, par.optimizer
    blocks = [
        model.memory_tensors() if isinstance(model, DDP) else fsdp.memory_tensors(model),
        getattr(opt, "memory_tensors", dict)(),
        model_state_tensors(par.gpt, getattr(opt, "inner", opt)),
    ]
    held = {kind: [t for block in blocks for t in block.get(kind, ())] for kind in KINDS}
    if par.config.zero == 3 and par.precision.mixed:  # fully_shard computes in half precision
        shards = {id(p) for p in par.gpt.parameters()}  # from fp32 shards: they are the masters
        held["master"] += [t for t in held["params"] if id(t) in shards]
        held["params"] = [t for t in held["params"] if id(t) not in shards]
    return held


def pipeline_report(par: Parallel) -> dict:
    """This rank's pipeline trace of the last step and what it held, for the metrics file
    (seconds from the earliest stage's step start: one clock, one machine)."""
    comm, executor = par.mesh.pp, par.pipeline
    shift = par.step_start - comm.all_reduce_scalar(par.step_start, op=dist.ReduceOp.MIN)
    trace = [
        {**e, "start_s": e["start_s"] + shift, "end_s": e["end_s"] + shift} for e in executor.trace
    ]
    end = max((e["end_s"] for e in trace if e["kind"] in pp.COMPUTE), default=0.0)
    end = comm.all_reduce_scalar(end, op=dist.ReduceOp.MAX)
    return {
        "trace": trace,
        "in_flight_max": executor.in_flight_max,
        "activation_bytes_in_flight_max": executor.activation_bytes_in_flight_max,
        "bubble_fraction": pp.measured_bubble(trace, 0.0, end),
    }
