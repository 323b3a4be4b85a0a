"""python -m hplab.sample: greedy decoding is argmax decoding, top-k sampling is seeded and draws
only from the k best tokens with softmax(logits / T), bad input is one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hplab import checkpoint, sample
from hplab.models.gpt import GPTConfig, build_model

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
CONFIG = GPTConfig(n_positions=16, n_embd=32, n_layer=2, n_head=2)  # hplab-bpe's 2048 ids
PROMPT_IDS = [40, 301, 7, 900, 12]


class IdTokenizer:
    """Text is token ids ("40 301 7"): the tests read every id `generate` chose."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return [int(t) for t in ids]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a random tiny GPT whose matrices are scaled ×25: its logits spread
    (std ~3), so greedy choices differ from token to token and no two top logits are within
    float error of each other (an untrained GPT-2 init would be nearly uniform)."""
    model = build_model(CONFIG, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(25.0 if p.dim() == 2 else 1.0)
    return checkpoint.save(
        tmp_path_factory.mktemp("sample") / "ckpt", CONFIG, model.state_dict(), {}, {"step": 0}
    )


@pytest.fixture(scope="module")
def models(saved):
    ours, _ = sample.load_model(saved)
    return ours, transformers.GPT2LMHeadModel.from_pretrained(saved).eval()


def hf_last_logits(hf, ids):
    """Hugging Face's logits at the last position, for the last n_positions tokens."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids[-CONFIG.n_positions :]])).logits[0, -1]


def test_greedy_is_argmax_decoding_with_a_cropped_context(models):
    ours, hf = models
    prompt = " ".join(map(str, PROMPT_IDS))
    # 30 new tokens after 5: past n_positions = 16, so the context is cropped from token 17 on
    ids = sample.generate(ours, IdTokenizer(), prompt, max_new_tokens=30)
    expected = list(PROMPT_IDS)
    for _ in range(30):  # the same loop, independently, on transformers' GPT-2
        expected.append(int(hf_last_logits(hf, expected).argmax()))
    assert ids == expected
    assert len(set(ids[5:])) >= 10  # a real test: the choices vary from token to token
    # and within the window transformers' own greedy generate agrees
    hf_ids = hf.generate(
        torch.tensor([PROMPT_IDS]), max_new_tokens=8, do_sample=False, pad_token_id=0
    )[0].tolist()
    assert ids[:13] == hf_ids


def test_top_k_sampling_is_seeded_and_draws_only_from_the_top_k(models):
    ours, hf = models
    prompt, tok = " ".join(map(str, PROMPT_IDS)), IdTokenizer()

    def draw(**kw):
        return sample.generate(ours, tok, prompt, max_new_tokens=30, **kw)

    assert draw(top_k=3, seed=1) == draw(top_k=3, seed=1)
    assert draw(top_k=3, seed=1) != draw(top_k=3, seed=2)
    assert draw(top_k=1, temperature=0.7, seed=5) == draw()  # k = 1 is greedy
    ids = draw(top_k=3, temperature=2.0, seed=0)
    logits = [hf_last_logits(hf, ids[:i]) for i in range(len(PROMPT_IDS), len(ids))]
    ranks = [int((z > z[i]).sum()) for z, i in zip(logits, ids[len(PROMPT_IDS) :])]
    assert max(ranks) <= 2 and len(set(ranks)) == 3  # only ranks 0, 1, 2, and all of them

    # one step drawn 400 times: frequencies follow softmax(top-3 logits / T), T = 2
    n, temperature = 400, 2.0
    top = hf_last_logits(hf, PROMPT_IDS).topk(3)
    drawn = torch.tensor(
        [
            sample.generate(ours, tok, prompt, 1, top_k=3, temperature=temperature, seed=s)[-1]
            for s in range(n)
        ]
    )
    assert set(drawn.tolist()) <= set(top.indices.tolist())
    freq = torch.stack([(drawn == i).float().mean() for i in top.indices])
    for t, tolerance in ((temperature, 1.0), (1.0, None), (1 / temperature, None)):
        p = (top.values / t).softmax(-1)
        four_sigma = 4 * (p * (1 - p) / n).sqrt() + 1 / n
        if tolerance:  # the right temperature: every frequency within 4 binomial sigmas
            assert ((freq - p).abs() <= four_sigma).all(), (freq, p)
        else:  # and the test can tell: T = 1 or 1/T would be rejected
            assert ((freq - p).abs() > four_sigma).any(), (freq, p)


