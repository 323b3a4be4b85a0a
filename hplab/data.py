"""Data: the corpus, the tokenizers, the token dataset and the data-parallel sampler.

The path from text to a training batch, in the order this file walks it:

1. **Corpus.** ``data/shakespeare.txt`` holds a few public-domain plays, one after
   another, separated by a line ``<|endoftext|>``.
2. **Tokenizer.** Text becomes integer ids. We ship two byte-level BPE tokenizers:
   the real GPT-2 one (50257 ids) and ``hplab-bpe``, a small one (2048 ids) trained on
   the corpus so that tiny models have a tiny embedding table.
3. **Token file.** Tokenizing happens once, ahead of time: ``NAME.bin`` holds the ids
   (uint16), ``NAME.json`` beside it says which tokenizer made them. Training only reads numbers.
4. **TokenDataset.** Cuts the memory-mapped ``.bin`` into samples: input ``x`` and target
   ``y`` (``x`` shifted by one); ``split="val"`` is the last 5%, which training never reads.
5. **Sampler.** ``global_batch_indices`` picks the global batch of a step from (number of
   samples, step, batch size, seed) alone, never from how many ranks share it: that is why
   every parallel layout trains the same model, and why a checkpoint needs only the step
   number to resume on exactly the next batch. ``shard_for_rank`` gives each data-parallel
   rank its slice. Validation batches are fixed instead: batch ``k`` is samples ``[k*B,
   (k+1)*B)`` of ``split="val"``, the same at every evaluation in every layout (train.py).

``python -m hplab.data prepare`` turns your own JSONL corpus into a token file;
``data/build.py`` rebuilds the shipped ``data/`` folder. ``torch`` and ``transformers`` are
imported only inside the functions that need them, so ``import hplab.data`` is fast.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # for the type hints only; torch itself is imported where tensors are made
    import torch

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

END_OF_TEXT = "<|endoftext|>"
DOCUMENT_SEPARATOR = f"\n{END_OF_TEXT}\n"  # between plays in shakespeare.txt
TOKENIZER_FOLDERS = {"hplab-bpe": "hplab-bpe", "gpt2": "gpt2-tokenizer"}
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16: every id must be < 65536
VAL_FRACTION = 0.05  # the last 5% of a token file is the validation split


class DataError(Exception):
    """A problem with the user's data, reported as one line (no traceback)."""


# --- 1. The corpus -------------------------------------------------------------------------


def read_documents(corpus_path: Path) -> list[str]:
    """Split a corpus text file back into its documents (plays)."""
    text = Path(corpus_path).read_text(encoding="utf-8")
    return [doc for doc in text.split(DOCUMENT_SEPARATOR) if doc]


# --- 2. Tokenizers ------------------------------------------------------------------------


def load_tokenizer(name: str = "hplab-bpe"):
    """A ``transformers.GPT2Tokenizer`` for ``"hplab-bpe"`` or ``"gpt2"``: byte-level BPE stored
    as ``vocab.json`` + ``merges.txt`` in ``data/``, ``<|endoftext|>`` ending each document."""
    if name not in TOKENIZER_FOLDERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {sorted(TOKENIZER_FOLDERS)}")
    folder = DATA_DIR / TOKENIZER_FOLDERS[name]
    if not (folder / "vocab.json").exists():
        raise ValueError(f"tokenizer files missing in {folder}; see data/README.md to rebuild them")
    from transformers import GPT2Tokenizer  # lazy: keeps `import hplab.data` fast

    return GPT2Tokenizer.from_pretrained(str(folder))


def encode_documents(tokenizer, documents: list[str]) -> list[int]:
    """Token ids of the documents, with ``<|endoftext|>`` after each one."""
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    return [i for ids in tokenizer(documents)["input_ids"] for i in [*ids, end_id]]


# --- 3. Token files: NAME.bin (uint16 ids) + NAME.json (what they mean) -------------------


def write_sidecar(
    prefix: Path,
    tokenizer_name: str,
    vocab_size: int,
    num_tokens: int,
    num_documents: int,
    source: str,
) -> dict:
    """Write ``prefix.json``, the description of ``prefix.bin``; return it as a dict."""
    sidecar = {
        "tokenizer": tokenizer_name,
        "vocab_size": vocab_size,
        "dtype": "uint16",
        "num_tokens": num_tokens,
        "num_documents": num_documents,
        "source": source,
    }
    Path(f"{prefix}.json").write_text(json.dumps(sidecar, indent=2) + "\n", encoding="utf-8")
    return sidecar


def _jsonl_texts(input_path: Path, text_key: str):
    """The non-empty texts of a JSONL file, in order; a bad line raises DataError naming it."""
    from tqdm import tqdm

    with open(input_path, encoding="utf-8-sig") as lines:  # -sig: a byte-order mark is fine
        progress = tqdm(lines, desc="prepare", unit=" lines", leave=False)
        for number, line in enumerate(progress, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{input_path}:{number}: not valid JSON") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{input_path}:{number}: "
                    + (
                        "not a JSON object {...}"
                        if not isinstance(record, dict)
                        else f"no {text_key!r} key (use --text-key)"
                        if text_key not in record
                        else f"{text_key!r} is not a string"
                    )
                )
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # "\ud800" in JSON: a lone surrogate, no character
                raise DataError(
                    f"{input_path}:{number}: {text_key!r} holds a lone surrogate "
                    "(an escaped \\ud800-\\udfff without its pair), which is no text"
                ) from None
            if text:
                yield text


