"""examples/finetune_classification.py: bad input is one line. That GPT2ForSequenceClassification
fine-tuned with hplab's building blocks on 2 processes learns which play two lines come from
(65% held-out accuracy or more, 4 standard deviations above chance) is checked where lab 06
runs it, in its cell after the run (nbval compares that line): one 2-process run, not two.
Measured from a random tiny init with seeds 0-5: 76.5, 72.0, 68.0, 70.5, 73.0 and 78.5%; ddp,
zero2 and fsdp give the same losses."""

import importlib.util
import json
from pathlib import Path

import pytest

from hplab import checkpoint
from hplab.models.gpt import GPTConfig, build_model

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_classification.py"


def gpt2_directory(path: Path, config: GPTConfig) -> Path:
    """A GPT-2 directory (config.json + model.safetensors, what `train.py --save` writes)."""
    return checkpoint.save(path, config, build_model(config, seed=0).state_dict(), {}, {"step": 0})


def test_bad_input_is_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("finetune_classification", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    init = gpt2_directory(
        tmp_path / "init", GPTConfig(n_positions=16, n_embd=16, n_layer=1, n_head=1)
    )
    not_gpt2 = tmp_path / "bert"
    not_gpt2.mkdir()
    (not_gpt2 / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (not_gpt2 / "model.safetensors").write_bytes(b"")
    odd_vocab = tmp_path / "odd_vocab"
    odd_vocab.mkdir()
    (odd_vocab / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 999}))
    (odd_vocab / "model.safetensors").write_bytes(b"")
    damaged = []
    for name, config in (("entry", {"hplab": 5}), ("positions", {"n_positions": "many"})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps({"model_type": "gpt2", "vocab_size": 2048, **config})
        )
        (folder / "model.safetensors").write_bytes(b"")
        damaged.append(str(folder))
    for argv, expected in (
        ([damaged[0]], "has an 'hplab' entry without a usable config"),
        ([damaged[1]], "cannot be read as a gpt2 config"),
        ([str(tmp_path / "missing")], "not a GPT-2 directory"),
        ([str(not_gpt2)], "does not describe a GPT-2 model"),
        ([str(odd_vocab)], "vocab_size 999 matches no shipped tokenizer"),
        ([str(init), "--batch-size", "3"], "processes share equally"),
        ([str(init), "--epochs", "0"], "--epochs >= 1"),
    ):
        assert example.main(["--init", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
