"""One rank's training, beside the model `parallelize` returns: the optimizer and its schedule,
the state they make together, and the step of any layout.

`hplab.parallelize` transforms the model only, as torch's and torchtitan's do; what steps it is
built here, as torchtitan's train.py builds it, and a `TrainState` holds the four for the step:

    model = parallelize(build_model(config, seed), mesh, layout)
    optimizer = build_optimizer(model, mesh, layout, optim)
    scheduler = build_lr_scheduler(optimizer, optim)
    state = TrainState(model, optimizer, scheduler, mesh, layout, optim)
    loss = train_step(state, x, y)

`train_step`, one step of any layout: forward + backward per microbatch (or the pipeline
schedule), `compose.sync_gradients`, fp16 unscale and overflow skip, the global-norm clip,
step, lr step, zero_grad. `evaluate` is its forward only. The optimizer groups parameters by
where their copies live (their placement records), so a ZeRO shard holds pieces that live
alike, and the clip counts each element of the global gradient once.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from hplab.config import Layout, OptimConfig
from hplab.parallel import cp, placement, pp
from hplab.parallel.compose import (
    build_pipeline,
    no_sync,
    pipeline_stages,
    sync_gradients,
    unwrap,
    whole_model,
)
from hplab.parallel.mesh import Mesh
from hplab.parallel.optim import stepped_groups
from hplab.parallel.precision import MasterWeightOptimizer, MixedPrecision
from hplab.parallel.zero import ZeroOptimizer
from hplab.plan.formulas import learning_rate

ADAMW = dict(betas=(0.9, 0.95), foreach=False)  # foreach=False: the same update on shards


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, the same in every layout."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **ADAMW)


@dataclass
class TrainState:
    """One rank's training: the model `parallelize` returned, the optimizer and schedule built
    beside it, and what `train_step` derives from them once: the whole decoder behind the wrappers,
    the precision (fp16's loss scaler), the pipeline executor over the model's stages, and the
    group in which it sums the tied embedding's gradients. Building it creates those groups:
    every rank builds one, in the same order."""

    model: nn.Module  # what runs forward: DDP(model), the fully-sharded model, or DDP(stages)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    mesh: Mesh
    layout: Layout
    optim: OptimConfig = field(default_factory=OptimConfig)
    decoder: nn.Module = field(init=False)  # the model itself (single-device parameter names)
    precision: MixedPrecision = field(init=False)
    pipeline: pp.PipelineExecutor | None = field(init=False)
    tied_comm: object = field(init=False)
    # called as fn(self) after each optimizer step (taken or skipped), before zero_grad: what
    # observers measure then (hplab.observe.observers)
    on_step_end: list = field(default_factory=list)

    def __post_init__(self):
        stages = pipeline_stages(self.model)
        self.decoder = whole_model(self.model)
        self.precision = MixedPrecision(self.layout.precision)
        self.tied_comm = pp.tied_embedding_group(self.mesh) if stages else None
        self.pipeline = (
            build_pipeline(stages, self.mesh, self.layout, self.tied_comm) if stages else None
        )


def mark_no_decay(model: nn.Module) -> None:
    """No weight decay on biases, norms, embeddings (the tied LM head too), recorded by role
    on the whole model: tp slices and pp stages keep it, shards and masters derive it."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "bias" or isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Embedding)):
                placement.update(p, no_decay=True)


def parameter_groups(params, tied: nn.Parameter | None = None, weight_decay: float = 0.0) -> list:
    """Group parameters by where their copies live (their placement's `copies_over`: a
    tensor-parallel slice's over dp, the rest's over dp and tp, an expert's over edp), the
    pipeline's tied embedding alone, and by weight decay (0 for `no_decay`): a ZeRO shard of
    a group then holds pieces that all live alike."""
    groups: dict[tuple, list] = {}
    for p in (p for p in params if p.requires_grad):
        record = placement.of(p)
        decay = 0.0 if record.no_decay else weight_decay
        groups.setdefault((record.copies_over, p is tied, decay), []).append(p)
    return [
        {"params": ps, "tied": is_tied, "weight_decay": decay}
        for (_, is_tied, decay), ps in groups.items()
    ]


def build_optimizer(
    model: nn.Module, mesh: Mesh, layout: Layout, optim: OptimConfig | None = None
) -> torch.optim.Optimizer:
    """AdamW (fixed betas, foreach=False) over what `model` (`parallelize`'s) holds on this
    rank, as the layout needs it: ZeRO-1/2's sharded optimizer, fp32 masters under mixed
    precision, or plain. `optim`: its settings (OptimConfig's defaults when None)."""
    optim = optim or OptimConfig()
    precision = MixedPrecision(layout.precision)
    return make_sharded_optimizer(
        whole_model(model), unwrap(model), pipeline_stages(model), mesh, layout, optim, precision
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig | None = None
) -> torch.optim.lr_scheduler.LRScheduler:
    """Step i's lr: lr · factor(i), warmup then decay (ZeRO / master-weight optimizers pass it
    on to their inner one). `optim`: the schedule (OptimConfig's defaults when None)."""
    factor = functools.partial(lr_factor, optim or OptimConfig())
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lr_factor(optim: OptimConfig, step: int) -> float:
    """Step `step`'s learning rate over the peak: warmup, then the decay (formulas)."""
    o = optim
    return learning_rate(step, o.lr, o.warmup_steps, o.lr_decay, o.decay_steps, o.min_lr) / o.lr


def make_sharded_optimizer(
    model, owned, stages, mesh, layout: Layout, optim: OptimConfig, precision
):
    """AdamW over this rank's parameters, grouped by where their copies live: as ZeRO-1/2 over
    dp × cp (experts over their replicas, dp/ep × cp), over fp32 masters (mixed precision
    without ZeRO), or plain (ZeRO-3: the fp32 shards)."""
    ends = any(s.is_first or s.is_last for s in stages) and model.config.tie_word_embeddings
    tied = model.lm_head.weight if ends else None  # (the embedding's too: on both ends)
    groups = parameter_groups(owned.parameters(), tied, optim.weight_decay)
    settings = dict(lr=optim.lr, weight_decay=optim.weight_decay, **ADAMW)
    if layout.zero in (1, 2):
        for group in groups:  # the experts' over their replicas
            if placement.of(group["params"][0]).expert:
                group.update(shard_over=mesh.edp_cp, average_over=mesh.dp_cp.size)
        return ZeroOptimizer(
            groups,
            torch.optim.AdamW,
            mesh.dp_cp,
            stage=layout.zero,
            bucket_mb=layout.bucket_mb,
            offload=layout.offload,
            **settings,
        )
    if precision.mixed and layout.zero == 0:  # (ZeRO-3: the fp32 shards are the masters)
        return MasterWeightOptimizer(groups, torch.optim.AdamW, **settings)
    return torch.optim.AdamW(groups, **settings)


@torch.no_grad()
def clip_grad_norm_(optimizer, mesh: Mesh, max_norm: float) -> float:
    """Scale the stepped gradients so the whole model's gradient has L2 norm ≤ max_norm; return
    the norm. Each element counts once: here unless a rank with a lower coordinate holds the
    same numbers (`placement.counted_here`; ZeRO and FSDP shards are disjoint over dp or edp)."""
    counted = []
    grads = []
    for group in stepped_groups(optimizer):
        for t in (t for t in group["params"] if t.grad is not None):
            grads.append(t.grad)
            if placement.counted_here(t, mesh, group.get("tied", False)):  # (once)
                counted.append(t.grad.float().pow(2).sum() / placement.of(t).kv_replicas)
    # each tensor's sum of squares in fp32, added up in fp64: one host sync, not one per tensor
    squares = float(torch.stack(counted).double().sum()) if counted else 0.0
    norm = mesh.world.all_reduce_scalar(squares) ** 0.5
    if norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def train_step(par: TrainState, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step on this rank's share of the global batch; returns its mean loss."""
    layout = par.layout
    mesh = par.mesh
    scale = par.precision.loss_scale
    m = layout.microbatches
    x, y = context_tokens(par, x, y)
    if x.shape[0] % m:
        raise ValueError(
            f"this rank's batch of {x.shape[0]} sequences does not split into "
            f"{m} microbatches: use a batch that is a multiple of dp × microbatches"
        )
    if par.pipeline is not None:  # the schedule runs every microbatch's forward and backward
        par.pipeline.loss_scale = scale
        with no_sync(par.model):
            losses = par.pipeline.run(list(x.chunk(m)), list(y.chunk(m)))
        loss = mesh.pp.all_reduce_scalar(sum(losses)) / m  # only the last stage has them
    else:
        losses = []
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
            with no_sync(par.model) if i < m - 1 else contextlib.nullcontext():
                _, microbatch_loss = par.model(xm, ym)
                (microbatch_loss * scale / m).backward()
            losses.append(microbatch_loss.detach())
        loss = float(torch.stack(losses).mean())
    sync_gradients(par.model, par.optimizer)
    grads = [
        t.grad for g in stepped_groups(par.optimizer) for t in g["params"] if t.grad is not None
    ]
    torch._foreach_mul_(grads, 1 / scale)  # (exact when the scale is 1)
    overflow = par.precision.found_overflow(grads, mesh.world)  # fp16: every rank agrees
    if not overflow:
        if par.optim.grad_clip > 0:
            clip_grad_norm_(par.optimizer, mesh, par.optim.grad_clip)
        par.optimizer.step()
        par.scheduler.step()  # a skipped step does not advance the schedule (as Megatron's)
    par.precision.update(overflow)
    for hook in par.on_step_end:  # (observers: what the rank holds now)
        hook(par)
    par.optimizer.zero_grad()
    loss = mesh.cp.all_reduce_scalar(loss) / mesh.cp_size  # every rank's tokens count as many
    return mesh.dp.all_reduce_scalar(loss) / mesh.dp_size


def context_tokens(par: TrainState, x: torch.Tensor, y: torch.Tensor):
    """This rank's tokens of its dp share [b, s] of the batch (all of them without cp)."""
    c = par.layout
    rank = par.mesh.cp_rank
    return (x, y) if c.cp == 1 else tuple(cp.tokens_of(t, rank, c.cp, c.cp_split) for t in (x, y))


@torch.no_grad()
def evaluate(par: TrainState, x: torch.Tensor, y: torch.Tensor) -> float:
    """`train_step`'s forward only, nothing random: the global batch's mean cross-entropy (no MoE
    balance loss). Each cp, dp and microbatch share has as many tokens: averaging means is exact."""
    m = par.layout.microbatches
    mesh = par.mesh
    microbatches = list(zip(*(t.chunk(m) for t in context_tokens(par, x, y))))
    if par.pipeline is not None:  # only the last stage has losses
        loss = mesh.pp.all_reduce_scalar(sum(par.pipeline.forward_only(microbatches))) / m
    else:  # (ZeRO-3: each unit is gathered for its forward and freed after it, as in training)
        loss = sum(float(par.decoder.loss_fn(par.model(xm)[0], ym)) for xm, ym in microbatches) / m
    return mesh.dp.all_reduce_scalar(mesh.cp.all_reduce_scalar(loss) / mesh.cp_size) / mesh.dp_size
