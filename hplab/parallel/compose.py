"""The one place where the building blocks are put together, and the one training step.

Each strategy file (`ddp`, `zero`, `fsdp`, `tp`, `pp`) is a building block used like PyTorch's
own, knowing nothing of the others; `parallelize` composes them in torchtitan's order:

    pipeline split → tensor parallel → recompute → DDP / ZeroOptimizer / fully_shard (dp group)

Every rank first builds the *whole* model from the seed, so the initial weights never depend on
the layout. The pipeline split keeps this rank's layers, tensor parallel its slices of them;
data parallel wraps *what is left*: the ranks of one dp group hold the same slices of the same
stage, so each slice's gradient is averaged (or reduce-scattered) with exactly its replicas.

`parallelize` transforms the model only and returns it, as torch's and torchtitan's do; the
optimizer and its learning-rate schedule are built beside it, as torchtitan's train.py builds
them, and a `TrainState` holds the four for the step:

    model = parallelize(build_model(config, seed), mesh, layout)
    optimizer = build_optimizer(model, mesh, layout, optim)
    scheduler = build_lr_scheduler(optimizer, optim)
    state = TrainState(model, optimizer, scheduler, mesh, layout, optim)
    loss = train_step(state, x, y)

`train_step`, one step of any layout: forward + backward per microbatch (or the pipeline
schedule), `sync_gradients`, fp16 unscale and overflow skip, clip, step, lr step, zero_grad.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from hplab.config import Layout, OptimConfig, validate
from hplab.models import gpt as gpt_model
from hplab.models import llama
from hplab.parallel import cp, fsdp, moe, placement, pp, tp
from hplab.parallel.ddp import DDP
from hplab.parallel.mesh import Mesh
from hplab.parallel.optim import WrappedOptimizer, stepped_groups
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
    group whose gradients `sync_gradients` sums (the pipeline's tied embedding). Building it
    creates those groups: every rank builds one, in the same order."""

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
        self.pipeline = build_pipeline(stages, self.mesh, self.layout) if stages else None
        self.tied_comm = pp.tied_embedding_group(self.mesh) if stages else None


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


def parallelize(model: nn.Module, mesh: Mesh, layout: Layout) -> nn.Module:
    """Compose `layout` around `model` (the whole decoder, GPT-2 or Llama, on mesh.device), the
    strategies in torchtitan's order, and return what this rank runs forward: DDP(model), the
    fully-sharded model, the model itself (ZeRO-1/2, experts) or, under a pipeline, this rank's
    stages (in an nn.ModuleList, in DDP without ZeRO). It transforms the model only: the optimizer is
    `build_optimizer`'s. Weight decay's exceptions are marked before, while the model is whole
    (`mark_no_decay`: tensor parallel replaces the embedding)."""
    precision = MixedPrecision(layout.precision)
    validate(layout, model.config, mesh.world_size)  # every rule, before any cutting
    if layout.tp > 1:  # tensor parallel: every rank keeps its slices of every layer
        is_llama = model.config.arch == "llama"
        plan, blocks = (
            (llama.TP_PLAN, "model.layers") if is_llama else (gpt_model.TP_PLAN, "transformer.h")
        )
        plan = tp.with_experts(plan, blocks) if model.config.n_experts else plan
        tp.parallelize(model, mesh.tp, plan, sequence_parallel=layout.sequence_parallel)
    if layout.cp > 1:  # context parallel: this rank's tokens; attention by ring or Ulysses
        cp.parallelize(model, mesh.cp, layout.cp_style, layout.cp_split)
    stages = []
    if layout.pp > 1:  # the pipeline split: this rank's stages (the other layers are freed)
        stages = pp.build_stages(model, mesh.pp_rank, layout.pp, layout.virtual_stages)
        pp.free_unowned_parameters(model, stages)
    model.recompute = layout.recompute  # none, selective or full: a mode the blocks read
    moe.parallelize(model, mesh.ep, mesh.dp, mesh.cp)  # experts: this rank's E/ep (within dp)
    owned = nn.ModuleList(stages) if stages else model  # what this rank holds and steps
    return data_parallel(model, owned, mesh, layout, precision)


def unwrap(model: nn.Module) -> nn.Module:
    """What this rank holds and steps: the module inside DDP, else `model` itself."""
    return model.module if isinstance(model, DDP) else model


def pipeline_stages(model: nn.Module) -> list[pp.Stage]:
    """This rank's pipeline stages in what `parallelize` returned ([] without a pipeline)."""
    owned = unwrap(model)
    if not isinstance(owned, nn.ModuleList):
        return []
    return [stage for stage in owned if isinstance(stage, pp.Stage)]


def whole_model(model: nn.Module) -> nn.Module:
    """The decoder behind what `parallelize` returned (its single-device parameter names)."""
    stages = pipeline_stages(model)
    return stages[0].decoder if stages else unwrap(model)


