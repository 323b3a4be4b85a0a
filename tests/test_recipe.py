"""The seeds' training recipe (issue 14): a learning-rate schedule (warm-up, then constant,
linear or cosine decay to --min-lr) and no weight decay on biases, layer norms and embeddings.

The schedule is checked against its closed form (`formulas.learning_rate`) without processes;
one 2-process launch then trains ZeRO 1, 2, 3, tp 2 and pp 2 with both on and compares every
parameter with one process running torch's own AdamW + LambdaLR, groups chosen by name here
(fp32, 1e-5 relative), checks that the lr reaching the optimizer that really steps (masters,
shards) is the scheduled one, and resumes a run saved mid-warm-up under another layout.
"""

from __future__ import annotations

import functools
import json
import math
import shutil

import pytest
import torch

from hplab import train
from hplab.plan.formulas import learning_rate
from hplab.runtime.launch import run_distributed

RTOL = 1e-5
STEPS = 4
CONFIG = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=2, n_head=4)
GLOBAL_BATCH = 8
RECIPE = dict(
    lr=3e-3, weight_decay=0.5, warmup_steps=2, lr_decay="cosine", decay_steps=STEPS, min_lr=3e-4
)
LAYOUTS = {
    "dp2 zero1": dict(dp=2, zero=1),
    "dp2 zero2": dict(dp=2, zero=2),
    "dp2 zero3": dict(dp=2, zero=3),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2, microbatches=2),
    "dp2 bf16": dict(dp=2, precision="bf16"),
}  # bf16: only its lr and groups are checked


def schedule(step: int) -> float:
    return learning_rate(
        step,
        RECIPE["lr"],
        RECIPE["warmup_steps"],
        RECIPE["lr_decay"],
        RECIPE["decay_steps"],
        RECIPE["min_lr"],
    )


# --- the closed form ----------------------------------------------------------------------------


def test_learning_rate_warms_up_then_decays_to_min_lr():
    lr, low = 1.0, 0.1
    assert [learning_rate(s, lr, 4) for s in range(6)] == [0, 0.25, 0.5, 0.75, 1, 1]
    linear = [learning_rate(s, lr, 2, "linear", 6, low) for s in range(8)]
    assert linear == pytest.approx([0, 0.5, 1, 0.775, 0.55, 0.325, 0.1, 0.1], rel=1e-12)
    cosine = [learning_rate(s, lr, 0, "cosine", 4, low) for s in range(6)]
    expected = [low + (lr - low) * (1 + math.cos(math.pi * s / 4)) / 2 for s in range(5)]
    assert cosine == pytest.approx(expected + [low], rel=1e-12)
    assert cosine[2] == pytest.approx(0.55, rel=1e-12)  # halfway: the mean of lr and min_lr
    with pytest.raises(ValueError, match="unknown lr decay 'step'"):
        learning_rate(0, lr, decay="step")


