"""Hybrid layouts' checkpoints that reshard, fp16's loss scale across a mesh, and the recipes.

Every pair of features composing into a layout that trains the model one process trains is
tests/test_composition.py's. Here: fp16 hybrids track one process in fp16, and an inf gradient
on ONE rank makes every rank skip the step; a checkpoint saved under tp2 × pp2 resumes under
dp4 + ZeRO-3, under tp4 and on one process with the losses of a run that never stopped, and
opens in Hugging Face's GPT2LMHeadModel.

Process start-up is expensive, so each world size runs ONE launch (a module-level worker that
trains every layout and returns plain numbers); the tests assert on those numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hplab.checkpoint import gather_full_state
from hplab.runtime.launch import run_distributed

REPO = Path(__file__).resolve().parent.parent
RTOL = 1e-5
HALF_LOSS_RTOL = 2e-2  # bf16/fp16 against fp32, as in tests/test_zero.py (8 / 11 significant
#                        bits: ~4e-3 / 5e-4 relative rounding per operation, a few compounded)
STEPS = 3
CONFIG = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=4, n_head=4)
GLOBAL_BATCH = 8  # sequences
TRAINING = dict(lr=1e-3, weight_decay=0.1, grad_clip=0.5)


def make_args(**layout):
    base = dict(
        dp=1,
        tp=1,
        pp=1,
        zero=0,
        schedule="1f1b",
        virtual_stages=1,
        microbatches=2,
        sequence_parallel=False,
        bucket_mb=0.01,
        precision="fp32",
        recompute="none",
        offload=False,
        **TRAINING,
    )
    return SimpleNamespace(**{**base, **layout})


def typed(args) -> tuple:
    """The library's configs from a namespace of flags: (Layout, OptimConfig)."""
    from hplab.config import Layout, OptimConfig, from_values

    return from_values(Layout, vars(args)), from_values(OptimConfig, vars(args))


def train_state(mesh, args):
    """What train.py builds for `args`: the model parallelized, its optimizer and schedule
    beside it, the four in a TrainState."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel.compose import parallelize
    from hplab.training import TrainState, build_lr_scheduler, build_optimizer, mark_no_decay

    layout, optim = typed(args)
    model = build_model(GPTConfig(**CONFIG), 0)
    if optim.no_decay_bias_norm:  # by role, while the model is whole
        mark_no_decay(model)
    model = parallelize(model, mesh, layout)
    optimizer = build_optimizer(model, mesh, layout, optim)
    scheduler = build_lr_scheduler(optimizer, optim)
    return TrainState(model, optimizer, scheduler, mesh, layout, optim)


def batches(n_steps: int, start: int = 0):
    """The global batches of steps start .. start+n_steps-1, the same in every process."""
    out = []
    for step in range(start, start + n_steps):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(
            0, CONFIG["vocab_size"], (GLOBAL_BATCH, CONFIG["n_positions"] + 1), generator=g
        )
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference(n_steps: int) -> tuple[list[float], list[dict]]:
    """One process, the whole global batch: losses and the parameters after every step."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.training import make_optimizer

    model = build_model(GPTConfig(**CONFIG), 0)
    optimizer = make_optimizer(model.parameters(), TRAINING["lr"], TRAINING["weight_decay"])
    losses, params = [], []
    for x, y in batches(n_steps):
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def train(mesh, args, steps: int = STEPS, start: int = 0, state=None):
    """Build the engine for `args` on `mesh`, optionally load a full state, train `steps`
    steps on this rank's share; return the losses and the engine."""
    from hplab.checkpoint import load_full_state
    from hplab.training import train_step

    engine = train_state(mesh, args)
    if state is not None:
        load_full_state(engine, *state)
    share = GLOBAL_BATCH // mesh.dp_size
    mine = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    losses = [train_step(engine, x[mine], y[mine]) for x, y in batches(steps, start)]
    return losses, engine