def check_outputs_free(input_path: Path, prefix: Path) -> None:
    """PREFIX.bin and PREFIX.json may be replaced only when they are an earlier `prepare`'s
    output (a sidecar that describes the .bin beside it), and never when one is the input."""
    outputs = [Path(f"{prefix}{ending}") for ending in (".bin", ".json")]
    for path in outputs:
        if path.exists() and input_path.exists() and path.samefile(input_path):
            raise DataError(f"--output-prefix {prefix} would write over the input {input_path}")
    if not any(path.exists() or path.is_symlink() for path in outputs):
        return
    try:
        sidecar = json.loads(outputs[1].read_text(encoding="utf-8"))
        ours = outputs[0].is_file() and outputs[0].stat().st_size == 2 * sidecar["num_tokens"]
    except (OSError, ValueError, TypeError, KeyError):
        ours = False
    if not ours or any(path.is_symlink() or not path.is_file() for path in outputs):
        raise DataError(
            f"{prefix}.bin or {prefix}.json exists and is not a token file `prepare` wrote: "
            "choose another --output-prefix (nothing was changed)"
        )


def prepare_jsonl(
    input_path: Path,
    prefix: Path,
    tokenizer_name: str = "hplab-bpe",
    text_key: str = "text",
    docs_per_batch: int = 1000,
) -> dict:
    """Tokenize a JSONL corpus (one ``{"id": ..., "text": ...}`` object per line), streamed in
    batches, so it may be larger than memory. Ids go to ``prefix.bin.tmp``, renamed to
    ``prefix.bin`` only when every line was fine: a failed run leaves no half-written data."""
    input_path, prefix = Path(input_path), Path(prefix)
    if not input_path.is_file():
        raise DataError(f"input file not found: {input_path}")
    check_outputs_free(input_path, prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    temporary_bin = Path(f"{prefix}.bin.tmp")
    tokenizer = None  # loaded on first use: bad input fails fast
    num_documents = 0
    num_tokens = 0
    texts = _jsonl_texts(input_path, text_key)
    try:
        with open(temporary_bin, "wb") as out:
            while batch := list(itertools.islice(texts, docs_per_batch)):
                tokenizer = tokenizer or load_tokenizer(tokenizer_name)
                ids = np.asarray(encode_documents(tokenizer, batch), dtype=TOKEN_DTYPE)
                ids.tofile(out)
                num_documents, num_tokens = num_documents + len(batch), num_tokens + len(ids)
        if num_documents == 0:
            raise DataError(f"{input_path}: empty corpus, no non-empty {text_key!r} found")
    except BaseException as error:
        texts.close()  # its progress bar too: a message after it starts on a line of its own
        temporary_bin.unlink(missing_ok=True)
        if isinstance(error, UnicodeDecodeError):
            raise DataError(f"{input_path}: not UTF-8 text") from None
        raise
    os.replace(temporary_bin, f"{prefix}.bin")
    return write_sidecar(
        prefix, tokenizer_name, len(tokenizer), num_tokens, num_documents, source=str(input_path)
    )


# --- 4. The dataset: fixed-length samples from a memory-mapped token file -----------------


def _find_token_file(path_or_name: str | Path, tokenizer: str) -> Path:
    """``"shakespeare"`` -> data/shakespeare.<tokenizer>.bin (./data first, then hplab's own);
    a path ``"some/dir/x"`` -> some/dir/x.<tokenizer>.bin or some/dir/x.bin."""
    path = Path(path_or_name)
    folders = [Path("data"), DATA_DIR] if len(path.parts) == 1 else [path.parent]
    candidates = (
        [path]
        if path.suffix == ".bin"
        else [
            folder / f"{path.name}{ending}"
            for folder in folders
            for ending in (f".{tokenizer}.bin", ".bin")
        ]
    )
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise ValueError(
        f"no token file {path_or_name} ({candidates[0]} not found): give its path "
        "without .bin, as written by `python -m hplab.data prepare --input "
        "FILE.jsonl --output-prefix PATH`"
    )


def _read_sidecar(bin_path: Path) -> dict:
    """The NAME.json written beside NAME.bin: which tokenizer made the ids, and how many."""
    path = bin_path.with_suffix(".json")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        return {"tokenizer": str(meta["tokenizer"]), "vocab_size": int(meta["vocab_size"])}
    except FileNotFoundError:
        raise ValueError(
            f"{bin_path} has no {path.name} beside it to say which tokenizer made "
            "it: write both with `python -m hplab.data prepare`"
        ) from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(
            f"{path} is damaged (need JSON with tokenizer and vocab_size): "
            "prepare the token file again"
        ) from None


class TokenDataset:
    """Non-overlapping samples cut from a token file (``split="train"``: the first 95%).

    Sample ``i`` covers tokens ``[i*seq_len, i*seq_len + seq_len + 1)``: its first ``seq_len``
    tokens are the input ``x``, its last ``seq_len`` the target ``y``. The file is memory-mapped:
    opening it costs no RAM, and every process of a run shares the operating system's cache.
    ``len`` and ``[i]`` are all ``torch.utils.data.DataLoader`` needs from a dataset."""

    def __init__(
        self,
        path_or_name: str | Path = "shakespeare",
        tokenizer: str = "hplab-bpe",
        seq_len: int = 64,
        split: str = "train",
    ):
        if split not in ("train", "val") or seq_len < 1:
            raise ValueError(f"need split 'train' or 'val' and seq_len >= 1: {split!r}, {seq_len}")
        self.path = _find_token_file(path_or_name, tokenizer)
        for path in (self.path, self.path.with_suffix(".json")):  # (reading a FIFO would wait,
            if path.exists() and not path.is_file():  # /dev/zero would never end)
                raise ValueError(
                    f"{path} is not a regular file (a FIFO, a device?): give the path of a "
                    "token file `python -m hplab.data prepare` wrote"
                )
        meta = _read_sidecar(self.path)
        if meta["tokenizer"] != tokenizer:
            raise ValueError(
                f"{self.path} was made with the {meta['tokenizer']!r} tokenizer but "
                f"this model uses {tokenizer!r}: prepare it again with --tokenizer "
                f"{tokenizer}, or pick the model for {meta['tokenizer']!r}"
            )
        self.tokenizer_name = tokenizer
        self.vocab_size = meta["vocab_size"]
        if self.path.stat().st_size % TOKEN_DTYPE.itemsize:
            raise ValueError(
                f"{self.path} is damaged: {self.path.stat().st_size} bytes is not a "
                "whole number of uint16 token ids; prepare it again"
            )
        all_tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        if len(all_tokens) and int(all_tokens.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.path} holds token id {int(all_tokens.max())}, beyond its "
                f"tokenizer's {self.vocab_size} ids: prepare it again"
            )
        train_end = int(len(all_tokens) * (1 - VAL_FRACTION))
        self.tokens = all_tokens[:train_end] if split == "train" else all_tokens[train_end:]
        self.seq_len = seq_len
        self.split = split
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"seq_len={seq_len} is too long: the {split} split of {self.path} "
                f"has only {len(self.tokens)} tokens; use a shorter --seq-len or "
                "more data"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


