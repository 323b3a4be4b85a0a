"""`--init-from DIR` (issue 14, item 1): training starts from the weights of a Hugging Face GPT-2
folder (`save_pretrained`) or an hplab checkpoint, cut for any layout, with a new optimizer at
step 0; the folder's config.json sets the model.

A tiny GPT2LMHeadModel is saved here (no download), every weight perturbed so that biases and
layer norms are not their trivial initial values. One 2-process launch loads it under dp2, tp2,
pp2 and ZeRO-3 (dp2): the logits equal `GPT2LMHeadModel.from_pretrained`'s (for pp2: the last
stage's, fed by the first over a send), and 3 training steps of train.py equal one process
running torch's AdamW from the same weights (losses, fp32, 1e-5 relative); the dp2 run saves a
checkpoint, which tp2 starts from afresh. Bad folders and flags: one line each, before any
process starts.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from hplab import train
from hplab.runtime.launch import run_distributed

CONFIG = dict(vocab_size=2048, n_positions=16, n_embd=32, n_layer=2, n_head=4)  # hplab-bpe: 2048
STEPS, RTOL = 3, 1e-5
COMMON = ["--no-progress", "--batch-size", "4", "--lr", "3e-3"]
LAYOUTS = {
    "dp2": ["--dp", "2"],
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2", "--microbatches", "2"],
    "dp2 zero3": ["--dp", "2", "--zero", "3"],
}
IDS = torch.randint(
    0, CONFIG["vocab_size"], (2, CONFIG["n_positions"]), generator=torch.Generator().manual_seed(7)
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A GPT2LMHeadModel as Hugging Face saves it: config.json + model.safetensors (+ its
    generation_config.json), the lm_head tied to wte and so not stored."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**CONFIG, bos_token_id=0, eos_token_id=0)
    )  # transformers 5: ids inside the vocabulary
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp("init") / "gpt2-tiny"
    model.save_pretrained(directory)
    model.save_pretrained(directory.parent / "sharded", max_shard_size="20KB")  # 7 files + index
    model.transformer.save_pretrained(directory.parent / "bare")  # GPT2Model: no "transformer."
    return directory


def hf_logits(directory) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(directory).eval()(input_ids=IDS).logits


@functools.cache
def one_process(directory: str, steps: int) -> list[float]:
    """The reference: hplab's GPT with the folder's weights, a new torch AdamW (train.py's
    settings), the batches train.py reads at steps 0, 1, ...; the loss of each step."""
    from hplab.data import get_batch, global_batch_indices
    from hplab.models.gpt import build_model
    from hplab.training import make_optimizer

    args = train.parse_args([*COMMON, "--init-from", directory])
    job = train.preflight(args, 1)
    config, dataset, start = job.model, job.dataset, job.saved
    assert config == start["config"]
    model = build_model(config, args.seed)
    model.load_state_dict(start["model"])
    optimizer, losses = make_optimizer(model.parameters(), args.lr, args.weight_decay), []
    for step in range(steps):
        x, y = get_batch(
            dataset, global_batch_indices(len(dataset), step, args.batch_size, args.seed)
        )
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _logits_after_loading(directory: str, flags: list[str]) -> torch.Tensor | None:
    """run()'s path up to the first step, then the logits of IDS (None on a pp rank without the
    last stage). tp2's vocabulary slices are glued; pp2's first stage sends to the last."""
    import torch.distributed as dist

    from hplab import checkpoint
    from hplab.parallel import tp
    from hplab.parallel.mesh import Mesh

    args = train.parse_args([*COMMON, *flags, "--init-from", directory])
    job = train.preflight(args, dist.get_world_size())
    config, start = job.model, job.saved
    mesh = Mesh(dp=args.dp, tp=args.tp, pp=args.pp)
    par = train.build_training(job, args.seed, mesh, mesh.device)
    checkpoint.load_full_state(par, start["model"], optimizer_state={})
    with torch.no_grad():
        if args.pp == 1:
            logits = par.decoder(IDS)[0]
            return tp.gather_full(logits, tp.Split(-1), mesh.tp) if args.tp > 1 else logits
        (stage,) = par.pipeline.stages.values()
        if stage.is_first:
            dist.send(stage(IDS), 1)
            return None
        hidden = torch.empty(*IDS.shape, config.n_embd)
        dist.recv(hidden, 0)
        return stage(hidden)


def _in_two_processes(directory: str, saved: str) -> dict:
    out = {}
    for name, flags in LAYOUTS.items():
        out[name] = {"logits": _logits_after_loading(directory, flags)}
        save = ["--save", saved] if name == "dp2" else []
        out[name]["metrics"] = train.run(
            train.parse_args(
                [*COMMON, *flags, "--steps", str(STEPS), "--init-from", directory, *save]
            )
        )
    out["cp2"] = {
        "metrics": train.run(
            train.parse_args(  # context parallel: trained, not probed
                [*COMMON, "--cp", "2", "--steps", str(STEPS), "--init-from", directory]
            )
        )
    }
    out["tp2 from the checkpoint"] = {
        "metrics": train.run(
            train.parse_args([*COMMON, "--tp", "2", "--steps", "2", "--init-from", saved])
        )
    }
    return out


@pytest.fixture(scope="module")
def world2(hf_dir):
    saved = hf_dir.parent / "saved"
    return run_distributed(_in_two_processes, 2, str(hf_dir), str(saved), timeout_s=300), saved


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("saved_as", ["gpt2-tiny", "sharded", "bare"])
def test_one_process_loads_the_logits_of_from_pretrained(hf_dir, saved_as):
    from hplab import checkpoint
    from hplab.models.gpt import build_model

    loaded = checkpoint.load_pretrained(hf_dir.parent / saved_as)
    config = loaded["config"]
    assert config.tokenizer == "hplab-bpe" and config.n_layer == 2 and config.n_positions == 16
    model = build_model(config, 0)
    model.load_state_dict(loaded["model"])
    with torch.no_grad():
        assert torch.allclose(model(IDS)[0], hf_logits(hf_dir), rtol=1e-5, atol=1e-5)
    assert rel(build_model(config, 0)(IDS)[0].detach(), hf_logits(hf_dir)) > 0.1  # not by chance


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_loads_the_logits_of_from_pretrained(world2, hf_dir, layout):
    results, _ = world2
    logits = results[1 if layout == "pp2" else 0][layout]["logits"]  # pp2: the last stage's
    assert torch.allclose(logits, hf_logits(hf_dir), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [*LAYOUTS, "cp2"])
def test_training_from_it_equals_one_process(world2, hf_dir, layout):
    steps = world2[0][0][layout]["metrics"]["steps"]
    want = one_process(str(hf_dir), STEPS)
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert max(abs(s["loss"] - w) / w for s, w in zip(steps, want)) < RTOL
    assert abs(want[-1] - want[0]) / want[0] > 100 * RTOL  # the steps moved the loss


def test_a_checkpoint_starts_at_step_0_with_a_new_optimizer(world2):
    results, saved = world2
    assert json.loads((saved / "trainer_state.json").read_text())["step"] == STEPS
    steps = results[0]["tp2 from the checkpoint"]["metrics"]["steps"]
    assert [s["step"] for s in steps] == [0, 1]  # (--resume would refuse: it is at step 3)
    want = one_process(str(saved), 2)  # its weights, AdamW's state empty, step-0 batches
    assert max(abs(s["loss"] - w) / w for s, w in zip(steps, want)) < RTOL


# --- bad folders and flags: one line, exit code 2, before any process starts ------------------


def folder(tmp_path, hf_dir, change: str):
    """A copy of the good folder, broken as `change` says."""
    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(hf_dir, tmp_path / change.replace(" ", "-"))
    config, weights = json.loads((bad / "config.json").read_text()), bad / "model.safetensors"
    if change == "no config":
        (bad / "config.json").unlink()
    elif change == "llama":
        (bad / "config.json").write_text(
            json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
        )
    elif change in ("vocab 1000", "relu", "n_embd 64"):
        key, value = {
            "vocab 1000": ("vocab_size", 1000),
            "relu": ("activation_function", "relu"),
            "n_embd 64": ("n_embd", 64),
        }[change]
        (bad / "config.json").write_text(json.dumps({**config, key: value}))
    elif change == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif change == "pickle only":
        weights.rename(bad / "pytorch_model.bin")
    elif change == "missing tensor":
        state = load_file(weights)
        del state["transformer.h.1.mlp.c_fc.weight"]
        save_file(state, weights)
    return bad


@pytest.mark.parametrize(
    ("change", "flags", "message"),
    [
        ("no config", [], "config.json: No such file or directory: expected a Hugging Face model"),
        ("llama", [], "config.json says model_type 'llama' but lacks hidden_size"),
        (
            "vocab 1000",
            [],
            "config.json has vocab_size 1000, the vocabulary of no shipped tokenizer "
            "(hplab-bpe: 2048, gpt2: 50257 ids)",
        ),
        ("relu", [], "config.json has activation_function 'relu': hplab's GPT-2 has 'gelu_new'"),
        (
            "n_embd 64",
            [],
            "holds tensors of other shapes than its config.json says: "
            "transformer.wte.weight [2048, 32]",
        ),
        ("truncated", [], "holds no readable model.safetensors"),
        ("pickle only", [], "holds no readable model.safetensors (No such file or directory"),
        ("missing tensor", [], "lacks tensors of its model: transformer.h.1.mlp.c_fc.weight"),
        (
            "",
            ["--n-layer", "4"],
            "different model (n_layer: saved 2, asked 4): leave those flags out",
        ),
        ("", ["--model", "gpt2"], "different model (vocab_size: saved 2048, asked 50257; "),
        ("", ["--model", "tiny"], "different model (n_positions: saved 16, asked 64; "),
        ("", ["--moe-experts", "4"], "different model (n_experts: saved 0, asked 4)"),
        ("", ["--resume", "x"], "--init-from starts a new run, --resume continues one"),
    ],
)
def test_a_bad_folder_or_flag_is_one_line_before_any_process(
    hf_dir, tmp_path, capsys, change, flags, message
):
    directory = folder(tmp_path, hf_dir, change) if change else hf_dir
    assert train.main(["--nproc", "2", "--init-from", str(directory), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_missing_folder_and_resume_of_a_pretrained_folder_say_what_to_do(hf_dir, tmp_path, capsys):
    assert train.main(["--nproc", "2", "--init-from", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "none/config.json: No such file or directory" in err and err.count("\n") == 1, err
    assert train.main(["--nproc", "2", "--resume", str(hf_dir)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "use --init-from" in err and err.count("\n") == 1, err
    assert train.main(["--nproc", "2", "--save", str(hf_dir)]) == 2  # never written over
    assert "not part of an hplab checkpoint" in capsys.readouterr().err
