"""The planner: how much memory a layout needs on each GPU, how long a step takes, and why.

What hplab measures in its runs (memory by kind, time, bytes sent) this package predicts with
the papers' formulas (`hplab.plan.formulas`), so a learner can put the two side by side, then ask
the formulas about clusters no laptop has:

    python -m hplab.plan --model gpt2 --dp 8 --zero 1 --precision bf16 --gpu a100-80g
    python -m hplab.plan --model gpt3-175b --search --gpus 1024 --gpu a100-80g
    python -m hplab.plan --params 7.5e9 --dp 64 --zero 3 --precision bf16
    python -m hplab.plan ... --json          # the same numbers for a notebook

Memory per GPU = model states (parameters, gradients, optimizer state, fp32 master weights;
sharded by ZeRO over data × context parallel, split by tensor, pipeline and expert parallel) +
activations (per layer per microbatch of s/cp tokens × layers on a stage × microbatches the
schedule keeps in flight). Step time = compute of the busiest stage (FLOPs ÷ achievable FLOP/s,
plus memory-bound element-wise work) + tensor-, context- and expert-parallel traffic +
pipeline bubble and sends + the exposed data-parallel and ZeRO traffic. Collectives follow the
α-β model of ring algorithms; ranks are numbered as in `hplab.parallel.mesh` (tensor parallel
innermost, then context, data (expert parallel within it), pipeline), which decides which groups
stay inside a node's fast links. Every efficiency assumption is a field of `Efficiency`, never
a hidden constant. No torch here: the package loads fast on machines without a GPU.

The model is `config.ModelConfig`, the one description hplab's models are built from; the
layout is `config.Layout`, checked by `config.validate` for what can run at all (not only what
hplab composes today, so the planner also prices layouts hplab refuses). Read in this order:

    presets.py    the models, their batch sizes, the GPUs, `Cluster` and `Efficiency`
    memory.py     parameters per stage, activations, memory per GPU (`Memory`)
    time.py       compute, tp/cp/ep traffic, pipeline, data parallel, offload (`StepTime`)
    estimate.py   `plan`: one layout, as one flat dict (the JSON)
    search_layouts.py  every layout of N GPUs, ranked, and why the winner wins
    cli.py        `python -m hplab.plan`

Sources: [ZeRO] Rajbhandari et al., SC 2020 (memory Sec. 3, 5; communication Sec. 7).
[PTD-P] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (FLOPs; bubble Sec. 2.2; pipeline sends Sec. 4.1; Table 1 TFLOP/s).
[SP] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022
(activations Sec. 4, Table 2). [Ring] Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009.
[ZB] Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024. [GPT-3] Brown et al., 2020.
Context parallel: Liu et al. 2023 (ring attention), Jacobs et al. 2023 (Ulysses). Experts:
Lepikhin et al. 2021 (GShard), Fedus et al. 2022 (Switch Transformers).
"""

from __future__ import annotations

import importlib

# The names of the planner, each imported from its module on first use: `hplab.plan.formulas`
# (which `hplab.config` imports) loads without the planner, and `import hplab.plan` stays cheap.
# The model, the layout and the formulas live in hplab.config and hplab.plan.formulas;
# `plan.Layout`, `plan.model_state_bytes` & co. are the same objects.
_HOME = {
    "Layout": "hplab.config",
    "LayoutError": "hplab.config",
    "ModelConfig": "hplab.config",
    "RECOMPUTE": "hplab.config",
    "build_parser": "hplab.plan.cli",
    "format_plan": "hplab.plan.cli",
    "format_search": "hplab.plan.cli",
    "main": "hplab.plan.cli",
    "PlanError": "hplab.plan.estimate",
    "check_layout": "hplab.plan.estimate",
    "plan": "hplab.plan.estimate",
    "CP_STYLES": "hplab.plan.formulas",
    "PRECISION_BYTES": "hplab.plan.formulas",
    "SCHEDULES": "hplab.plan.formulas",
    "activation_bytes_per_layer": "hplab.plan.formulas",
    "bubble_formula": "hplab.plan.formulas",
    "bubble_ratio": "hplab.plan.formulas",
    "collective_time_s": "hplab.plan.formulas",
    "flops_per_step": "hplab.plan.formulas",
    "gpt_num_params": "hplab.plan.formulas",
    "in_flight_microbatches": "hplab.plan.formulas",
    "model_state_bytes": "hplab.plan.formulas",
    "moe_all_to_all_bytes": "hplab.plan.formulas",
    "ring_attention_bytes": "hplab.plan.formulas",
    "ulysses_bytes": "hplab.plan.formulas",
    "activation_memory": "hplab.plan.memory",
    "params_per_stage": "hplab.plan.memory",
    "Cluster": "hplab.plan.presets",
    "Efficiency": "hplab.plan.presets",
    "GB": "hplab.plan.presets",
    "GIB": "hplab.plan.presets",
    "GPT3_PRESETS": "hplab.plan.presets",
    "GPU": "hplab.plan.presets",
    "GPU_PRESETS": "hplab.plan.presets",
    "MEGATRON_2021_PRESETS": "hplab.plan.presets",
    "default_batch_size": "hplab.plan.presets",
    "model_presets": "hplab.plan.presets",
    "candidate_layouts": "hplab.plan.search_layouts",
    "explain": "hplab.plan.search_layouts",
    "search": "hplab.plan.search_layouts",
    "group_link": "hplab.plan.time",
    "HPLAB_PRESETS": "hplab.presets",
}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'hplab.plan' has no attribute {name!r}")


__all__ = [
    "CP_STYLES",
    "GB",
    "GIB",
    "GPT3_PRESETS",
    "GPU",
    "GPU_PRESETS",
    "HPLAB_PRESETS",
    "MEGATRON_2021_PRESETS",
    "PRECISION_BYTES",
    "RECOMPUTE",
    "SCHEDULES",
    "Cluster",
    "Efficiency",
    "Layout",
    "LayoutError",
    "ModelConfig",
    "PlanError",
    "activation_bytes_per_layer",
    "activation_memory",
    "bubble_formula",
    "bubble_ratio",
    "build_parser",
    "candidate_layouts",
    "check_layout",
    "collective_time_s",
    "default_batch_size",
    "explain",
    "flops_per_step",
    "format_plan",
    "format_search",
    "gpt_num_params",
    "group_link",
    "in_flight_microbatches",
    "main",
    "model_presets",
    "model_state_bytes",
    "moe_all_to_all_bytes",
    "params_per_stage",
    "plan",
    "ring_attention_bytes",
    "search",
    "ulysses_bytes",
]