# --- 5. The sampler: which samples each step and each data-parallel rank sees -------------


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled sample order of one epoch, seeded by (seed, epoch) only."""
    order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    order.flags.writeable = False  # cached and shared between calls
    return order


def global_batch_indices(num_samples: int, step: int, global_batch: int, seed: int) -> list[int]:
    """Sample indices of the whole global batch at ``step`` (the same on every rank).

    Think of an endless stream: epoch 0's shuffled order, then epoch 1's, and so on. Step ``s``
    takes positions ``[s*global_batch, (s+1)*global_batch)`` of that stream, so a batch that
    runs past the end of an epoch continues into the next one.
    """
    positions = range(step * global_batch, (step + 1) * global_batch)
    return [
        int(_epoch_permutation(num_samples, seed, p // num_samples)[p % num_samples])
        for p in positions
    ]


def shard_for_rank(indices: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """The contiguous slice of the global batch that data-parallel rank ``dp_rank`` runs: rank
    ``r`` gets ``indices[r*b:(r+1)*b]`` with ``b = len(indices) // dp_size``."""
    if len(indices) % dp_size:
        raise ValueError(
            f"global batch of {len(indices)} samples does not split evenly over "
            f"dp={dp_size} ranks; choose a batch size divisible by {dp_size}"
        )
    per_rank = len(indices) // dp_size
    return list(indices[dp_rank * per_rank : (dp_rank + 1) * per_rank])


def get_batch(dataset: TokenDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into ``x, y`` tensors of shape ``[len(indices), seq_len]`` (int64)."""
    import torch

    samples = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


# --- Command line: prepare your own corpus (data/build.py rebuilds the shipped data/) ------


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; data problems print one ``error:`` line and return 2."""
    parser = argparse.ArgumentParser("python -m hplab.data", description=__doc__.split("\n")[0])
    prepare = parser.add_subparsers(dest="command", required=True).add_parser(
        "prepare", help="tokenize your own JSONL corpus"
    )
    prepare.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    prepare.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.json")
    prepare.add_argument("--tokenizer", choices=sorted(TOKENIZER_FOLDERS), default="hplab-bpe")
    prepare.add_argument("--text-key", default="text")
    args = parser.parse_args(argv)
    try:
        sidecar = prepare_jsonl(
            Path(args.input), Path(args.output_prefix), args.tokenizer, args.text_key
        )
    except (DataError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (nothing half-written is left: prepare_jsonl cleans up)
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print(
        f"wrote {args.output_prefix}.bin: {sidecar['num_documents']} documents, "
        f"{sidecar['num_tokens']} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
