"""Fine-tune a Hugging Face GPT-2 classifier with hplab's building blocks, in an ordinary loop.

    python examples/finetune_classification.py --init DIR                 # hplab.DDP
    python examples/finetune_classification.py --init DIR --wrap zero2    # hplab.ZeroOptimizer
    python examples/finetune_classification.py --init DIR --wrap fsdp     # hplab.fully_shard

This is what the Colossal-AI GPT-2 tutorial (one of the seed documents) does, at laptop size:

* **The model**: `transformers.GPT2ForSequenceClassification.from_pretrained(DIR)`, where DIR is
  any GPT-2 directory (config.json + model.safetensors; `train.py --save DIR` writes one). The
  pre-trained transformer is kept; the language-model head is dropped and a new 2-way `score`
  layer reads the hidden state of each example's last real token.
* **Padding**: GPT-2 has no pad token. Examples are padded on the right with `<|endoftext|>`
  (it never occurs inside a line) and `config.pad_token_id` names it, so the classifier finds
  the last token that is not padding; the attention mask hides the padding too.
* **The task**, built offline from the shipped corpus: which play do two lines of dialogue
  come from, *Hamlet* or *The Comedy of Errors*? Consecutive pairs of lines of at least 20
  characters (speaker names and stage directions left out), at most 40 tokens, shuffled with
  `--seed`; 400 pairs per play to train on, 100 per play held out. Chance is 50%.
* **The loop**: AdamW with no weight decay on biases and LayerNorm weights, a linear warm-up
  over the first 10% of the steps then linear decay to 0 (`get_linear_schedule_with_warmup`).
  Two processes (started by `hplab.runtime.launch.run_distributed`: NCCL and a GPU each where there
  are enough GPUs, else gloo on the CPU) each take half of every global batch; the wrapper averages
  the gradients, so every `--wrap` trains the same model.

It prints the held-out accuracy before and after fine-tuning; `--out PATH` writes the results
as JSON.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hplab from this repository

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hplab  # noqa: E402
from hplab.data import DATA_DIR, END_OF_TEXT, load_tokenizer, read_documents  # noqa: E402
from hplab.models.hf import config_from_hf  # noqa: E402
from hplab.runtime.group import current_device  # noqa: E402
from hplab.runtime.launch import run_distributed  # noqa: E402

PLAYS = {"HAMLET, PRINCE OF DENMARK": "Hamlet", "THE COMEDY OF ERRORS": "The Comedy of Errors"}
LINES_PER_EXAMPLE, TRAIN_PER_PLAY, TEST_PER_PLAY, SEQ_LEN = 2, 400, 100, 40


def labelled_lines(seed: int) -> tuple[list, list]:
    """(train, test): lists of (two lines, label), label = the play's index in PLAYS."""
    plays = {doc.split("\n", 1)[0]: doc for doc in read_documents(DATA_DIR / "shakespeare.txt")}
    train, test = [], []
    for label, title in enumerate(PLAYS):
        lines = [line.strip() for line in plays[title].splitlines()]
        lines = [
            line
            for line in lines  # dialogue: not "[Exit.]", not "HAMLET." on its own
            if len(line) >= 20 and not line.startswith("[") and not line.isupper()
        ]
        n = LINES_PER_EXAMPLE  # consecutive lines, joined: an example
        lines = [" ".join(lines[i : i + n]) for i in range(0, len(lines) - n + 1, n)]
        order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(seed + label))
        chosen = [(lines[i], label) for i in order[: TRAIN_PER_PLAY + TEST_PER_PLAY].tolist()]
        train += chosen[:TRAIN_PER_PLAY]
        test += chosen[TRAIN_PER_PLAY:]
    return train, test