# Mixed precision in hybrids: every combination of precision with pipeline, tensor parallel,
# ZeRO and recompute tracks the fp32 run. fp16's loss scaler must agree across the whole mesh:
# an inf gradient on ONE rank (the last pipeline stage, the last tp and dp rank) must make
# every rank skip that step and halve its scale, or stages would step different models.
HALF_LAYOUTS_4 = {
    "dp2 pp2 zero1 fp16": dict(dp=2, pp=2, zero=1, precision="fp16"),
    "tp2 pp2 fp16 interleaved": dict(
        tp=2, pp=2, precision="fp16", schedule="interleaved", virtual_stages=2
    ),
}
INF_AT_STEP = 1


def local_parameters(engine) -> list:
    return [p for p in engine.decoder.parameters() if p.requires_grad]


def train_half(mesh, args, inject_inf: bool) -> dict:
    """Train `args` for STEPS steps; with `inject_inf`, the last rank's first parameter gets an
    inf gradient at step INF_AT_STEP. Every rank reports its loss scales and skipped steps;
    rank 0 also how much the full model moved at that step."""
    import math

    from hplab.training import train_step

    engine = train_state(mesh, args)
    share = GLOBAL_BATCH // mesh.dp_size
    mine = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    losses, scales, moved = [], [], None
    for step, (x, y) in enumerate(batches(STEPS)):
        hook = None
        if inject_inf and step == INF_AT_STEP:
            before = gather_full_state(engine)[0]
            if mesh.rank == mesh.world_size - 1:
                hook = local_parameters(engine)[0].register_hook(
                    lambda g: torch.full_like(g, math.inf)
                )
        scales.append(engine.precision.loss_scale)
        losses.append(train_step(engine, x[mine], y[mine]))
        if hook is not None:
            hook.remove()
        if inject_inf and step == INF_AT_STEP:
            after = gather_full_state(engine)[0]
            if mesh.rank == 0:  # where the gathered state is complete
                moved = max(float((after[n] - before[n]).abs().max()) for n in after)
    scales.append(engine.precision.loss_scale)
    final = {n: t.numpy().copy() for n, t in gather_full_state(engine)[0].items()}
    return {
        "losses": losses,
        "params": final,
        "scales": scales,
        "moved_at_inf": moved,
        "skipped": engine.precision.scaler.skipped_steps if engine.precision.scaler else 0,
    }


def run_half_layouts(layouts: dict[str, dict]) -> dict:
    """Per layout: its losses (rank 0), and from every rank its fp16 loss scales and skipped
    steps in a second run with an inf gradient injected on the last rank."""
    import torch.distributed as dist

    from hplab.parallel.mesh import Mesh

    out = {}
    for name, layout in layouts.items():
        mesh = Mesh(dp=layout.get("dp", 1), tp=layout.get("tp", 1), pp=layout.get("pp", 1))
        args = make_args(**layout)
        plain = train_half(mesh, args, inject_inf=False)
        out[name] = {"losses": plain["losses"], "params": plain["params"]}
        if layout["precision"] == "fp16":
            injected = train_half(mesh, args, inject_inf=True)
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, {k: injected[k] for k in ("scales", "skipped")})
            out[name].update(ranks=every_rank, moved_at_inf=injected["moved_at_inf"])
    return out


def _world8(directory: str) -> dict:
    import torch.distributed as dist

    results = {"configs": _run_configs(configs_of_size(8), directory)}
    return results if dist.get_rank() == 0 else None


def _world4(directory: str) -> dict:
    """The fp16 hybrids; then save under tp2 × pp2 after 3 steps and resume under
    dp4 + ZeRO-3 and under tp4 for 3 more."""
    import torch.distributed as dist

    from hplab import checkpoint
    from hplab.models.gpt import GPTConfig
    from hplab.parallel.mesh import Mesh

    results = {"half": run_half_layouts(HALF_LAYOUTS_4)}
    _, engine = train(Mesh(tp=2, pp=2), make_args(tp=2, pp=2))
    model_state, optimizer_state = gather_full_state(engine)
    if dist.get_rank() == 0:
        checkpoint.save(
            directory, GPTConfig(**CONFIG), model_state, optimizer_state, {"step": STEPS}
        )
    dist.barrier()
    saved = checkpoint.load(directory)
    state = (saved["model"], saved["optimizer"])
    for name, layout in {"dp4 zero3": dict(dp=4, zero=3), "tp4": dict(tp=4)}.items():
        mesh = Mesh(dp=layout.get("dp", 1), tp=layout.get("tp", 1))
        losses, _ = train(mesh, make_args(**layout), start=STEPS, state=state)
        results[f"resumed under {name}"] = losses
    results["configs"] = _run_configs(configs_of_size(4), directory + "-configs")
    return results if dist.get_rank() == 0 else None


