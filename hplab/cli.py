"""train.py's command line: the flags, `--config` recipes, and refusals said as flags.

The layout flags come from `config.Layout`'s fields (`flags.add_flags`), the same ones the
planner's command line has; the rest are listed below. `parse_args` reads a TOML recipe from
`configs/` as the flags it stands for, so its values meet the same checks as typed ones, and
flags typed after it win. `in_flags` says a library refusal (a `LayoutError` naming its fields)
with the flags the user typed: `--zero 3 --pp 2: not supported: ZeRO-3 with a pipeline ...`.
"""

from __future__ import annotations

from pathlib import Path

from hplab.config import BALANCES, Layout, OptimConfig, from_values
from hplab.flags import COUNT, NONNEGATIVE, SEED, OneLineParser, add_flags, at_least, shown
from hplab.plan.formulas import LR_DECAYS

on = dict(action="store_true")
DEFAULT_MODEL = "tiny"  # --model's, when neither it nor --init-from names one
MODEL_FLAGS = {
    "--model": dict(  # (None until preflight: typed beside --init-from, it must agree with it)
        help=f"preset: tiny, gpt2, gpt2-medium (GPT-2); llama-tiny, llama-125m (default "
        f"{DEFAULT_MODEL})"
    ),
    "--n-layer": dict(type=COUNT),
    "--n-embd": dict(type=COUNT),
    "--n-head": dict(type=COUNT),
    "--n-kv-head": dict(type=COUNT, help="grouped-query attention's K/V heads (Llama models)"),
    "--seq-len": dict(type=COUNT),
    "--moe-experts": dict(type=at_least(0), default=0, help="experts per MLP"),
    "--moe-top-k": dict(type=COUNT, default=2, help="experts each token goes to"),
    "--moe-capacity-factor": dict(
        type=at_least(0, float, above=True),
        help="drop token-slots beyond cf · tokens · k / E per expert (default: none)",
    ),
    "--moe-aux-coef": dict(type=NONNEGATIVE, default=0.01, help="load-balancing loss weight"),
    "--moe-balance": dict(
        default="batch",
        choices=BALANCES,
        help="balance the experts over each microbatch's tokens, or per sequence (DeepSeek-V3)",
    ),
}
TRAINING_FLAGS = {
    "--data": dict(
        default="shakespeare", help="token file name in data/ or path (see python -m hplab.data)"
    ),
    "--steps": dict(type=COUNT, default=100),
    "--lr": dict(type=at_least(0, float, above=True), default=1e-3, help="peak lr"),
    "--warmup-steps": dict(type=at_least(0), default=0, help="lr up from 0 over N steps"),
    "--warmup-fraction": dict(type=NONNEGATIVE, help="or: a fraction of --steps"),
    "--lr-decay": dict(
        default="constant",
        choices=LR_DECAYS,
        help="then decay the lr to --min-lr at --decay-steps (default: --steps)",
    ),
    "--decay-steps": dict(type=COUNT),
    "--min-lr": dict(type=NONNEGATIVE, default=0.0),
    "--weight-decay": dict(type=NONNEGATIVE, default=0.0),
    "--no-decay-bias-norm": dict(
        on,
        help="no weight decay on biases, norms, embeddings (the default when --weight-decay > 0)",
    ),
    "--decay-bias-norm": dict(on, help="decay every parameter alike"),
    "--grad-clip": dict(
        type=NONNEGATIVE, default=0.0, help="clip gradients to this global L2 norm (0: off)"
    ),
    "--seed": dict(type=SEED, default=0),
    "--compile": dict(
        on,
        help="torch.compile each block's forward (faster on a GPU; the first step pays for "
        "compiling); with data parallel and ZeRO-1/2",
    ),
}