def test_lambda_lr_over_the_formula_reaches_the_masters_of_mixed_precision():
    """MasterWeightOptimizer copies each group's lr to the fp32 optimizer it steps."""
    from hplab.parallel.precision import MasterWeightOptimizer

    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer([p], torch.optim.AdamW, lr=RECIPE["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: schedule(i) / RECIPE["lr"])
    seen = []
    for _ in range(STEPS):
        p.grad = torch.ones_like(p)
        opt.step()
        seen.append(opt.inner.param_groups[0]["lr"])
        sched.step()
    assert seen == pytest.approx([schedule(s) for s in range(STEPS)], rel=1e-12)
    assert seen[0] == 0 and seen[-1] != seen[-2]  # warm-up from 0, then decay


def test_parameter_groups_decay_only_the_matrices_of_linear_layers():
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.training import mark_no_decay, parameter_groups

    model = build_model(GPTConfig(**CONFIG), 0)
    names = {p: n for n, p in model.named_parameters()}
    assert [g["weight_decay"] for g in parameter_groups(model.parameters(), weight_decay=0.1)] == [
        0.1
    ]  # unmarked: one group, as before
    mark_no_decay(model)
    groups = parameter_groups(model.parameters(), weight_decay=0.1)
    decayed = {names[p] for g in groups if g["weight_decay"] for p in g["params"]}
    assert decayed == {n for n in names.values() if is_decayed(n)} and len(decayed) == 8


def is_decayed(name: str) -> bool:
    """The seeds' rule, by name: not biases, layer norms (ln_*) or embeddings (wte, wpe)."""
    return not (name.endswith("bias") or ".ln_" in name or name.split(".")[-2] in ("wte", "wpe"))


# --- bad inputs: one line each, before any process starts -----------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--warmup-steps", "200"], "the warm-up (200 steps) is longer than the run (--steps 100)"),
        (["--warmup-fraction", "1.5", "--steps", "10"], "the warm-up (15 steps) is longer"),
        (["--min-lr", "0.01"], "--min-lr 0.01 is above --lr 0.001"),
        (["--warmup-steps", "-1"], "--warmup-steps: must be at least 0, got -1"),
        (["--min-lr=-1e-5"], "--min-lr: must be at least 0, got -1e-5"),
        (["--warmup-fraction", "-0.1"], "--warmup-fraction: must be at least 0"),
        (["--decay-steps", "0"], "--decay-steps: must be at least 1"),
        (
            ["--warmup-steps", "2", "--warmup-fraction", "0.1"],
            "--warmup-steps or --warmup-fraction",
        ),
        (
            ["--lr-decay", "linear", "--warmup-steps", "5", "--decay-steps", "5"],
            "--decay-steps 5 must be larger than the warm-up (5 steps)",
        ),
        (
            ["--no-decay-bias-norm", "--decay-bias-norm"],
            "--no-decay-bias-norm or --decay-bias-norm",
        ),
    ],
)
def test_a_bad_schedule_is_one_line_before_any_process(flags, message, capsys):
    assert train.main(["--nproc", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("flags", "excluded"),
    [
        ([], False),
        (["--weight-decay", "0.1"], True),  # the seeds' recipe: on with weight decay
        (["--weight-decay", "0.1", "--decay-bias-norm"], False),
        (["--no-decay-bias-norm"], False),
    ],
)
def test_biases_and_norms_skip_weight_decay_by_default(flags, excluded):
    args = train.parse_args(["--n-layer", "1", *flags])
    train.preflight(args, 1)
    assert args.no_decay_bias_norm is excluded  # (without weight decay there is none to skip)


# --- one 2-process launch: every layout against one process; a resume mid-warm-up --------------


def batches():
    out = []
    for step in range(STEPS):
        tokens = torch.randint(
            0,
            CONFIG["vocab_size"],
            (GLOBAL_BATCH, CONFIG["n_positions"] + 1),
            generator=torch.Generator().manual_seed(1000 + step),
        )
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


@functools.cache
def reference(weight_decay: float, by_name: bool = True) -> dict:
    """One process: torch's AdamW with the decayed matrices in their own group (`by_name`) or
    every parameter decayed, and torch's LambdaLR; the parameters after STEPS steps."""
    from hplab.models.gpt import GPTConfig, build_model

    model = build_model(GPTConfig(**CONFIG), 0)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if is_decayed(n) or not by_name]},
        {"params": [p for n, p in named if not is_decayed(n) and by_name], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=RECIPE["lr"], weight_decay=weight_decay, betas=(0.9, 0.95), foreach=False
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: schedule(i) / RECIPE["lr"])
    for x, y in batches():
        model(x, y)[1].backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _in_two_processes(directory: str) -> dict:
    from hplab.checkpoint import gather_full_state
    from hplab.config import Layout, OptimConfig
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel.compose import parallelize
    from hplab.parallel.mesh import Mesh
    from hplab.parallel.optim import WrappedOptimizer
    from hplab.training import (
        TrainState,
        build_lr_scheduler,
        build_optimizer,
        mark_no_decay,
        train_step,
    )

    out = {}
    for name, layout in LAYOUTS.items():
        mesh = Mesh(dp=layout.get("dp", 1), tp=layout.get("tp", 1), pp=layout.get("pp", 1))
        c = Layout(**layout, bucket_mb=0.001)
        optim = OptimConfig(**RECIPE, no_decay_bias_norm=True)
        model = build_model(GPTConfig(**CONFIG), 0)
        mark_no_decay(model)  # biases, norms, embeddings: by role, while the model is whole
        model = parallelize(model, mesh, c)
        optimizer = build_optimizer(model, mesh, c, optim)
        scheduler = build_lr_scheduler(optimizer, optim)
        par = TrainState(model, optimizer, scheduler, mesh, c, optim)
        share = GLOBAL_BATCH // mesh.dp_size
        mine = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
        stepped = []  # per step: (lr, weight decay) of each group the stepping optimizer has
        wrapped = isinstance(par.optimizer, WrappedOptimizer)  # masters, shards: its inner one
        (par.optimizer.inner if wrapped else par.optimizer).register_step_pre_hook(
            lambda opt, *_: stepped.append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])
        )
        for x, y in batches():
            train_step(par, x[mine], y[mine])
        state, _ = gather_full_state(par)
        out[name] = {"stepped": stepped, "state": {n: t.numpy().copy() for n, t in state.items()}}
    common = [
        "--no-progress",
        "--n-layer",
        "2",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "4",
        "--lr-decay",
        "linear",
        "--min-lr",
        "1e-4",
    ]
    runs = {
        "uninterrupted": ["--dp", "2", "--zero", "1", "--steps", "6"],
        "saved mid-warm-up": [
            "--dp",
            "2",
            "--steps",
            "2",
            "--decay-steps",
            "6",
            "--save",
            f"{directory}/b",
        ],
        "resumed": ["--tp", "2", "--steps", "6", "--resume", f"{directory}/b"],
    }
    for name, flags in runs.items():
        out[name] = train.run(train.parse_args(common + flags))
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("recipe")
    return run_distributed(_in_two_processes, 2, str(directory), timeout_s=300)[0], directory