def build_pipeline(stages: list[pp.Stage], mesh: Mesh, layout: Layout) -> pp.PipelineExecutor:
    """The executor that runs this rank's stages through the schedule's action list, with one
    communicator each way between pipeline neighbours (NCCL's order: `pp.message_links`)."""
    plans = pp.build_schedule(
        layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages
    )
    return pp.PipelineExecutor(
        stages,
        plans[mesh.pp_rank],
        mesh.pp,
        pp.message_links(mesh, plans),
        MixedPrecision(layout.precision).param_dtype,
        layout.tp if layout.sequence_parallel else 1,
    )


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


def data_parallel(model, owned: nn.Module, mesh: Mesh, layout: Layout, precision) -> nn.Module:
    """Over mesh.dp_cp (the dp ranks and their cp ranks: all hold the same weights): ZeRO-3 as
    fully_shard (each block a unit, then the root), else DDP around what this rank holds; none
    under ZeRO-1/2 (its optimizer syncs) or expert parallel (sync_gradients averages experts over
    their own replicas)."""
    if layout.zero == 3:  # (no pipeline: owned is model; its parameters become fp32 shards)
        policy = MixedPrecisionPolicy(param_dtype=precision.compute_dtype)
        offload = CPUOffloadPolicy() if layout.offload else OffloadPolicy()
        for block in [*model.blocks, model]:  # the blocks first, then the root
            fsdp.fully_shard(block, mesh.dp_cp, mp_policy=policy, offload_policy=offload)
        set_prefetch(model, layout.prefetch)
        return model
    owned.to(precision.param_dtype)  # half-precision copies; fp32 masters in the optimizer
    if layout.zero or layout.ep > 1:
        return owned
    return DDP(owned, mesh.dp_cp, layout.bucket_mb)


def set_prefetch(model: nn.Module, prefetch: str) -> None:
    """`--prefetch {both,forward,backward,none}` as FSDP2's explicit lists: in forward the root
    (it runs first) gathers the first block, each block the next; in backward the root (its
    head's gradient comes first) gathers the last block, each block the one before it."""
    forward_order = [model, *model.blocks]
    backward_order = [model, *reversed(model.blocks)]
    for unit, after in zip(forward_order, forward_order[1:] + [None]):
        ahead = prefetch in ("both", "forward") and after is not None
        unit.set_modules_to_forward_prefetch([after] if ahead else [])
    for unit, after in zip(backward_order, backward_order[1:] + [None]):
        ahead = prefetch in ("both", "backward") and after is not None
        unit.set_modules_to_backward_prefetch([after] if ahead else [])


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


def finish_gradient_sync(model: nn.Module) -> None:
    """Wait for DDP's or fully_shard's gradient averaging (each also finishes it by itself)."""
    if isinstance(model, DDP):
        return model.finish_gradient_sync()
    fsdp.finish_gradient_sync(model)


def _all_reduce_grads(grads: list[torch.Tensor], comm, scale: float = 1.0) -> None:
    """Sum `grads` over `comm` as one message, times `scale`, in place. The message is built on
    the communicator's device: offloaded optimizer shards keep their gradients on the host,
    and NCCL reduces only GPU tensors."""
    flat = _flatten_dense_tensors(grads).to(comm.device)
    comm.all_reduce(flat)
    summed = flat.mul_(scale).to(grads[0].device)  # (one copy back, where they live)
    torch._foreach_copy_(grads, _unflatten_dense_tensors(summed, grads))


@torch.no_grad()
def sync_gradients(model: nn.Module, mesh: Mesh, optimizer=None, tied_comm=None):
    """Every synchronisation after backward (Megatron's `finalize_model_grads`), in order:
    1. data parallel: DDP's last buckets (or ZeRO-3's reduce-scatters) are finished; under
       expert parallel (no DDP) dense gradients are averaged over dp, experts' over edp (under
       ZeRO-1/2 its optimizer does both, in 2). Context parallel's ranks hold the same weights
       and each rank's loss saw its s/cp tokens: all of these average over dp × cp;
    2. ZeRO-1/2 (and fp32 masters): the optimizer reduces its gradients into its shards;
    3. the pipeline's tied embedding: first and last stage sum its gradients (same step).
    Tensor parallel's partial sums (sequence parallel's whole parameters, K/V heads shared by
    several ranks) need nothing here: their hooks summed them in backward (tp.py)."""
    finish_gradient_sync(model)
    if mesh.ep_size > 1 and not isinstance(optimizer, ZeroOptimizer):  # (ZeRO: two groups)
        moe.sync_gradients(list(model.parameters()), mesh.dp_cp, mesh.edp_cp)
    if isinstance(optimizer, WrappedOptimizer):  # ZeroOptimizer, MasterWeightOptimizer
        optimizer.sync_gradients()
    if tied_comm and optimizer is not None:
        for group in stepped_groups(optimizer):
            if group.get("tied"):
                for t in group["params"]:
                    if t.grad is None:
                        t.grad = torch.zeros_like(t)
                    _all_reduce_grads([t.grad], tied_comm)


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


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Backwards that only accumulate gradients, the sync left to a later one: DDP's `no_sync()`,
    FSDP2's `set_requires_gradient_sync(False)` (then True again), nothing for the rest."""
    if isinstance(model, DDP):
        with model.no_sync():
            yield
    elif isinstance(model, fsdp.FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


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
    sync_gradients(par.model, mesh, par.optimizer, par.tied_comm)
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