OUTPUT_FLAGS = {
    "--metrics": dict(help="write the metrics JSON here (rank 0)"),
    "--eval-every": dict(type=at_least(0), default=0, help="validation loss every N steps"),
    "--eval-batches": dict(type=COUNT, default=4, help="fixed validation batches of --batch-size"),
    "--save": dict(
        help="save a unified checkpoint to this directory at the end (one single-device, "
        "Hugging Face-loadable layout)"
    ),
    "--trace": dict(
        metavar="DIR",
        help="write a Chrome trace per rank, DIR/rank0.json, ... (ui.perfetto.dev) of the run's "
        "2nd and 3rd steps: forward per block, backward, every collective from launch to "
        "completion",
    ),
    "--save-every": dict(
        type=at_least(0),
        default=0,
        help="with --save: also save every N steps (0: only at the end)",
    ),
    "--resume": dict(
        metavar="DIR|auto",
        help="resume from a unified checkpoint directory, under any layout; --steps counts from "
        "the start of the first run. auto: from --save's checkpoint if there is one, else start "
        "afresh (a job that may be restarted)",
    ),
    "--async-save": dict(
        on,
        help="with --save: write each checkpoint in a background thread while training goes on "
        "(rank 0 first takes a consistent snapshot at the step boundary)",
    ),
    "--max-restarts": dict(
        type=at_least(0),
        default=0,
        help="with --nproc and --save: when a process dies or a collective times out, stop all "
        "and start them again from --save's newest checkpoint, up to N times",
    ),
    "--init-from": dict(
        metavar="DIR",
        help="start from the weights of a Hugging Face GPT-2 folder or checkpoint, in any "
        "layout: new optimizer, step 0",
    ),
    "--config": dict(help="a recipe file from configs/"),
    "--backend": dict(default="auto", choices=["auto", "gloo", "nccl"]),
    "--link": dict(
        metavar="BANDWIDTH[,LATENCY]",
        help="emulate a network between the ranks, e.g. 20MB/s,200us (every link), or two "
        "tiers, 'node=4 inside=900GB/s,2us between=50GB/s,5us': each collective then runs its "
        "ring over those links, asleep (hplab.runtime.link; default: HPLAB_LINK, else none); "
        "or a machine, h100-80g or 'h100-80g node=2', at its balance of compute to "
        "communication, measured on the run's model (hplab.runtime.balance)",
    ),
    "--nproc": dict(
        type=COUNT,
        help="launch N local processes yourself (checks the flags first, then starts and "
        "watches them); not needed under torchrun",
    ),
    "--no-progress": dict(on, help="no tqdm bar"),
}
# train.py's own defaults for layout fields (a laptop run), and what --dp means here
LAYOUT_DEFAULTS = dict(dp=None, batch_size=16)
LAYOUT_HELPS = dict(dp="data-parallel size (default: N / (tp × pp × cp))")


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="torchrun --nproc_per_node N hplab/train.py",
        description="Train hplab's GPT with any dp × cp × tp × pp layout (their product = N).",
    )
    add_flags(parser.add_argument_group("layout"), Layout, LAYOUT_DEFAULTS, helps=LAYOUT_HELPS)
    for title, flags in (("model", MODEL_FLAGS), ("training", TRAINING_FLAGS)):
        group = parser.add_argument_group(title)
        for name, kwargs in flags.items():
            group.add_argument(name, **kwargs)
    group = parser.add_argument_group("output")
    for name, kwargs in OUTPUT_FLAGS.items():
        group.add_argument(name, **kwargs)
    return parser


def parse_args(argv: list[str]):
    """Flags, with `--config FILE` (a TOML recipe from configs/) supplying defaults that the
    command line overrides. Keys are flag names (`batch-size` or `batch_size`); the recipe
    becomes the flags it stands for, so its values pass the same checks as typed ones."""
    parser = build_parser()
    first = parser.parse_args(argv)
    if not first.config:
        return first
    flags = recipe_flags(Path(first.config), parser)
    try:
        parser.parse_args(flags)
    except ValueError as err:
        raise ValueError(f"{first.config}: {err}") from None
    return parser.parse_args(flags + argv)  # a flag given twice: the last one wins


def recipe_flags(path: Path, parser) -> list[str]:
    """The flags a TOML recipe stands for: `batch-size = 16` → `--batch-size 16`; a switch
    `offload = true` → `--offload`; `recompute = true` → a bare `--recompute`."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    if not path.exists():
        raise ValueError(f"config file {path} not found: see configs/ for the recipes")
    if not path.is_file():  # (a folder, /dev/zero: reading it would never end)
        raise ValueError(f"config file {path} is not a regular file: give a .toml recipe")
    try:
        recipe = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from None
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    keys = {k: k.replace("-", "_") for k in recipe}
    if len(set(keys.values())) < len(keys):  # batch-size and batch_size: which one?
        twice = sorted(k for k in recipe if list(keys.values()).count(keys[k]) > 1)
        raise ValueError(f"{path}: {' and '.join(twice)} are the same setting: give it once")
    unknown = sorted(d for d in keys.values() if d not in actions or d in ("config", "help"))
    if unknown:
        raise ValueError(
            f"{path}: unknown setting(s) {', '.join(unknown)}; the keys are train.py's flag names"
        )
    flags = []
    for key, value in recipe.items():
        action = actions[keys[key]]
        name = action.option_strings[0]  # 0: a switch; "?": bare or valued
        nargs = action.nargs
        if (
            isinstance(value, (list, dict))
            or nargs != "?"
            and (nargs == 0) != isinstance(value, bool)
        ):
            want = "true or false" if nargs == 0 else "a single value"
            raise ValueError(f"{path}: {key} = {value!r} should be {want}")
        if isinstance(value, bool):
            flags += [name] if value else []
        else:
            flags += [name, str(value)]
    return flags


def layout_of(args) -> Layout:
    return from_values(Layout, vars(args))


def optim_of(args) -> OptimConfig:
    return from_values(OptimConfig, vars(args))


def in_flags(err: Exception, argv: list[str]) -> Exception:
    """A refusal from the library names its settings (config fields); say them as the flags
    the user gave, e.g. `--zero 3 --pp 2: not supported: ZeRO-3 with a pipeline ...`."""
    settings = getattr(err, "settings", ())  # (only after the flags were parsed: they parse)
    if not settings:
        return err
    parser = build_parser()
    defaults = {name: parser.get_default(name) for name in settings}
    typed = shown(settings, vars(parse_args(argv)), defaults)
    return ValueError(f"{typed}: {err}" if typed else str(err))
