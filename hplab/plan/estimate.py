"""One plan: the memory and the step time of a layout on a cluster, as one flat dict (the JSON
`python -m hplab.plan --json` prints), assembled from the parts `memory` and `time` compute.
Sources: see `hplab.plan`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hplab.config import Layout, LayoutError, ModelConfig, validate
from hplab.plan.formulas import flops_per_step
from hplab.plan.memory import activation_memory, memory_per_gpu, params_per_stage
from hplab.plan.presets import DEFAULT_BATCH_SIZE, GPU_PRESETS, Cluster, Efficiency
from hplab.plan.time import step_time


class PlanError(LayoutError):
    """What the planner cannot answer, though a run might: an unknown preset, a search without
    GPUs, a layout outside its model (interleaved chunks of unequal layers). One line."""


def check_layout(model: ModelConfig, lay: Layout) -> None:
    """Raise LayoutError, one line, unless the layout can run at all (`config.validate`, not
    only what hplab composes today) and the planner models it."""
    validate(lay, model, runs=False)
    chunks = lay.pp * lay.virtual_stages
    if lay.schedule == "interleaved" and lay.pp > 1 and model.n_layer % chunks:
        raise PlanError(
            f"interleaved schedule needs n_layer={model.n_layer} divisible by "
            f"pp×virtual_stages={chunks}"
        )


#: The layout's fields a plan reports, in the order of its JSON (the planner does not model
#: `cp_split`, pricing both splits alike, nor `bucket_mb`).
PLANNED_FIELDS = (
    "dp",
    "tp",
    "pp",
    "zero",
    "schedule",
    "virtual_stages",
    "microbatches",
    "batch_size",
    "precision",
    "recompute",
    "sequence_parallel",
    "offload",
    "cp",
    "cp_style",
    "ep",
)


def header(model: ModelConfig, lay: Layout, cluster: Cluster) -> dict:
    """What was planned: the model, the layout and the cluster."""
    return {
        "model": model.name,
        "params": model.num_params(),
        "layout": lay.short(),
        **{name: getattr(lay, name) for name in PLANNED_FIELDS},
        "n_experts": model.n_experts,
        "moe_top_k": model.moe_top_k,
        "micro_batch_size": lay.micro_batch_size,
        "gpus": lay.world_size,
        "gpu": cluster.gpu.name,
        "gpus_per_node": cluster.gpus_per_node,
    }


@dataclass(frozen=True)
class Throughput:
    """What a step achieves: FLOPs, tokens per second, and the fraction of peak. Model FLOPs
    count each forward once, hardware FLOPs the recomputed ones too (MFU and HFU, [PTD-P])."""

    model_flops_per_step: float
    hardware_flops_per_step: float
    tokens_per_s: float
    tflops_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float


def throughput(
    model: ModelConfig, lay: Layout, cluster: Cluster, flops: dict, step: float
) -> Throughput:
    """`flops`: formulas.flops_per_step of the global batch; `step`: seconds per step."""
    peak = cluster.gpu.peak_tflops[lay.precision] * 1e12
    tflops = flops["hardware_flops"] / (step * lay.world_size) / 1e12
    model_tflops = flops["model_flops"] / (step * lay.world_size) / 1e12
    return Throughput(
        model_flops_per_step=flops["model_flops"],
        hardware_flops_per_step=flops["hardware_flops"],
        tokens_per_s=lay.batch_size * model.seq_len / step,
        tflops_per_gpu=tflops,
        model_tflops_per_gpu=model_tflops,
        mfu=model_tflops * 1e12 / peak,
        hfu=tflops * 1e12 / peak,
    )


def plan(
    model: ModelConfig,
    lay: Layout,
    cluster: Cluster | None = None,
    eff: Efficiency | None = None,
    padded: bool = False,
) -> dict:
    """Memory per GPU, step time and throughput of `lay` on `cluster`. Returns a flat dict
    (the JSON the command line prints): what was planned, then `memory.Memory`,
    `time.StepTime`, `time.Links` and `Throughput`. Sizes in bytes, times in seconds.
    `padded`: ZeRO shards padded to a multiple of dp, as hplab allocates them."""
    cluster, eff = cluster or Cluster(GPU_PRESETS["a100-80g"]), eff or Efficiency()
    if lay.batch_size is None:  # a layout that fixes no batch: the planner's default
        lay = replace(lay, batch_size=DEFAULT_BATCH_SIZE)
    check_layout(model, lay)
    stage = params_per_stage(model, lay.tp, lay.pp, lay.ep)
    acts = activation_memory(model, lay)
    flops = flops_per_step(model, lay.batch_size, lay.recompute)
    memory = memory_per_gpu(model, lay, cluster, eff, padded, stage, acts)
    time, links = step_time(model, lay, cluster, eff, flops, stage, acts)
    done = throughput(model, lay, cluster, flops, time.step_time_s)
    merged = header(model, lay, cluster)
    for part in (memory, time, links, done):
        merged |= vars(part)  # its fields in order: `asdict` without deep copies of numbers
    return merged