def _world1(directory: str) -> list[float]:
    from hplab import checkpoint
    from hplab.parallel.mesh import Mesh

    saved = checkpoint.load(directory)
    losses, _ = train(Mesh(), make_args(), start=STEPS, state=(saved["model"], saved["optimizer"]))
    return losses


@pytest.fixture(scope="module")
def ref():
    return reference(2 * STEPS)


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return run_distributed(_world8, 8, str(tmp_path_factory.mktemp("world8")), timeout_s=400)[0]


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid") / "ckpt"


@pytest.fixture(scope="module")
def world4(saved_dir):
    return run_distributed(_world4, 4, str(saved_dir), timeout_s=300)[0]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def model_rel_err(ours: dict, ref: dict) -> float:
    """max|a − b| / max|b| over the whole model (AdamW moves elements whose gradient is
    rounding noise by ~lr in no agreed direction; see tests/test_tp.py model_rel_err)."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    worst = max(float((ours[n].double() - ref[n].double()).abs().max()) for n in ref)
    return worst / max(float(t.abs().max()) for t in ref.values())


def test_reference_clips(ref):
    """The clip threshold is below the gradient norm, so clipping is really exercised."""
    from hplab.models.gpt import GPTConfig, build_model

    model = build_model(GPTConfig(**CONFIG), 0)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert norm > TRAINING["grad_clip"]


def _one_process_half() -> dict:
    """Each mixed-precision layout's precision and recompute on one process (no parallelism)."""
    from hplab.parallel.mesh import Mesh

    mesh = Mesh()
    return {
        name: train_half(
            mesh,
            make_args(precision=layout["precision"], recompute=layout.get("recompute", "none")),
            False,
        )
        for name, layout in HALF_LAYOUTS_4.items()
    }


@pytest.fixture(scope="module")
def half_ref():
    return run_distributed(_one_process_half, 1)[0]


def update_rel_err(ours: dict, ref: dict) -> float:
    """||Δours − Δref|| / ||Δref||, Δ = what training changed from the initial weights.

    In bf16/fp16 the weights themselves agree to many digits whatever happens, so they say
    little; the updates are what a wrong layout would get wrong (a missing or doubled gradient
    piece changes them by ~100 %)."""
    from hplab.models.gpt import GPTConfig, build_model

    init = dict(build_model(GPTConfig(**CONFIG), 0).named_parameters())
    diff = sum(
        float((torch.as_tensor(ours[n]) - torch.as_tensor(ref[n])).square().sum()) for n in ref
    )
    moved = sum(float((torch.as_tensor(ref[n]) - init[n].detach()).square().sum()) for n in ref)
    return (diff / moved) ** 0.5


@pytest.mark.parametrize("name", list(HALF_LAYOUTS_4))
def test_mixed_precision_hybrids_equal_one_process_in_that_precision(world4, ref, half_ref, name):
    """Against one process in the same precision: the losses within one bf16 rounding (2⁻⁸),
    and the updates no further apart than precision itself moves them — the one-process run
    in that precision against fp32. Adam turns the rounding noise of near-zero gradients into
    ~lr steps in no agreed direction, so half-precision updates differ by a few % from fp32's
    (measured: bf16 ~5 %, fp16 ~2 %); a layout that adds less than twice that adds no error of
    its own."""
    ours, one = world4["half"][name], half_ref[name]
    assert max(rel(a, b) for a, b in zip(ours["losses"], one["losses"])) < 2**-8
    fp32 = {n: t.numpy() for n, t in ref[1][STEPS - 1].items()}
    precision_noise = update_rel_err(one["params"], fp32)
    assert 0 < precision_noise < 0.2  # precision did change the updates, but only a little
    assert update_rel_err(ours["params"], one["params"]) < 2 * precision_noise


