"""Unified checkpoints: HF-loadable, pickle-free, atomic (a kill mid-save loses nothing)."""

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hplab import checkpoint
from hplab.models.gpt import GPTConfig, build_model

ROOT = Path(__file__).resolve().parent.parent
CONFIG = GPTConfig(vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=4)


def fake_optimizer_state(model, fill):
    return {
        n: {
            "exp_avg": torch.full_like(p, fill),
            "exp_avg_sq": torch.full_like(p, fill),
            "step": torch.tensor(float(fill)),
        }
        for n, p in model.named_parameters()
    }


def save_version(directory, version):
    model = build_model(CONFIG, seed=version)
    checkpoint.save(
        directory,
        CONFIG,
        model.state_dict(),
        fake_optimizer_state(model, version),
        {"step": version},
    )
    return model


def test_round_trip_and_hugging_face_opens_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = save_version(tmp_path / "ckpt", 3)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "trainer_state.json",
    ]  # no pickle anywhere
    loaded = checkpoint.load(tmp_path / "ckpt")
    assert loaded["config"] == CONFIG and loaded["trainer_state"]["step"] == 3
    for name, t in model.state_dict().items():
        assert torch.equal(loaded["model"][name], t), name
    assert torch.equal(
        loaded["optimizer"]["transformer.h.1.mlp.c_fc.weight"]["exp_avg"],
        torch.full((128, 32), 3.0),
    )
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt").eval()
    idx = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=idx).logits, model.eval()(idx)[0], atol=1e-5, rtol=1e-5)


def test_resuming_into_another_model_is_refused():
    with pytest.raises(checkpoint.CheckpointError, match="n_layer: saved 2, asked 4"):
        checkpoint.check_compatible(
            CONFIG, GPTConfig(vocab_size=300, n_positions=16, n_embd=32, n_layer=4, n_head=4)
        )


def test_missing_checkpoint_is_one_clear_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
        checkpoint.load(tmp_path / "nothing")


KILLED_SAVE = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {tests!r})
    import test_checkpoint as t
    from hplab import checkpoint
    stage = sys.argv[2]
    if stage == "writing":   # hang after the weights are written, before anything is renamed
        real = checkpoint.save_file
        def slow(tensors, path, **kw):
            real(tensors, path, **kw)
            if str(path).endswith("optimizer.safetensors"):
                print("ready", flush=True); time.sleep(60)
        checkpoint.save_file = slow
    else:                    # hang between moving the old checkpoint aside and the new in place
        real_rename = os.rename
        def slow_rename(a, b):
            real_rename(a, b)
            if str(b).endswith(".previous"):
                print("ready", flush=True); time.sleep(60)
        checkpoint.os.rename = slow_rename
    t.save_version(sys.argv[1], 2)
""")


@pytest.mark.parametrize("stage", ["writing", "between-renames"])
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, stage):
    directory = tmp_path / "ckpt"
    first = save_version(directory, 1)
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE.format(tests=str(ROOT / "tests")))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(directory), stage],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    loaded = checkpoint.load(directory)
    assert loaded["trainer_state"]["step"] == 1
    for name, t in first.state_dict().items():
        assert torch.equal(loaded["model"][name], t), name
    save_version(directory, 3)  # the next save cleans up and succeeds
    assert checkpoint.load(directory)["trainer_state"]["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "killed_save.py"]


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, which the writer did not
    catch: a traceback from its thread, and the run then printed its summary as if it had
    saved. Now the save fails in one line and the previous checkpoint is untouched."""
    from safetensors import SafetensorError

    model = save_version(tmp_path / "ckpt", 1)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}

    def no_space(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(checkpoint, "save_file", no_space)
    state = (CONFIG, model.state_dict(), fake_optimizer_state(model, 2), {"step": 2})
    record = {"step": 2, "bytes": 0, "write_seconds": 0.0}
    checkpoint._write(record, tmp_path / "ckpt", state)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.finish_saves()
    assert str(err.value).startswith("the checkpoint of step 2 was not written (Error while")
    assert "No space left on device" in str(err.value) and "\n" not in str(err.value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no half-written folder
