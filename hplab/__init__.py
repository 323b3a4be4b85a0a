"""hplab: the ways large language models are trained on many devices, built from scratch.

The building blocks, used the way PyTorch's own are (in an ordinary training loop):

    hplab.DDP(module, group)                       like torch's DistributedDataParallel
    hplab.ZeroOptimizer(params, AdamW, stage=1|2)  like torch's ZeroRedundancyOptimizer
    hplab.fully_shard(block); hplab.fully_shard(model)   ZeRO-3, like torch's FSDP2
    hplab.full_parameters(model), hplab.finish_gradient_sync(model)
    hplab.tp.parallelize(model, group, plan)       Megatron-style tensor parallel
    hplab.pp                                       pipeline stages, schedules, executor
    hplab.cp.ring_attention, hplab.cp.ulysses_attention   context parallel
    hplab.moe.MoE                                  experts, routed; expert parallel

and their composition for a whole layout: `hplab.Mesh`, `hplab.init_distributed`,
`hplab.parallelize(model, mesh, config)` and `hplab.finalize_grads(model, mesh, optimizer)`.
Names are imported on first use, so `import hplab` stays cheap (torch loads when needed).
"""

import importlib

_PUBLIC = {name: module for module, names in {  # name -> the module that defines it
    "hplab.ddp": ["DDP"], "hplab.zero": ["ZeroOptimizer"],
    "hplab.fsdp": ["fully_shard", "full_parameters"], "hplab.dist": ["Mesh", "init_distributed"],
    "hplab.compose": ["finish_gradient_sync", "parallelize", "finalize_grads", "ParallelConfig",
                      "train_step"]}.items() for name in names}
_MODULES = {"tp", "pp", "comm", "dist", "memory", "plan", "formulas", "lab", "viz",
            "checkpoint", "data", "precision", "ddp", "zero", "fsdp", "models", "check",
            "compose", "schedule", "cp", "moe", "sample", "timeline"}

__all__ = sorted(_PUBLIC) + sorted(_MODULES)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"hplab.{name}")
    raise AttributeError(f"module 'hplab' has no attribute {name!r}")


def __dir__():
    return __all__
