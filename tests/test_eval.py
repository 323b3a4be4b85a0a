"""Evaluation (issue 14, item 4): a held-out validation split, `--eval-every N` and
`--eval-batches K`.

Without processes: the validation split never overlaps a training sample, its batches are
fixed, and bad flags are one line each. One 2-process launch then (1) trains dp2, tp2, pp2 (1F1B
and interleaved), ZeRO-1 and 3, cp2 (ring, Ulysses), an MoE under ep2 and half-precision layouts
twice, evaluating after every step or not at all, and compares with one process (fp32, 1e-5
relative): the validation loss is the one process's, and evaluating changes no training loss
(exactly); (2) runs train.py itself with and without `--eval-every` (dp2, pp2): the same losses
and the same recorded traffic, and the logged validation loss equals the one this test computes
from the saved checkpoint on the held-out batches.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from hplab import train
from hplab.data import TOKEN_DTYPE, TokenDataset, get_batch, global_batch_indices
from hplab.observe import metrics
from hplab.runtime.launch import run_distributed

RTOL = 1e-5
STEPS, LR = 3, 1e-2
CONFIG = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=4, n_head=4)
GLOBAL_BATCH = 8
MOE = dict(n_experts=4, moe_top_k=2)  # the model of the layouts named "moe"
LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "pp2 1f1b": dict(pp=2, microbatches=2),
    "pp2 interleaved": dict(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2),
    "dp2 zero3": dict(dp=2, zero=3),
    "dp2 zero1": dict(dp=2, zero=1, microbatches=2),
    "cp2 ring": dict(cp=2),
    "cp2 ulysses": dict(cp=2, cp_style="ulysses"),
    "dp2 ep2 moe": dict(dp=2, ep=2),  # (the MoE's balance loss is training's, not val's)
    "dp2 bf16": dict(dp=2, precision="bf16"),
    "pp2 bf16": dict(pp=2, precision="bf16"),
    "dp2 zero3 bf16": dict(dp=2, zero=3, precision="bf16"),
    "pp2 fp16": dict(pp=2, precision="fp16"),
}
HALF_RTOL = 2**-8  # bf16's unit roundoff (fp16's is 2**-11): half precision computes each
# layer in its own rounding order, so its layouts agree with fp32 to that, not to 1e-5
# train.py runs (n_layer 2 of the tiny preset, the shipped corpus); A and C log validation
COMMON = ["--no-progress", "--n-layer", "2", "--batch-size", "4", "--steps", str(STEPS)]
EVAL = ["--eval-every", "2", "--eval-batches", "3"]
RUNS = {
    "A dp2 eval": ["--dp", "2", *EVAL],
    "B dp2": ["--dp", "2"],
    "C pp2 eval": ["--pp", "2", "--microbatches", "2", *EVAL],
    "D pp2": ["--pp", "2", "--microbatches", "2"],
}


def batches(count: int, seed: int) -> list:
    """Sequences a model learns within steps (a random start, then strides of 1 to 3 mod V),
    so every step moves the validation loss far beyond the tolerance."""
    generator, out = torch.Generator().manual_seed(seed), []
    for _ in range(count):
        start, stride = (
            torch.randint(low, high, (GLOBAL_BATCH, 1), generator=generator)
            for low, high in ((0, CONFIG["vocab_size"]), (1, 4))
        )
        tokens = (start + stride * torch.arange(CONFIG["n_positions"] + 1)) % CONFIG["vocab_size"]
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


TRAIN, VAL = batches(STEPS, 1000), batches(2, 2000)


# --- the split and its batches, without processes -------------------------------------------------


def test_the_validation_split_is_never_read_by_training_and_its_batches_are_fixed():
    seq = 64
    train_set = TokenDataset("shakespeare", seq_len=seq)
    val_set = TokenDataset("shakespeare", seq_len=seq, split="val")
    first_val_token = len(train_set.tokens)  # train: tokens [0, this); val: [this, end)
    drawn = {
        i
        for step in range(0, 400, 37)
        for seed in (0, 7)  # samples training draws
        for i in global_batch_indices(len(train_set), step, 16, seed)
    }
    assert max(drawn) < len(train_set)
    every = torch.from_numpy(np.fromfile(train_set.path, dtype=TOKEN_DTYPE).astype(np.int64))
    last = (len(train_set) - 1) * seq  # the last training sample reads tokens last ... last+seq
    x, y = train_set[len(train_set) - 1]
    assert torch.equal(torch.cat([x, y[-1:]]), every[last : last + seq + 1])
    assert last + seq < first_val_token
    assert len(every) == first_val_token + len(val_set.tokens)
    assert torch.equal(every[first_val_token:], torch.from_numpy(val_set.tokens.astype(np.int64)))
    x, y = get_batch(val_set, range(4, 8))  # validation batch 1 of 4 sequences (train.py's)
    start = first_val_token + 4 * seq
    assert torch.equal(torch.cat([x.flatten(), y[-1, -1:]]), every[start : start + 4 * seq + 1])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval-every", "-1"], "--eval-every: must be at least 0, got -1"),
        (["--eval-every", "5", "--eval-batches", "0"], "--eval-batches: must be at least 1, got 0"),
        (
            ["--eval-every", "5", "--eval-batches", "19"],  # 19 × 16 > 299 sequences of 64 tokens
            "--eval-batches 19 × --batch-size 16 exceeds the validation split: "
            "299 sequences (last 5%)",
        ),
    ],
)
def test_bad_eval_flags_are_one_line_before_any_process(flags, message, capsys):
    assert train.main(["--nproc", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_eighteen_batches_fit_the_split():  # the limit above is the split's real size
    args = train.parse_args(["--eval-every", "5", "--eval-batches", "18"])
    assert len(train.preflight(args, 1).validation) == 299 >= 18 * 16


# --- one 2-process launch -------------------------------------------------------------------------


def _in_two_processes(directory: str) -> dict:
    from hplab.config import Layout, OptimConfig
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel.compose import parallelize
    from hplab.parallel.mesh import Mesh
    from hplab.training import TrainState, build_lr_scheduler, build_optimizer, evaluate, train_step

    out = {}
    for name, layout in LAYOUTS.items():
        out[name] = {}
        for evaluating in (True, False):  # evaluate after every step, or only after the last
            mesh = Mesh(
                pp=layout.get("pp", 1),
                dp=layout.get("dp", 1),
                cp=layout.get("cp", 1),
                tp=layout.get("tp", 1),
                ep=layout.get("ep", 1),
            )
            model = build_model(GPTConfig(**CONFIG, **(MOE if "moe" in name else {})), 0)
            c = Layout(**layout)
            optim = OptimConfig(lr=LR)
            model = parallelize(model, mesh, c)
            optimizer = build_optimizer(model, mesh, c, optim)
            scheduler = build_lr_scheduler(optimizer, optim)
            par = TrainState(model, optimizer, scheduler, mesh, c, optim)
            share = GLOBAL_BATCH // mesh.dp_size
            mine = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
            losses, val = [], []
            for step, (x, y) in enumerate(TRAIN):
                losses.append(train_step(par, x[mine], y[mine]))
                if evaluating or step == STEPS - 1:
                    val.append(sum(evaluate(par, xv[mine], yv[mine]) for xv, yv in VAL) / len(VAL))
            out[name][evaluating] = {"train": losses, "val": val}
    for name, flags in RUNS.items():
        save = ["--save", f"{directory}/a"] if name.startswith("A") else []
        out[name] = train.run(train.parse_args(COMMON + flags + save))
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eval")
    return run_distributed(_in_two_processes, 2, str(directory), timeout_s=300)[0], directory


@functools.cache
def reference(moe: bool = False) -> tuple[list, list, torch.nn.Module]:
    """One process, torch's own AdamW: the training losses, after each step the mean
    validation loss (the cross-entropy) over VAL, and the trained model."""
    from hplab.models.gpt import GPTConfig, build_model

    model = build_model(GPTConfig(**CONFIG, **(MOE if moe else {})), 0)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, foreach=False
    )
    losses, val = [], []
    for x, y in TRAIN:
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            val.append(sum(float(model.loss_fn(model(xv)[0], yv)) for xv, yv in VAL) / len(VAL))
    return losses, val, model


def worst(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_a_stale_model_or_one_shard_alone_would_fail_the_comparisons():
    _, val, model = reference()
    assert min(abs(a - b) / b for a, b in zip(val, val[1:])) > 100 * RTOL  # each step moves it
    with torch.no_grad():  # dp rank 0's half of each validation batch, not averaged with rank 1's
        half = sum(float(model(xv[:4], yv[:4])[1]) for xv, yv in VAL) / len(VAL)
    assert abs(half - val[-1]) / val[-1] > 100 * RTOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_validation_loss_equals_one_process_and_evaluating_changes_no_training(world2, layout):
    runs, (losses, val, _) = world2[0][layout], reference("moe" in layout)
    tolerance = HALF_RTOL if "precision" in LAYOUTS[layout] else RTOL
    assert worst(runs[True]["val"], val) < tolerance
    assert worst(runs[True]["train"], losses) < tolerance
    assert runs[True]["train"] == runs[False]["train"]  # exactly: evaluation left no trace
    assert runs[True]["val"][-1] == runs[False]["val"][-1]  # the last update too


def test_train_py_logs_validation_without_changing_training_or_its_traffic(world2):
    a, b, c, d = (world2[0][name] for name in RUNS)
    assert [e["step"] for e in a["eval"]] == [2, 3] and b["eval"] == [] == d["eval"]
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [s["loss"] for s in c["steps"]] == [s["loss"] for s in d["steps"]]
    for with_eval, without in ((a, b), (c, d)):  # eval's messages are not training traffic
        for rank in range(2):
            for op, stats in without["comm"][rank].items():
                got = with_eval["comm"][rank][op]
                assert (got["calls"], got["bytes"]) == (stats["calls"], stats["bytes"]), op
            assert with_eval["comm"][rank].keys() == without["comm"][rank].keys()
    assert worst([e["loss"] for e in c["eval"]], [e["loss"] for e in a["eval"]]) < RTOL
    summary = metrics.summary_table(a)
    first, last = a["eval"]
    assert (
        f"validation loss {first['loss']:.4f} after 2 steps → {last['loss']:.4f} after 3 "
        "steps" in summary.splitlines()[1]
    )


def test_the_logged_validation_loss_is_the_saved_models_loss_on_the_held_out_batches(world2):
    """Recomputed here from run A's checkpoint (saved after its last step) by one process."""
    from hplab.checkpoint import load
    from hplab.models.gpt import build_model, config_from_preset

    metrics, directory = world2
    config = config_from_preset("tiny", n_layer=2)
    model = build_model(config)
    model.load_state_dict(load(directory / "a")["model"])
    val_set = TokenDataset("shakespeare", seq_len=config.n_positions, split="val")
    with torch.no_grad():
        losses = [float(model(*get_batch(val_set, range(4 * k, 4 * k + 4)))[1]) for k in range(3)]
    assert worst([metrics["A dp2 eval"]["eval"][-1]["loss"]], [sum(losses) / 3]) < RTOL


def test_run_val_losses_and_the_plot_show_validation_beside_training(world2):
    import matplotlib

    matplotlib.use("Agg")
    from hplab import lab, viz

    a = lab.Run(world2[0]["A dp2 eval"])
    assert a.val_losses == [(e["step"], e["loss"]) for e in a.metrics["eval"]]
    assert lab.Run(world2[0]["B dp2"]).val_losses == []
    ax = viz.plot_loss_curves({"dp2": a, "no eval": world2[0]["B dp2"]})
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"dp2", "dp2, validation", "no eval"}
    assert list(lines["dp2, validation"].get_xdata()) == [2, 3]
    assert lines["dp2, validation"].get_color() == lines["dp2"].get_color()
