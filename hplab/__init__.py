"""hplab: the ways large language models are trained on many devices, built from scratch.

The building blocks are used the way PyTorch's own are, in an ordinary training loop (README,
docs/strategies.md): `hplab.DDP`, `hplab.ZeroOptimizer`, `hplab.fully_shard` (ZeRO-3, like FSDP2),
`hplab.tp`, `hplab.pp`, `hplab.cp`, `hplab.moe`; `hplab.parallelize(model, mesh, layout)` (a
`hplab.Layout`, checked by `hplab.validate`) composes them for a whole layout and returns the
model, `hplab.build_optimizer` and `hplab.build_lr_scheduler` build what steps it beside it,
`hplab.TrainState` holds the four for `hplab.train_step`, and `hplab.sync_gradients` does every
sync after backward; `print(hplab.placement(model))` shows where each parameter lives. Names
are imported on first use, so `import hplab` stays cheap (torch loads when needed). The
course's tools live in `hplab.course` (the library never imports it); `hplab.lab`, `hplab.viz`,
`hplab.timeline` and `hplab.collectives_bench` are names for its modules, as learners have
always typed them.
"""

import importlib

_PUBLIC = {
    name: module
    for module, names in {  # name -> the module that defines it
        "hplab.parallel.ddp": ["DDP"],
        "hplab.parallel.sync": ["DoubleSyncError"],
        "hplab.parallel.zero": ["ZeroOptimizer"],
        "hplab.parallel.fsdp": ["fully_shard", "FSDPModule"],
        "hplab.sharded_state": ["full_parameters"],
        "hplab.parallel.mesh": ["Mesh"],
        "hplab.observe.placement_table": ["placement"],
        "hplab.runtime.group": ["init_distributed"],
        "hplab.parallel.compose": ["finish_gradient_sync", "parallelize", "sync_gradients"],
        "hplab.training": [
            "build_optimizer",
            "build_lr_scheduler",
            "TrainState",
            "mark_no_decay",
            "train_step",
        ],
        "hplab.config": ["Layout", "ModelConfig", "OptimConfig", "LayoutError", "validate"],
    }.items()
    for name in names
}
# The rooms (README's layout section says why each exists), and the strategies by their short
# names: `hplab.tp` is `hplab.parallel.tp`, as learners type it.
_MODULES = {
    "parallel",
    "models",
    "runtime",
    "observe",
    "plan",
    "course",
    "checkpoint",
    "cli",
    "config",
    "data",
    "flags",
    "preflight",
    "sample",
    "check",
    "training",
}
_STRATEGIES = {
    "ddp",
    "zero",
    "fsdp",
    "precision",
    "tp",
    "pp",
    "schedule",
    "cp",
    "moe",
    "compose",
}
_COURSE = {"lab", "viz", "timeline", "collectives_bench"}  # hplab.<name> is hplab.course.<name>

__all__ = sorted(_PUBLIC) + sorted(_MODULES | _STRATEGIES | _COURSE)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"hplab.{name}")
    if name in _STRATEGIES:
        return importlib.import_module(f"hplab.parallel.{name}")
    if name in _COURSE:
        return importlib.import_module(f"hplab.course.{name}")
    raise AttributeError(f"module 'hplab' has no attribute {name!r}")


def __dir__():
    return __all__
