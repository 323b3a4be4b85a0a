"""The one place where the building blocks are put together.

Each strategy file (`ddp`, `zero`, `fsdp`, `tp`, `pp`) is a building block used like PyTorch's
own, knowing nothing of the others; `parallelize` composes them in torchtitan's order:

    pipeline split → tensor parallel → recompute → DDP / ZeroOptimizer / fully_shard (dp group)

Every rank first builds the *whole* model from the seed, so the initial weights never depend on
the layout. The pipeline split keeps this rank's layers, tensor parallel its slices of them;
data parallel wraps *what is left*: the ranks of one dp group hold the same slices of the same
stage, so each slice's gradient is averaged (or reduce-scattered) with exactly its replicas.

`parallelize` transforms the model only and returns it, as torch's and torchtitan's do; the
optimizer, its schedule and the training step are the run's (hplab/training.py), built beside
it as torchtitan's train.py builds them. `sync_gradients` is every synchronisation a layout
owes after backward, and `no_sync` the backwards that owe none yet (gradient accumulation).
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from hplab.config import Layout, validate
from hplab.models import gpt as gpt_model
from hplab.models import llama, tp_styles
from hplab.parallel import cp, fsdp, moe, pp, tp
from hplab.parallel.ddp import DDP
from hplab.parallel.mesh import Mesh
from hplab.parallel.optim import WrappedOptimizer
from hplab.parallel.precision import MixedPrecision


def parallelize(model: nn.Module, mesh: Mesh, layout: Layout) -> nn.Module:
    """Compose `layout` around `model` (the whole decoder, GPT-2 or Llama, on mesh.device), the
    strategies in torchtitan's order, and return what this rank runs forward: DDP(model), the
    fully-sharded model, the model itself (ZeRO-1/2, experts) or, under a pipeline, this rank's
    stages (in an nn.ModuleList, in DDP without ZeRO). It transforms the model only: the
    optimizer is `training.build_optimizer`'s. Weight decay's exceptions are marked before, while
    the model is whole (`training.mark_no_decay`: tensor parallel replaces the embedding)."""
    precision = MixedPrecision(layout.precision)
    validate(layout, model.config, mesh.world_size)  # every rule, before any cutting
    if layout.tp > 1:  # tensor parallel: every rank keeps its slices of every layer
        is_llama = model.config.arch == "llama"
        plan, blocks = (
            (llama.TP_PLAN, "model.layers") if is_llama else (gpt_model.TP_PLAN, "transformer.h")
        )
        plan = tp_styles.with_experts(plan, blocks) if model.config.n_experts else plan
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


def build_pipeline(
    stages: list[pp.Stage], mesh: Mesh, layout: Layout, tied=None
) -> pp.PipelineExecutor:
    """The executor that runs this rank's stages through the schedule's action list, with one
    communicator each way between pipeline neighbours (NCCL's order: `pp.message_links`) and
    `tied`, the first and last stage's group (`pp.tied_embedding_group`), where it is needed."""
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
        layout.receives_ahead,
        tied if pp.tied_weight(stages) is not None else None,
    )


def data_parallel(model, owned: nn.Module, mesh: Mesh, layout: Layout, precision) -> nn.Module:
    """Over mesh.dp_cp (the dp ranks and their cp ranks: all hold the same weights): ZeRO-3 as
    fully_shard (each block a unit, then the root), else DDP around what this rank holds (the
    experts over their own replicas, mesh.edp_cp); none under ZeRO-1/2 (its optimizer syncs)."""
    if layout.zero == 3:  # (no pipeline: owned is model; its parameters become fp32 shards)
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy  # (2.5 s)

        policy = MixedPrecisionPolicy(param_dtype=precision.compute_dtype)
        offload = CPUOffloadPolicy() if layout.offload else None
        for block in [*model.blocks, model]:  # the blocks first, then the root
            fsdp.fully_shard(block, mesh.dp_cp, mp_policy=policy, offload_policy=offload)
        set_prefetch(model, layout.prefetch)
        return model
    owned.to(precision.param_dtype)  # half-precision copies; fp32 masters in the optimizer
    if layout.zero:
        return owned
    experts = mesh.edp_cp if layout.ep > 1 else None
    return DDP(owned, mesh.dp_cp, layout.bucket_mb, expert_group=experts)


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


def finish_gradient_sync(model: nn.Module) -> None:
    """Wait for DDP's or fully_shard's gradient averaging (each also finishes it by itself)."""
    if isinstance(model, DDP):
        return model.finish_gradient_sync()
    fsdp.finish_gradient_sync(model)


def sync_gradients(model: nn.Module, optimizer=None) -> None:
    """Every synchronisation after backward (Megatron's `finalize_model_grads`), in order:
    1. data parallel: DDP's last buckets (or ZeRO-3's reduce-scatters) are finished, the
       experts' over their replicas. Context parallel's ranks hold the same weights and each
       rank's loss saw its s/cp tokens: all of these average over dp × cp;
    2. ZeRO-1/2 (and fp32 masters): the optimizer reduces its gradients into its shards.
    Each wrapper also does this by itself (DDP and fully_shard when backward ends, the
    optimizers at `step()`); the trainer calls it to measure the gradients before the step.
    Partial sums need nothing here: tensor parallel's hooks summed them in backward (tp.py),
    the pipeline executor the tied embedding's two copies after its backwards (pp.py)."""
    finish_gradient_sync(model)
    if isinstance(optimizer, WrappedOptimizer):  # ZeroOptimizer, MasterWeightOptimizer
        optimizer.sync_gradients()


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