def test_a_hugging_face_folder_samples_like_the_checkpoint(saved, models, tmp_path):
    """What `save_pretrained` writes (no trainer_state.json, no hplab config) loads too."""
    models[1].save_pretrained(tmp_path / "hf")
    from_hf, tokenizer = sample.load_model(tmp_path / "hf")
    assert sample.generate(from_hf, tokenizer, "HAMLET:", 20, top_k=5) == sample.generate(
        *sample.load_model(saved), "HAMLET:", 20, top_k=5
    )


def one_error_line(capsys, argv):
    assert sample.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hplab: error:") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line(saved, tmp_path, capsys):
    good = ["--checkpoint", str(saved), "--prompt", "HAMLET:"]
    assert "positive, finite number, got 0" in one_error_line(capsys, good + ["--top-k", "0"])
    assert "positive, finite number, got -1.0" in one_error_line(
        capsys, good + ["--temperature", "-1"]
    )
    assert "positive, finite number, got 0.0" in one_error_line(
        capsys, good + ["--temperature", "0"]
    )
    assert "positive, finite number, got 0" in one_error_line(
        capsys, good + ["--max-new-tokens", "0"]
    )
    assert "empty" in one_error_line(capsys, ["--checkpoint", str(saved), "--prompt", ""])
    assert "expected a Hugging Face model folder" in one_error_line(
        capsys, ["--checkpoint", str(tmp_path / "no")] + good[2:]
    )
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(saved / "config.json", config_only)
    assert "no readable model.safetensors" in one_error_line(
        capsys, ["--checkpoint", str(config_only)] + good[2:]
    )
    mismatched = shutil.copytree(saved, tmp_path / "mismatched")  # gpt2's 50257 ids for 2048
    config = json.loads((mismatched / "config.json").read_text())
    config["hplab"]["config"]["tokenizer"] = "gpt2"
    (mismatched / "config.json").write_text(json.dumps(config))
    (mismatched / "trainer_state.json").unlink()  # (its checksums would catch the edit first)
    assert "names the tokenizer 'gpt2' (50257 ids) for a model of 2048" in one_error_line(
        capsys, ["--checkpoint", str(mismatched)] + good[2:]
    )
    for name in ("model.safetensors", "trainer_state.json"):
        damaged = shutil.copytree(saved, tmp_path / f"damaged_{name}")
        data = bytearray((damaged / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (damaged / name).write_bytes(bytes(data[:-3]) if name.endswith("json") else data)
        assert "damaged" in one_error_line(capsys, ["--checkpoint", str(damaged)] + good[2:])
    with pytest.raises(SystemExit) as exit_:  # argparse's own errors: one line too
        sample.main(good + ["--top-k", "many"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("hplab: error: argument --top-k") and err.count("\n") == 1
    with pytest.raises(ValueError, match="--temperature must be a positive, finite number"):
        sample.generate(None, IdTokenizer(), "1", temperature=float("nan"))


def test_command_line_prints_prompt_and_continuation(saved):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "hplab.sample",
            "--checkpoint",
            str(saved),
            "--prompt",
            "HAMLET:",
            "--max-new-tokens",
            "5",
            "--top-k",
            "5",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.startswith("HAMLET:"), run.stderr
    assert len(run.stdout.strip()) > len("HAMLET:")


def test_hostile_sampling_input_is_one_line_and_a_tiny_temperature_is_greedy(saved, capsys):
    """A billion tokens would run silently for ever; T = 1e-300 is 0 in float32 (0/0: NaN);
    bytes that are no UTF-8 reach Python as lone surrogates; torch takes seeds below 2**63."""
    good = ["--checkpoint", str(saved), "--prompt", "HAMLET:"]
    assert "at most 10,000" in one_error_line(capsys, good + ["--max-new-tokens", "1000000000"])
    assert "not UTF-8 text" in one_error_line(
        capsys,
        ["--checkpoint", str(saved), "--prompt", b"\xff\xfe".decode(errors="surrogateescape")],
    )
    assert "from 0 to 2**63 - 1" in one_error_line(capsys, good + ["--seed", str(2**70)])
    model, tokenizer = sample.load_model(saved)
    greedy = sample.generate(model, tokenizer, "HAMLET:", 12)
    assert sample.generate(model, tokenizer, "HAMLET:", 12, temperature=1e-300) == greedy