def rel(a, b) -> float:
    return float((torch.as_tensor(a) - b).norm() / b.norm())


def without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """The key part of an attention bias zeroed: its true gradient is exactly 0 (softmax
    ignores a shift shared by all keys), so Adam turns its float noise into lr-sized steps of
    random sign that no two summation orders agree on (as in tests/test_pp.py)."""
    if not name.endswith("attn.c_attn.bias"):
        return t
    return torch.cat(
        [
            t[: CONFIG["n_embd"]],
            0 * t[CONFIG["n_embd"] : 2 * CONFIG["n_embd"]],
            t[2 * CONFIG["n_embd"] :],
        ]
    )


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if "bf16" not in name])
def test_no_decay_groups_and_schedule_equal_one_process(world2, layout):
    ours = {n: torch.from_numpy(t) for n, t in world2[0][layout]["state"].items()}
    want, uniform, none = reference(0.5), reference(0.5, by_name=False), reference(0.0)
    assert max(rel(without_key_bias(n, ours[n]), without_key_bias(n, want[n])) for n in want) < RTOL
    # the decay and the exclusion both changed the result far beyond the tolerance:
    assert max(rel(ours[n], none[n]) for n in want if is_decayed(n)) > 100 * RTOL
    assert max(rel(ours[n], uniform[n]) for n in want if not is_decayed(n)) > 100 * RTOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_stepping_optimizer_sees_the_scheduled_lr_and_the_groups_decay(world2, layout):
    stepped = world2[0][layout]["stepped"]  # as the inner optimizer's step began
    assert len(stepped) == STEPS
    for step, groups in enumerate(stepped):
        assert [lr for lr, _ in groups] == pytest.approx([schedule(step)] * len(groups), rel=1e-12)
        assert {wd for _, wd in groups} == {0.0, RECIPE["weight_decay"]}


def test_a_run_resumed_mid_warm_up_continues_lr_and_losses(world2):
    metrics, _ = world2
    whole, resumed = metrics["uninterrupted"]["steps"], metrics["resumed"]["steps"]
    assert [s["lr"] for s in whole] == pytest.approx(
        [learning_rate(s, 3e-3, 4, "linear", 6, 1e-4) for s in range(6)], rel=1e-12
    )
    assert [s["step"] for s in resumed] == [2, 3, 4, 5]
    assert [s["lr"] for s in resumed] == pytest.approx([s["lr"] for s in whole[2:]], rel=1e-12)
    assert max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(resumed, whole[2:])) < RTOL


def test_resuming_with_another_schedule_shape_is_refused_unless_the_checkpoint_has_none(
    world2, tmp_path, capsys
):
    saved = world2[1] / "b"
    flags = [
        "--nproc",
        "2",
        "--n-layer",
        "2",
        "--batch-size",
        "4",
        "--steps",
        "6",
        "--lr",
        "3e-3",
        "--resume",
    ]
    assert train.main(flags + [str(saved)]) == 2  # default: constant, no warm-up
    err = capsys.readouterr().err
    assert (
        "b continues its lr schedule: resume with --warmup-steps 4 --lr-decay linear "
        "--decay-steps 6 --min-lr 0.0001\n"
        in err
        and err.count("\n") == 1
    ), err
    same_shape = [
        "--warmup-steps",
        "4",
        "--lr-decay",
        "linear",
        "--decay-steps",
        "6",
        "--min-lr",
        "1e-4",
        "--lr",
        "2e-3",
    ]  # a new peak lr scales the schedule
    assert train.preflight(train.parse_args(flags[2:] + [str(saved)] + same_shape), 2).saved
    old = shutil.copytree(saved, tmp_path / "old")  # as saved before schedules existed
    state = json.loads((old / "trainer_state.json").read_text())
    del state["lr_scheduler"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    args = train.parse_args(flags[2:] + [str(old)])
    assert train.preflight(args, 2).saved["trainer_state"]["step"] == 2
