"""The public API (`import hplab`): cheap to import, the building blocks under their names.
(The size budgets per part live in tests/test_house.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "hplab"
PUBLIC = [
    "DDP",
    "ZeroOptimizer",
    "fully_shard",
    "FSDPModule",
    "full_parameters",
    "finish_gradient_sync",
    "parallelize",
    "build_optimizer",
    "build_lr_scheduler",
    "TrainState",
    "sync_gradients",
    "Mesh",
    "placement",
    "init_distributed",
    "tp",
    "pp",
]


def test_import_hplab_is_cheap_and_lazy():
    """`import hplab` loads no torch; each public name is there when first used."""
    code = (
        "import sys, hplab; assert 'torch' not in sys.modules, 'torch imported eagerly'; "
        f"names = {PUBLIC!r}; missing = [n for n in names if not hasattr(hplab, n)]; "
        "assert not missing, missing; assert set(names) <= set(dir(hplab))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_public_names_are_the_building_blocks():
    import torch

    import hplab
    from hplab import training
    from hplab.parallel import compose, ddp, fsdp, zero

    assert hplab.DDP is ddp.DDP and issubclass(hplab.DDP, torch.nn.Module)
    assert hplab.ZeroOptimizer is zero.ZeroOptimizer
    assert issubclass(hplab.ZeroOptimizer, torch.optim.Optimizer)
    assert hplab.fully_shard is fsdp.fully_shard
    assert hplab.parallelize is compose.parallelize
    assert hplab.build_optimizer is training.build_optimizer
    assert hplab.build_lr_scheduler is training.build_lr_scheduler
    assert hplab.TrainState is training.TrainState
    assert hplab.FSDPModule is fsdp.FSDPModule
    assert hplab.sync_gradients is compose.sync_gradients
    with pytest.raises(AttributeError):
        hplab.DataParallelEngine  # noqa: B018 — the engine classes are gone