@pytest.mark.parametrize(
    "name", [n for n, lay in HALF_LAYOUTS_4.items() if lay["precision"] == "fp16"]
)
def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank(world4, name):
    result = world4["half"][name]
    for rank, seen in enumerate(result["ranks"]):
        scales = seen["scales"]  # before steps 0, 1, 2 and after the last
        assert seen["skipped"] == 1, (rank, seen)
        assert scales[INF_AT_STEP + 1] == scales[INF_AT_STEP] / 2, (rank, scales)
        assert scales == result["ranks"][0]["scales"], rank
    assert result["moved_at_inf"] == 0.0  # no rank stepped: the whole model is unchanged


@pytest.mark.parametrize("name", ["dp4 zero3", "tp4"])
def test_saved_under_tp2_pp2_resumes_under_another_layout(world4, ref, name):
    resumed = world4[f"resumed under {name}"]
    uninterrupted = ref[0][STEPS:]
    assert max(rel(a, b) for a, b in zip(resumed, uninterrupted)) < RTOL, (resumed, uninterrupted)


def test_saved_under_tp2_pp2_resumes_on_one_process(world4, ref, saved_dir):
    resumed = run_distributed(_world1, 1, str(saved_dir))[0]
    assert max(rel(a, b) for a, b in zip(resumed, ref[0][STEPS:])) < RTOL


def test_saved_directory_is_a_hugging_face_model(world4, ref, saved_dir):
    """The tp2 × pp2 checkpoint holds the one-process model after 3 steps, and
    GPT2LMHeadModel.from_pretrained gives the same logits as hplab's GPT with those weights."""
    transformers = pytest.importorskip("transformers")
    from hplab import checkpoint
    from hplab.models.gpt import GPTConfig, build_model

    saved = checkpoint.load(saved_dir)
    assert (
        model_rel_err({n: saved["model"][n] for n in ref[1][STEPS - 1]}, ref[1][STEPS - 1]) < RTOL
    )
    assert set(saved["optimizer"]) == set(ref[1][0])  # every parameter's AdamW state
    model = build_model(GPTConfig(**CONFIG), 0)
    model.load_state_dict({n: saved["model"][n] for n in model.state_dict()})
    hf = transformers.GPT2LMHeadModel.from_pretrained(saved_dir).eval()
    x, _ = batches(1)[0]
    with torch.no_grad():
        ours, theirs = model.eval()(x)[0], hf(input_ids=x).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < RTOL


@pytest.mark.parametrize(
    ("flags", "reason", "command_line"),
    [
        (dict(pp=2, zero=3), "ZeRO-3 with a pipeline", "--zero 3 --pp 2"),
        (
            dict(cp=2, recompute="selective"),
            "would send the ring's K/V",
            "--recompute selective --cp 2",
        ),
        (
            dict(pp=2, zero=2, schedule="zb-h1"),
            "ZB-H1 defers weight gradients",
            "--zero 2 --schedule zb-h1",
        ),
        (dict(offload=True), "needs ZeRO 1, 2 or 3", "--offload"),
        (dict(dp=2, prefetch="none"), "so it needs --zero 3", "--prefetch none"),
    ],
)
def test_refused_combinations_say_why(flags, reason, command_line):
    """The library refuses in a plain sentence; train.py names the flags the user gave."""
    from hplab.cli import in_flags
    from hplab.config import LayoutError, validate
    from hplab.models.gpt import GPTConfig

    with pytest.raises(LayoutError, match=reason) as refused:
        validate(typed(make_args(**flags))[0], GPTConfig(**CONFIG))
    argv = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
        for k, v in flags.items()
    ]
    shown = str(in_flags(refused.value, argv))
    assert shown.startswith(command_line + ": not supported: "), shown


# --- train.py: --save / --save-every / --resume -------------------------------------------------


