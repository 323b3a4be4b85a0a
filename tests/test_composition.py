"""Every pair of hplab's 17 features composes, and trains the model one process trains.

The features (`FEATURES`): dp, ZeRO-1, ZeRO-2, ZeRO-3, tp, sp, the three pipeline schedules
(1F1B, interleaved, ZB-H1), context parallel's ring and Ulysses, ep, full and selective
recompute, bf16, fp16 and offload. Of their 136 pairs, 9 are two choices of one setting (two
ZeRO stages, two schedules, ...) and 7 are refused with a reason (`hplab.refusals`,
docs/command-line.md): `test_every_pair_is_in_a_layout_or_refused_for_a_reason` checks both
lists against `LAYOUTS`, which hold every other pair at least once — in an fp32 layout, where
the check is exact, unless the pair has a precision in it. The first three are the frontier
layouts of lab 06 (Llama-3, DeepSeek-V3 and Megatron-Mixtral style, 8 ranks each), the fourth
the planner's GPT-3 winner in miniature; the rest were picked greedily (most pairs not yet held
per rank) from the layouts `config.validate` accepts.

Each layout trains 3 AdamW steps (clipped, decayed, 2 microbatches) and is compared with one
process on the same global batch: fp32 losses and the whole model to 1e-5 relative; bf16 and
fp16 against one process in that precision, as tests/test_hybrid.py does (losses within 2⁻⁸,
updates no further apart than twice what the precision itself moves them from fp32). Layouts
with experts train a mixture of experts with DeepSeek-V3's sequence-wise balance loss, which
does not depend on how the batch is cut (the batch-wide one is counted per microbatch).
One launch per world size (8, 4, 2) runs all its layouts.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hplab.checkpoint import gather_full_state
from hplab.runtime.launch import run_distributed

STEPS, GLOBAL_BATCH, RTOL = 3, 8, 1e-5
DENSE = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=4, n_head=4)
EXPERTS = dict(DENSE, n_experts=4, moe_top_k=2, moe_aux_coef=0.05, moe_balance="sequence")
TRAINING = dict(lr=1e-3, weight_decay=0.1, grad_clip=0.5)

FEATURES = {  # name: (the setting it is a choice of, whether a layout has it)
    "dp": ("dp", lambda c: c.dp > 1),
    "zero1": ("zero", lambda c: c.zero == 1),
    "zero2": ("zero", lambda c: c.zero == 2),
    "zero3": ("zero", lambda c: c.zero == 3),
    "tp": ("tp", lambda c: c.tp > 1),
    "sp": ("sp", lambda c: c.sequence_parallel),
    "1f1b": ("schedule", lambda c: c.pp > 1 and c.schedule == "1f1b"),
    "interleaved": ("schedule", lambda c: c.pp > 1 and c.schedule == "interleaved"),
    "zb-h1": ("schedule", lambda c: c.pp > 1 and c.schedule == "zb-h1"),
    "cp ring": ("cp", lambda c: c.cp > 1 and c.cp_style == "ring"),
    "cp ulysses": ("cp", lambda c: c.cp > 1 and c.cp_style == "ulysses"),
    "ep": ("ep", lambda c: c.ep > 1),
    "recompute full": ("recompute", lambda c: c.recompute == "full"),
    "recompute selective": ("recompute", lambda c: c.recompute == "selective"),
    "bf16": ("precision", lambda c: c.precision == "bf16"),
    "fp16": ("precision", lambda c: c.precision == "fp16"),
    "offload": ("offload", lambda c: c.offload),
}
HALF = ("bf16", "fp16")

LAYOUTS = {
    # lab 06's frontier layouts: Llama 3 (tp × cp × pp, ZeRO-1 over dp × cp, sp), DeepSeek-V3
    # (pipeline × experts × ZeRO-1; ZB-H1 for its DualPipe), Megatron's Mixtral (tp ep pp dp)
    "tp2 cp2 ring pp2 1f1b zero1 sp": dict(tp=2, cp=2, pp=2, zero=1, sequence_parallel=True),
    "dp4 pp2 zb-h1 ep2 zero1": dict(dp=4, pp=2, schedule="zb-h1", ep=2, zero=1),
    "dp2 tp2 pp2 1f1b ep2 zero1 sp": dict(dp=2, tp=2, pp=2, ep=2, zero=1, sequence_parallel=True),
    # the planner's GPT-3 175B winner on 1024 GPUs, scaled down (docs/strategies.md, lab 07)
    "dp2 tp2 pp2 zb-h1 zero1 sp recompute selective": dict(
        dp=2, tp=2, pp=2, schedule="zb-h1", zero=1, sequence_parallel=True, recompute="selective"
    ),
    # the rest of the pairs
    "dp2 tp2 ep2 zero2 sp recompute full offload": dict(
        dp=2, tp=2, ep=2, zero=2, sequence_parallel=True, recompute="full", offload=True
    ),
    "dp2 pp2 interleaved ep2 zero1 recompute selective offload": dict(
        dp=2,
        pp=2,
        schedule="interleaved",
        virtual_stages=2,
        ep=2,
        zero=1,
        recompute="selective",
        offload=True,
    ),  # fmt: skip
    "tp2 cp2 ulysses zero3 sp recompute full offload": dict(
        tp=2,
        cp=2,
        cp_style="ulysses",
        zero=3,
        sequence_parallel=True,
        recompute="full",
        offload=True,
    ),  # fmt: skip
    "cp2 ring pp2 zb-h1 zero1 recompute full offload": dict(
        cp=2, pp=2, schedule="zb-h1", zero=1, recompute="full", offload=True
    ),
    "tp2 pp2 zb-h1 sp recompute selective": dict(
        tp=2, pp=2, schedule="zb-h1", sequence_parallel=True, recompute="selective"
    ),
    "cp2 ulysses pp2 1f1b zero2 recompute full offload": dict(
        cp=2, cp_style="ulysses", pp=2, zero=2, recompute="full", offload=True
    ),
    "cp2 ring pp2 interleaved zero2 recompute full": dict(
        cp=2, pp=2, schedule="interleaved", virtual_stages=2, zero=2, recompute="full"
    ),
    "dp2 cp2 ulysses ep2 zero1": dict(dp=2, cp=2, cp_style="ulysses", ep=2, zero=1),
    "dp2 cp2 ring zero3": dict(dp=2, cp=2, zero=3),
    "tp2 pp2 interleaved sp": dict(
        tp=2, pp=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True
    ),
    "dp2 pp2 1f1b zero2 recompute selective": dict(dp=2, pp=2, zero=2, recompute="selective"),
    "dp2 zero3 recompute selective": dict(dp=2, zero=3, recompute="selective"),
    "cp2 ulysses pp2 interleaved": dict(
        cp=2, cp_style="ulysses", pp=2, schedule="interleaved", virtual_stages=2
    ),
    "cp2 ulysses pp2 zb-h1": dict(cp=2, cp_style="ulysses", pp=2, schedule="zb-h1"),
    "dp2 cp2 ring ep2": dict(dp=2, cp=2, ep=2),
    # each precision with the rest
    **{
        f"{name} {precision}": dict(layout, precision=precision)
        for precision in HALF
        for name, layout in {
            "dp2 ep2 zero1 recompute full offload": dict(
                dp=2, ep=2, zero=1, recompute="full", offload=True
            ),
            "tp2 sp recompute selective": dict(tp=2, sequence_parallel=True, recompute="selective"),
            "cp2 ring pp2 1f1b zero2": dict(cp=2, pp=2, zero=2),
            "cp2 ulysses zero3": dict(cp=2, cp_style="ulysses", zero=3),
            "pp2 interleaved": dict(pp=2, schedule="interleaved", virtual_stages=2),
            "pp2 zb-h1": dict(pp=2, schedule="zb-h1"),
        }.items()
    },
}


def layout_of(settings: dict):
    from hplab.config import Layout

    return Layout(microbatches=2, bucket_mb=0.01, batch_size=GLOBAL_BATCH, **settings)


def model_of(settings: dict, experts: bool | None = None):
    """The dense model, or (with ep, or `experts`) the mixture of experts."""
    from hplab.models.gpt import GPTConfig

    experts = settings.get("ep", 1) > 1 if experts is None else experts
    return GPTConfig(**(EXPERTS if experts else DENSE))


def features(settings: dict) -> set[str]:
    layout = layout_of(settings)
    return {name for name, (_, has) in FEATURES.items() if has(layout)}


def world_of(settings: dict) -> int:
    c = layout_of(settings)
    return c.dp * c.tp * c.pp * c.cp


def batches():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, DENSE["vocab_size"], (STEPS, GLOBAL_BATCH, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(settings: dict, meshes: dict, experts: bool | None = None) -> dict:
    """STEPS steps of `settings` on this rank's share; rank 0 returns the losses and the
    gathered single-device model (numpy: tensors do not cross a finished process's queue)."""
    import torch.distributed as dist

    from hplab.config import OptimConfig
    from hplab.models.gpt import build_model
    from hplab.parallel.compose import parallelize
    from hplab.parallel.mesh import Mesh
    from hplab.training import TrainState, build_lr_scheduler, build_optimizer, train_step

    c = layout_of(settings)
    key = (c.dp, c.tp, c.pp, c.cp, c.ep)
    if key not in meshes:
        meshes[key] = Mesh(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp, ep=c.ep)
    mesh = meshes[key]
    optim = OptimConfig(**TRAINING)
    model = parallelize(build_model(model_of(settings, experts), 0), mesh, c)
    optimizer = build_optimizer(model, mesh, c, optim)
    par = TrainState(model, optimizer, build_lr_scheduler(optimizer, optim), mesh, c, optim)
    share = GLOBAL_BATCH // mesh.dp_size
    mine = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    losses = [train_step(par, x[mine], y[mine]) for x, y in batches()]
    model = gather_full_state(par)[0]
    if dist.get_rank() == 0:
        return {"losses": losses, "model": {n: t.numpy().copy() for n, t in model.items()}}
    return None


def run_world(world: int) -> dict:
    """Every layout of `world` ranks, one after another in the same processes."""
    meshes = {}
    return {
        name: train(settings, meshes)
        for name, settings in LAYOUTS.items()
        if world_of(settings) == world
    }


def run_one_process() -> dict:
    """hplab on one process in bf16 and fp16, dense and with experts: the mixed-precision
    references (their fp32 twins are plain PyTorch, `torch_reference`)."""
    return {
        (kind, precision): train(dict(precision=precision), {}, kind == "experts")
        for kind in ("dense", "experts")
        for precision in HALF
    }


def torch_reference(config: dict) -> dict:
    """Plain PyTorch: the model on the whole batch, AdamW, clip_grad_norm_."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.training import make_optimizer

    model = build_model(GPTConfig(**config), 0)
    optimizer = make_optimizer(model.parameters(), TRAINING["lr"], TRAINING["weight_decay"])
    losses = []
    for x, y in batches():
        loss = model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "model": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = {}
    for world in (8, 4, 2):  # one launch each
        out.update(run_distributed(run_world, world, world, timeout_s=400)[0])
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    kinds = (("dense", DENSE), ("experts", EXPERTS))
    refs = {(kind, "fp32"): torch_reference(config) for kind, config in kinds}
    return refs | run_distributed(run_one_process, 1)[0]


SMALLEST = {  # the least each feature needs, to build a layout with any two of them
    "dp": dict(dp=2),
    "zero1": dict(zero=1),
    "zero2": dict(zero=2),
    "zero3": dict(zero=3),
    "tp": dict(tp=2),
    "sp": dict(tp=2, sequence_parallel=True),
    "1f1b": dict(pp=2),
    "interleaved": dict(pp=2, schedule="interleaved", virtual_stages=2),
    "zb-h1": dict(pp=2, schedule="zb-h1"),
    "cp ring": dict(cp=2),
    "cp ulysses": dict(cp=2, cp_style="ulysses"),
    "ep": dict(dp=2, ep=2),
    "recompute full": dict(recompute="full"),
    "recompute selective": dict(recompute="selective"),
    "bf16": dict(precision="bf16"),
    "fp16": dict(precision="fp16"),
    "offload": dict(offload=True),
}


def test_every_pair_is_in_a_layout_or_refused_for_a_reason():
    """Each pair of features is two choices of one setting (9 pairs), or held by a layout of
    LAYOUTS that `validate` accepts (in fp32 unless the pair names a precision), or refused
    with one of hplab.refusals' reasons (7: ZeRO-3 with each schedule and with experts, ZeRO-2 with
    ZB-H1, selective recompute with each context-parallel style) — nothing else."""
    from hplab.config import LayoutError, validate
    from hplab.refusals import REFUSALS

    held = set()
    for settings in LAYOUTS.values():
        validate(layout_of(settings), model_of(settings), world_of(settings))
        have = features(settings)
        fp32 = not have & set(HALF)
        held |= {
            frozenset(p) for p in itertools.combinations(have, 2) if fp32 or set(p) & set(HALF)
        }
    exclusive, refused = [], []
    for a, b in itertools.combinations(FEATURES, 2):
        if FEATURES[a][0] == FEATURES[b][0]:
            exclusive.append((a, b))
        elif frozenset((a, b)) not in held:
            settings = SMALLEST[a] | SMALLEST[b]
            if settings.get("offload") and not settings.get("zero"):
                settings["zero"] = 1
            if settings.get("zero") and settings.get("dp", 1) * settings.get("cp", 1) == 1:
                settings["dp"] = 2
            with pytest.raises(LayoutError) as refusal:
                validate(layout_of(settings), model_of(settings), world_of(settings))
            assert any(reason in str(refusal.value) for *_, reason in REFUSALS), (a, b)
            refused.append((a, b))
    assert len(exclusive) == 9, exclusive
    assert sorted(refused) == sorted(
        [
            ("zero2", "zb-h1"),
            ("zero3", "1f1b"),
            ("zero3", "interleaved"),
            ("zero3", "zb-h1"),
            ("zero3", "ep"),
            ("cp ring", "recompute selective"),
            ("cp ulysses", "recompute selective"),
        ]
    )
    assert len(held) == 136 - 9 - 7


def model_rel_err(ours: dict, ref: dict) -> float:
    """max|a − b| / max|b| over the whole model: AdamW moves an element whose gradient is
    rounding noise (the attention key bias's) by ~lr in no agreed direction, so the model is
    compared as one vector (tests/test_ddp.py)."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    worst = max(float((torch.as_tensor(ours[n]) - ref[n]).abs().max()) for n in ref)
    return worst / max(float(torch.as_tensor(t).abs().max()) for t in ref.values())


def update_rel_err(ours: dict, ref: dict, initial: dict) -> float:
    """||Δours − Δref|| / ||Δref||, Δ = what training moved the weights (tests/test_hybrid.py:
    in half precision the weights agree to many digits whatever happens; the updates do not)."""
    diff = sum(
        float((torch.as_tensor(ours[n]) - torch.as_tensor(ref[n])).square().sum()) for n in ref
    )
    moved = sum(float((torch.as_tensor(ref[n]) - initial[n]).square().sum()) for n in ref)
    return (diff / moved) ** 0.5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_the_model_one_process_trains(runs, references, name):
    from hplab.models.gpt import build_model

    settings, got = LAYOUTS[name], runs[name]
    kind = "experts" if settings.get("ep", 1) > 1 else "dense"
    fp32, precision = references[kind, "fp32"], settings.get("precision", "fp32")
    if precision == "fp32":
        assert got["losses"] == pytest.approx(fp32["losses"], rel=RTOL, abs=0)
        assert model_rel_err(got["model"], fp32["model"]) < RTOL
        return
    one = references[kind, precision]
    assert got["losses"] == pytest.approx(one["losses"], rel=2**-8, abs=0)
    initial = {n: p.detach() for n, p in build_model(model_of(settings), 0).named_parameters()}
    precision_noise = update_rel_err(one["model"], fp32["model"], initial)
    assert 0 < precision_noise < 0.2  # the precision did change the updates, a little
    assert update_rel_err(got["model"], one["model"], initial) < 2 * precision_noise