def encode(tokenizer, examples: list, seq_len: int) -> dict:
    """Token ids cut to `seq_len` and padded on the right with <|endoftext|>, the mask, labels."""
    pad = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ids = [tokenizer.encode(line)[:seq_len] for line, _ in examples]
    return {
        "input_ids": torch.tensor([i + [pad] * (seq_len - len(i)) for i in ids]),
        "attention_mask": torch.tensor([[1] * len(i) + [0] * (seq_len - len(i)) for i in ids]),
        "labels": torch.tensor([label for _, label in examples]),
    }


def parameter_groups(model, weight_decay: float) -> list:
    """AdamW's two groups, by name (so they also hold fully_shard's shards, which keep the
    names): weight decay on the matrices, none on biases and LayerNorm (ln_*) weights."""
    no_decay = [name.endswith("bias") or ".ln_" in name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    return [
        {"params": [p for p, nd in zip(params, no_decay) if not nd], "weight_decay": weight_decay},
        {"params": [p for p, nd in zip(params, no_decay) if nd], "weight_decay": 0.0},
    ]


@torch.no_grad()
def accuracy(model, test: dict) -> float:
    """The share of held-out examples classified right: each rank scores every world-size-th
    one (rank 0 the 0th, 2nd, ... on 2 processes) and the counts are summed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {k: v[rank::world] for k, v in test.items()}
    model.eval()
    logits = model(input_ids=mine["input_ids"], attention_mask=mine["attention_mask"]).logits
    model.train()
    correct = (logits.argmax(-1) == mine["labels"]).sum().float().reshape(1)
    dist.all_reduce(correct)
    return correct.item() / len(test["labels"])


def finetune(args, train: dict, test: dict, pad_id: int) -> dict:
    """One rank's part (run by every process). The loop is the one of any PyTorch tutorial."""
    from transformers import GPT2ForSequenceClassification, get_linear_schedule_with_warmup
    from transformers.utils import logging

    logging.set_verbosity_error()  # not the notice that `score` is new: we know, we train it
    logging.disable_progress_bar()
    rank, world, device = (
        dist.get_rank(),
        dist.get_world_size(),
        current_device(),
    )
    train, test = ({k: v.to(device) for k, v in data.items()} for data in (train, test))
    torch.manual_seed(args.seed)  # the new `score` layer: the same on every rank
    model = GPT2ForSequenceClassification.from_pretrained(args.init, num_labels=2).to(device)
    model.config.pad_token_id = pad_id

    if args.wrap == "ddp":
        model = hplab.DDP(model)  # like DistributedDataParallel(model)
    elif args.wrap == "fsdp":  # like FSDP2: each block, then the root
        for block in model.transformer.h:
            hplab.fully_shard(block)
        hplab.fully_shard(model)
    groups = parameter_groups(model, args.weight_decay)
    if args.wrap in ("zero1", "zero2"):  # like ZeroRedundancyOptimizer(params, AdamW, ...)
        optimizer = hplab.ZeroOptimizer(
            groups, torch.optim.AdamW, stage=int(args.wrap[-1]), lr=args.lr
        )
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.lr)
    steps_per_epoch = len(train["labels"]) // args.batch_size
    total = args.epochs * steps_per_epoch
    scheduler = get_linear_schedule_with_warmup(optimizer, total // 10, total)

    before, losses, start = accuracy(model, test), [], time.perf_counter()
    for step in range(total):
        epoch, i = divmod(step, steps_per_epoch)
        order = torch.randperm(
            len(train["labels"]),  # the same order on every rank
            generator=torch.Generator().manual_seed(args.seed * 1000 + epoch),
        )
        batch = order[i * args.batch_size : (i + 1) * args.batch_size]
        mine = batch[rank::world]  # this rank's share of the global batch
        loss = model(**{k: v[mine] for k, v in train.items()}).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)  # for printing only: the global batch's mean loss
        losses.append(mean.item() / world)
    return {
        "wrap": args.wrap,
        "processes": world,
        "steps": total,
        "losses": losses,
        "accuracy_before": before,
        "accuracy_after": accuracy(model, test),
        "train_seconds": time.perf_counter() - start,
    }