def _train_runs(directory: str) -> dict:
    """train.py's own run() (flags parsed as on the command line) three times in one 2-rank
    launch: uninterrupted 4 steps as dp2 saving every 2; 2 steps as a 2-stage pipeline, saved;
    resumed from that under tp2 for steps 2 and 3 (and saved). Rank 0 returns the metrics."""
    from hplab import train

    common = ["--no-progress", "--n-layer", "2", "--batch-size", "4", "--lr", "3e-3"]
    runs = {
        "uninterrupted": [
            "--dp",
            "2",
            "--steps",
            "4",
            "--save",
            f"{directory}/a",
            "--save-every",
            "2",
        ],
        "first half": ["--pp", "2", "--steps", "2", "--save", f"{directory}/b"],
        "resumed": [
            "--tp",
            "2",
            "--steps",
            "4",
            "--resume",
            f"{directory}/b",
            "--save",
            f"{directory}/c",
        ],
    }
    out = {name: train.run(train.parse_args(common + flags)) for name, flags in runs.items()}
    out["configs"] = _run_configs(configs_of_size(2), directory + "-configs")
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("world2")
    return run_distributed(_train_runs, 2, str(directory), timeout_s=300)[0], directory


def test_train_resume_under_another_layout_continues_the_run(world2):
    metrics, tmp_path = world2
    uninterrupted = [s["loss"] for s in metrics["uninterrupted"]["steps"]]
    resumed = metrics["resumed"]["steps"]
    assert [s["step"] for s in resumed] == [2, 3]
    assert max(rel(s["loss"], uninterrupted[s["step"]]) for s in resumed) < RTOL
    # --save-every 2 then the end: the directory holds the last one, nothing left aside
    assert json.loads((tmp_path / "a" / "trainer_state.json").read_text())["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    # the save's tp all-gathers are checkpoint traffic, kept out of the training ledger
    assert "all_gather" not in metrics["resumed"]["comm"][0]


def test_resume_past_the_end_is_one_clear_line(world2, tmp_path, capsys):
    from hplab import train

    assert train.main(["--resume", str(tmp_path / "none")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    saved_at_step_4 = world2[1] / "a"
    assert train.main(["--resume", str(saved_at_step_4), "--steps", "4", "--n-layer", "2"]) == 2
    assert "already at step 4" in capsys.readouterr().err


# --- configs/: every recipe runs (2 steps), one launch per world size ---------------------------

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def _world_size(path: Path) -> int:
    import tomllib

    recipe = tomllib.loads(path.read_text())
    return recipe.get("dp", 1) * recipe.get("tp", 1) * recipe.get("pp", 1)


def _run_configs(paths: list[str], directory: str) -> dict:
    """train.py's run() on each recipe for 2 steps (a recipe's --save goes to `directory`)."""
    from hplab import train
    from hplab.observe.metrics import summary_table

    out = {}
    for path in paths:
        flags = ["--config", path, "--steps", "2", "--no-progress"]
        args = train.parse_args(flags)
        if args.save:
            flags += ["--save", f"{directory}/{Path(path).stem}"]
        metrics = train.run(train.parse_args(flags))
        if metrics is not None:
            out[Path(path).name] = {
                "losses": [s["loss"] for s in metrics["steps"]],
                "world_size": metrics["world_size"],
                "summary": summary_table(metrics),
            }
    return out


def configs_of_size(world_size: int) -> list[str]:
    return [str(p) for p in CONFIGS if _world_size(p) == world_size]


@pytest.fixture(scope="module")
def config_runs(world2, world4, world8):
    """The recipes ran inside the launches above, grouped by world size."""
    return {**world2[0]["configs"], **world4["configs"], **world8["configs"]}


def test_there_is_a_recipe_per_seed_layout():
    names = {p.stem for p in CONFIGS}
    assert {
        "colossalai_gpt2_pp2_zero1_fp16",
        "paddle_gpt3_sharding4_mp2_amp_recompute",
        "megatron_gpt2_345m_tp2",
        "megatron_gpt2_345m_pp2",
        "megatron_gpt2_345m_tp2_pp2",
        "paddlenlp_trainer_tp2_pp2_sharding2",
    } <= names
    for path in CONFIGS:
        assert "original:" in path.read_text(), f"{path.name} must quote the original's numbers"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_runs_two_steps(config_runs, path):
    result = config_runs[path.name]
    assert result["world_size"] == _world_size(path)
    assert len(result["losses"]) == 2
    assert all(0 < loss < 20 for loss in result["losses"])  # finite, a language-model loss
    for rank in range(result["world_size"]):  # the summary names every rank's coordinates
        assert f"rank {rank} dp" in result["summary"]
