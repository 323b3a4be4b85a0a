"""hplab: the ways large language models are trained on many devices, built from scratch.

The building blocks are used the way PyTorch's own are, in an ordinary training loop (README,
"The strategies"): `hplab.DDP`, `hplab.ZeroOptimizer`, `hplab.fully_shard` (ZeRO-3, like FSDP2),
`hplab.tp`, `hplab.pp`, `hplab.cp`, `hplab.moe`; `hplab.parallelize(model, mesh, layout)` (a
`hplab.Layout`, checked by `hplab.validate`) and `hplab.finalize_grads` compose them for a whole
layout. Names are imported on first use, so
`import hplab` stays cheap (torch loads when needed).
"""

import importlib

_PUBLIC = {
    name: module
    for module, names in {  # name -> the module that defines it
        "hplab.ddp": ["DDP"],
        "hplab.zero": ["ZeroOptimizer"],
        "hplab.fsdp": ["fully_shard", "full_parameters"],
        "hplab.dist": ["Mesh", "init_distributed"],
        "hplab.compose": [
            "finish_gradient_sync",
            "parallelize",
            "finalize_grads",
            "train_step",
        ],
        "hplab.config": ["Layout", "ModelConfig", "OptimConfig", "LayoutError", "validate"],
    }.items()
    for name in names
}
_MODULES = {
    "tp",
    "pp",
    "comm",
    "dist",
    "memory",
    "plan",
    "formulas",
    "lab",
    "viz",
    "checkpoint",
    "data",
    "precision",
    "ddp",
    "zero",
    "fsdp",
    "models",
    "check",
    "compose",
    "schedule",
    "cp",
    "moe",
    "sample",
    "timeline",
    "config",
    "flags",
    "launch",
    "metrics",
    "observe",
    "optim",
    "cli",
    "preflight",
}

__all__ = sorted(_PUBLIC) + sorted(_MODULES)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"hplab.{name}")
    raise AttributeError(f"module 'hplab' has no attribute {name!r}")


def __dir__():
    return __all__