def check_init(directory: str) -> tuple[str, int]:
    """(the shipped tokenizer that matches the GPT-2 directory `directory`, its n_positions);
    a ValueError that says why if there is none."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file() or not (Path(directory) / "model.safetensors").is_file():
        raise ValueError(
            f"{directory} is not a GPT-2 directory: it needs config.json and "
            "model.safetensors (train.py --save DIR writes both)"
        )
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{config_path} is not valid JSON") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise ValueError(f"{config_path} does not describe a GPT-2 model (model_type 'gpt2')")
    entry = config.get("hplab")  # an hplab checkpoint's own config, with its tokenizer
    name = entry["config"].get("tokenizer") if _has_config(entry) else None
    if name is None:  # any other GPT-2: the tokenizer with its vocabulary size
        by_vocab = {len(load_tokenizer(name)): name for name in ("hplab-bpe", "gpt2")}
        name = by_vocab.get(config.get("vocab_size"))
    if name is None:
        known = ", ".join(f"{n}: {v}" for v, n in by_vocab.items())
        raise ValueError(
            f"{config_path}: vocab_size {config.get('vocab_size')} matches no "
            f"shipped tokenizer ({known})"
        )
    try:  # its sizes and types as train.py reads them (one line if wrong)
        model = config_from_hf(config)
    except ValueError as err:
        raise ValueError(f"{config_path} {err}") from None
    return name, model.n_positions


def _has_config(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("config"), dict)


def is_results_file(path: Path) -> bool:
    """Whether `path` holds results this script wrote (which --out may replace)."""
    try:
        return "accuracy_after" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", required=True, help="a GPT-2 directory to start from")
    parser.add_argument("--wrap", choices=["ddp", "zero1", "zero2", "fsdp"], default="ddp")
    parser.add_argument("--nproc", type=int, default=2, help="processes")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="global, in examples")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    try:
        if (
            args.nproc < 1
            or args.epochs < 1
            or args.batch_size % args.nproc
            or not (args.nproc <= args.batch_size <= 2 * TRAIN_PER_PLAY)
        ):
            raise ValueError(
                f"need --nproc >= 1, --epochs >= 1 and a --batch-size of at most "
                f"{2 * TRAIN_PER_PLAY} that {args.nproc} processes share equally; "
                f"got {args.nproc}, {args.epochs}, {args.batch_size}"
            )
        tokenizer_name, n_positions = check_init(args.init)
        if args.out and Path(args.out).exists() and not is_results_file(Path(args.out)):
            raise ValueError(f"--out {args.out} exists: choose a new file (it was not changed)")
    except (ValueError, UnicodeDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokenizer, seq_len = load_tokenizer(tokenizer_name), min(SEQ_LEN, n_positions)
    train, test = (encode(tokenizer, examples, seq_len) for examples in labelled_lines(args.seed))
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    launch = run_distributed  # backend None: NCCL if each process has a GPU
    result = launch(finetune, args.nproc, args, train, test, pad_id, backend=None)[0]
    print(
        f"task: are two lines from {' or '.join(PLAYS.values())}? {len(train['labels'])} "
        f"examples to train on, {len(test['labels'])} held out; chance is 50%"
    )
    print(
        f"fine-tuned GPT2ForSequenceClassification from {args.init} with --wrap {args.wrap} "
        f"on {args.nproc} processes: {result['steps']} steps in {result['train_seconds']:.1f} s"
    )
    k = min(5, len(result["losses"]))
    print(
        f"loss: first {k} steps {sum(result['losses'][:k]) / k:.3f}, "
        f"last {k} steps {sum(result['losses'][-k:]) / k:.3f}"
    )
    print(
        f"held-out accuracy: before {result['accuracy_before']:.1%}, "
        f"after {result['accuracy_after']:.1%}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
