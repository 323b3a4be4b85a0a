"""Tests for hplab.data: tokenizers, shipped token files, dataset, sampler, JSONL prepare."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hplab.data import (
    DATA_DIR,
    END_OF_TEXT,
    TokenDataset,
    get_batch,
    global_batch_indices,
    load_tokenizer,
    main,
    read_documents,
    shard_for_rank,
)

REPO = Path(__file__).resolve().parent.parent


# --- tokenizers ------------------------------------------------------------------


def test_gpt2_tokenizer_is_the_real_one():
    tokenizer = load_tokenizer("gpt2")
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert len(tokenizer) == 50257
    assert tokenizer.convert_tokens_to_ids(END_OF_TEXT) == 50256
    assert tokenizer.decode([15496, 995]) == "Hello world"


def test_hplab_bpe_round_trips_any_text():
    tokenizer = load_tokenizer("hplab-bpe")
    assert len(tokenizer) == 2048
    text = "To be, or not to be: that is the question.\n  Ünïcödé — ok ✓"
    ids = tokenizer.encode(text)
    assert max(ids) < 2048
    assert tokenizer.decode(ids) == text


def test_unknown_tokenizer_name_is_a_clear_error():
    with pytest.raises(ValueError, match="hplab-bpe"):
        load_tokenizer("llama")


# --- shipped files -----------------------------------------------------------------


def test_shipped_corpus_size_and_documents():
    corpus = DATA_DIR / "shakespeare.txt"
    assert 900_000 <= corpus.stat().st_size <= 1_200_000
    text = corpus.read_text(encoding="utf-8")
    assert "Gutenberg" not in text
    assert len(read_documents(corpus)) >= 5


@pytest.mark.parametrize(
    ("name", "vocab_size", "num_documents"), [("hplab-bpe", 2048, None), ("gpt2", 50257, 1)]
)
def test_shipped_bin_equals_retokenized_corpus(name, vocab_size, num_documents):
    sidecar = json.loads((DATA_DIR / f"shakespeare.{name}.json").read_text())
    tokens = np.fromfile(DATA_DIR / f"shakespeare.{name}.bin", dtype="<u2")
    assert sidecar["tokenizer"] == name and sidecar["vocab_size"] == vocab_size
    assert sidecar["dtype"] == "uint16" and sidecar["num_tokens"] == len(tokens)

    tokenizer = load_tokenizer(name)
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    documents = read_documents(DATA_DIR / "shakespeare.txt")[:num_documents]
    expected = []
    for document in documents:
        expected += tokenizer.encode(document) + [end_id]
    assert tokens[: len(expected)].tolist() == expected
    assert int((tokens == end_id).sum()) == sidecar["num_documents"]


# --- dataset -----------------------------------------------------------------------


def test_dataset_samples_are_shifted_by_one():
    dataset = TokenDataset("shakespeare", tokenizer="hplab-bpe", seq_len=16)
    all_tokens = np.fromfile(dataset.path, dtype="<u2")
    x, y = dataset[3]
    assert x.dtype == torch.int64 and x.shape == (16,) and y.shape == (16,)
    assert torch.equal(x[1:], y[:-1])
    assert x.tolist() == all_tokens[48:64].tolist() and y.tolist() == all_tokens[49:65].tolist()
    assert dataset.vocab_size == 2048


def test_train_and_val_splits_are_95_and_5_percent():
    train = TokenDataset("shakespeare", seq_len=64, split="train")
    val = TokenDataset("shakespeare", seq_len=64, split="val")
    total = train.tokens.shape[0] + val.tokens.shape[0]
    assert train.tokens.shape[0] == int(total * 0.95)
    assert len(train) == (train.tokens.shape[0] - 1) // 64
    last_val_x, _ = val[len(val) - 1]
    assert last_val_x.shape == (64,)


def test_dataset_errors_say_what_to_do():
    with pytest.raises(ValueError, match="prepare"):
        TokenDataset("no-such-corpus")
    with pytest.raises(ValueError, match="too long"):
        TokenDataset("shakespeare", seq_len=10_000_000)


def test_get_batch_stacks_samples():
    dataset = TokenDataset("shakespeare", seq_len=8)
    x, y = get_batch(dataset, [5, 0, 2])
    assert x.shape == y.shape == (3, 8) and x.dtype == torch.int64
    assert torch.equal(x[1], dataset[0][0]) and torch.equal(y[2], dataset[2][1])


# --- sampler -----------------------------------------------------------------------


def test_global_batch_does_not_depend_on_dp_layout():
    for step in range(5):
        batch = global_batch_indices(num_samples=100, step=step, global_batch=8, seed=1)
        for dp_size in (1, 2, 4, 8):
            shards = [shard_for_rank(batch, rank, dp_size) for rank in range(dp_size)]
            assert sum(shards, []) == batch
            assert all(len(shard) == 8 // dp_size for shard in shards)


def test_global_batch_is_deterministic_and_seeded():
    first = global_batch_indices(1000, step=7, global_batch=16, seed=3)
    assert first == global_batch_indices(1000, step=7, global_batch=16, seed=3)
    assert first != global_batch_indices(1000, step=7, global_batch=16, seed=4)


def test_an_epoch_visits_every_sample_once_then_wraps():
    num_samples, batch = 10, 4
    stream = sum((global_batch_indices(num_samples, s, batch, seed=0) for s in range(5)), [])
    assert sorted(stream[:10]) == list(range(10))  # epoch 0: no repetition
    assert sorted(stream[10:20]) == list(range(10))  # epoch 1 continues mid-batch (step 2)
    assert stream[:10] != stream[10:20]  # a fresh shuffle each epoch


def test_shard_for_rank_rejects_uneven_split():
    with pytest.raises(ValueError, match="divisible by 4"):
        shard_for_rank(list(range(6)), dp_rank=0, dp_size=4)


# --- prepare (command line) ----------------------------------------------------------


def test_prepare_round_trips_a_jsonl_corpus(tmp_path):
    texts = ["Hello world.", "Zweites Dokument: Ünïcode ✓\nmit zwei Zeilen.", "third"]
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    arguments = [
        "prepare",
        "--input",
        source,
        "--output-prefix",
        tmp_path / "mine",
        "--tokenizer",
        "gpt2",
    ]
    assert main([str(argument) for argument in arguments]) == 0  # in-process: saves a 3 s start

    sidecar = json.loads((tmp_path / "mine.json").read_text())
    tokens = np.fromfile(tmp_path / "mine.bin", dtype="<u2")
    assert sidecar["tokenizer"] == "gpt2" and sidecar["num_tokens"] == len(tokens)
    assert tokens[-1] == 50256
    decoded = load_tokenizer("gpt2").decode(tokens.tolist())
    assert decoded.split(END_OF_TEXT)[:-1] == texts

    dataset = TokenDataset(tmp_path / "mine", tokenizer="gpt2", seq_len=4, split="train")
    assert dataset.vocab_size == 50257 and len(dataset) >= 1


BAD_INPUTS = {
    "missing file": (None, "not found"),
    "not JSON": ('{"text": "fine"}\n{"text": broken\n', ":2: not valid JSON"),
    "no text key": ('{"id": 1, "body": "no text key"}\n', "no 'text' key"),
    "empty corpus": ("\n\n", "empty corpus"),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Run `prepare` on every bad input at once (in parallel: each start costs ~2 s)."""
    processes = {}
    for case, (content, _) in BAD_INPUTS.items():
        folder = tmp_path_factory.mktemp(case.replace(" ", "_"))
        if content is not None:
            (folder / "corpus.jsonl").write_text(content)
        command = [
            sys.executable,
            "-m",
            "hplab.data",
            "prepare",
            "--input",
            str(folder / "corpus.jsonl"),
            "--output-prefix",
            str(folder / "out"),
        ]
        processes[case] = (
            folder,
            subprocess.Popen(
                command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            ),
        )
    results = {}
    for case, (folder, process) in processes.items():
        _, stderr = process.communicate(timeout=120)
        results[case] = (folder, process.returncode, stderr)
    return results


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_prepare_bad_input_is_one_line_and_exit_code_2(bad_input_runs, case):
    folder, returncode, stderr = bad_input_runs[case]
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    error_lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and BAD_INPUTS[case][1] in error_lines[0], stderr
    assert not (folder / "out.bin").exists() and not (folder / "out.bin.tmp").exists()
