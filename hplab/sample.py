"""Sampling: read what a trained model writes, one token at a time.

Generation is a loop: run the text so far, take the last position's scores (logits) for every
possible next token, choose one, append it, repeat. **Greedy** takes the highest score (and is
prone to loops); **sampling** draws from softmax(logits / T) over the k highest (top-k): T < 1
sharpens, T > 1 flattens, k = 1 is greedy. The context is cropped to the model's n_positions.

    python -m hplab.sample --checkpoint DIR --prompt "HAMLET:" [--top-k 40 --temperature 0.8]
"""

import argparse
import sys
from pathlib import Path

import torch

from hplab import checkpoint
from hplab.data import load_tokenizer
from hplab.models.gpt import build_model

MAX_NEW_TOKENS = 10_000


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 40,
    top_k: int | None = None,
    temperature: float | None = None,
    seed: int = 0,
) -> str:
    """The prompt and its continuation. Greedy unless `top_k` or `temperature` is given; then
    sampled (from all tokens when `top_k` is None, T = 1 when `temperature` is None) with a
    generator seeded by `seed` alone, so the same call gives the same text. What cannot be
    sampled is a one-line ValueError."""
    if not prompt:
        raise ValueError("the prompt is empty: give the text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # (bytes that are no UTF-8 reach Python as lone surrogates)
        raise ValueError("the prompt is not UTF-8 text") from None
    for flag, value in (
        ("--max-new-tokens", max_new_tokens),
        ("--top-k", top_k),
        ("--temperature", temperature),
    ):
        if value is not None and not 0 < value < float("inf"):  # (NaN is refused too)
            raise ValueError(f"{flag} must be a positive, finite number, got {value}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens}: at most {MAX_NEW_TOKENS:,} (each token is one "
            "forward of the model)"
        )
    if not 0 <= seed < 2**63:
        raise ValueError(f"--seed {seed}: give a whole number from 0 to 2**63 - 1")
    ids = torch.tensor([tokenizer.encode(prompt)])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.config.n_positions :])[0][0, -1]  # the last position's
        next_id = logits.argmax()  # greedy
        if top_k is not None or temperature is not None:  # sampling instead
            top = torch.topk(logits, min(top_k or len(logits), len(logits)))
            scaled = (top.values.double() - top.values[0]) / (temperature or 1.0)  # (≤ 0, and
            # in float64: a tiny T, 1e-300, is not 0 there, and the best token keeps 0)
            next_id = top.indices[torch.multinomial(scaled.softmax(-1), 1, generator=generator)]
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return tokenizer.decode(ids[0])


def load_model(directory):
    """(model, tokenizer) from a `train.py --save` checkpoint (checksums verified) or any Hugging
    Face GPT-2, Llama or Qwen2 folder, in eval mode. Missing or damaged files: a
    CheckpointError (ValueError)."""
    saved = (
        checkpoint.load
        if (Path(directory) / "trainer_state.json").is_file()
        else checkpoint.load_pretrained
    )(directory)
    config = saved["config"]
    tokenizer = load_tokenizer(config.tokenizer)
    if len(tokenizer) > config.vocab_size:  # (its ids would index past the embedding)
        raise ValueError(
            f"{directory}: its config.json names the tokenizer {config.tokenizer!r} "
            f"({len(tokenizer)} ids) for a model of {config.vocab_size}: the model was not "
            "trained on it"
        )
    model = build_model(config)
    model.load_state_dict(saved["model"])
    return model.eval(), tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m hplab.sample", description=__doc__.split("\n")[0])
    parser.error = lambda message: parser.exit(2, f"hplab: error: {message} (see --help)\n")
    parser.add_argument("--checkpoint", required=True, help="a --save or save_pretrained folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    parser.add_argument("--temperature", type=float, help="divide the logits by T, then sample")
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    args = parser.parse_args(argv)
    try:
        print(
            generate(
                *load_model(args.checkpoint),
                args.prompt,
                args.max_new_tokens,
                args.top_k,
                args.temperature,
                args.seed,
            )
        )
    except (ValueError, OSError) as err:  # a CheckpointError is a ValueError
        print(f"hplab: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hplab: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
