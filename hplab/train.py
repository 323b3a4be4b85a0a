"""Train the GPT on many processes: `torchrun --nproc_per_node N hplab/train.py [flags]`.

Every process runs this same file. Each one joins the process group, finds its place in the
dp × tp × pp mesh, builds the same initial model from the seed, and trains on its share of
each global batch. Rank 0 shows a progress bar, prints a summary at the end, and writes the
metrics file (`--metrics PATH`) that the labs, tests and benchmarks read.

With the defaults the run finishes in well under a minute on a 2-core laptop:

    torchrun --nproc_per_node 4 hplab/train.py --dp 4
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: import hplab from the repo
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p not in ("", here)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hplab.formulas import SCHEDULES

METRICS_VERSION = 1


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (via ValueError) instead of usage text."""

    def error(self, message):
        raise ValueError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="torchrun --nproc_per_node N hplab/train.py",
        description="Train hplab's GPT with any dp × tp × pp layout (dp × tp × pp = N).")
    layout = p.add_argument_group("layout")
    layout.add_argument("--dp", type=int, default=None,
                        help="data-parallel size (default: N / (tp × pp))")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    layout.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage over the data-parallel group")
    layout.add_argument("--schedule", default="1f1b",
                        choices=SCHEDULES,
                        help="pipeline schedule")
    layout.add_argument("--virtual-stages", type=int, default=1,
                        help="model chunks per pipeline rank (interleaved schedule)")
    layout.add_argument("--microbatches", type=int, default=1,
                        help="microbatches per step (gradient accumulation, pipeline fill)")
    layout.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: split layer norms and dropout along the sequence")
    layout.add_argument("--bucket-mb", type=float, default=25.0,
                        help="data-parallel gradient bucket size in MiB")
    model = p.add_argument_group("model")
    model.add_argument("--model", default="tiny", help="preset: tiny, gpt2, gpt2-medium")
    model.add_argument("--n-layer", type=int)
    model.add_argument("--n-embd", type=int)
    model.add_argument("--n-head", type=int)
    model.add_argument("--seq-len", type=int)
    train = p.add_argument_group("training")
    train.add_argument("--data", default="shakespeare",
                       help="token file name in data/ or path (see python -m hplab.data)")
    train.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    train.add_argument("--steps", type=int, default=100)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--grad-clip", type=float, default=0.0,
                       help="clip gradients to this global L2 norm (0: off)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    train.add_argument("--recompute", action="store_true",
                       help="recompute each block's activations in backward")
    train.add_argument("--offload", action="store_true",
                       help="keep optimizer state and step on the CPU (with --zero)")
    out = p.add_argument_group("output")
    out.add_argument("--metrics", help="write the metrics JSON here (rank 0)")
    out.add_argument("--save", help="save a unified checkpoint to this directory at the end "
                                    "(one single-device, Hugging Face-loadable layout)")
    out.add_argument("--save-every", type=int, default=0,
                     help="with --save: also save every N steps (0: only at the end)")
    out.add_argument("--resume", help="resume from a unified checkpoint directory, under any "
                                      "layout; --steps counts from the start of the first run")
    out.add_argument("--config", help="a recipe file from configs/")
    out.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    out.add_argument("--nproc", type=int, default=None,
                     help="launch N local processes yourself (checks the flags first, then "
                          "runs torch.distributed.run); not needed under torchrun")
    out.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def parse_args(argv: list[str]):
    """Flags, with `--config FILE` (a TOML recipe from configs/) supplying defaults that the
    command line overrides. Keys are flag names (`batch-size` or `batch_size`)."""
    parser = build_parser()
    first = parser.parse_args(argv)
    if first.config:
        path = Path(first.config)
        if not path.exists():
            raise ValueError(f"config file {path} not found: see configs/ for the recipes")
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        try:
            recipe = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path} is not valid TOML: {err}") from None
        known = {a.dest for a in parser._actions}
        values = {k.replace("-", "_"): v for k, v in recipe.items()}
        unknown = sorted(set(values) - known - {"config"})
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; the keys are "
                             "train.py's flag names")
        parser.set_defaults(**values)
        return parser.parse_args(argv)
    return first


def resolve_layout(args, world_size: int) -> None:
    """Fill in --dp when omitted and check dp × tp × pp = world size (LayoutError if not)."""
    from hplab.dist import LayoutError, check_layout

    if args.dp is None:
        if world_size % (args.tp * args.pp):
            raise LayoutError(f"{world_size} processes cannot be split into tp={args.tp} × "
                              f"pp={args.pp} groups: make tp × pp divide --nproc_per_node")
        args.dp = world_size // (args.tp * args.pp)
    check_layout(world_size, args.dp, args.tp, args.pp)


def check_batch(args) -> None:
    per_rank, rest = divmod(args.batch_size, args.dp)
    if rest or per_rank == 0:
        raise ValueError(f"--batch-size {args.batch_size} does not split over dp={args.dp} "
                         f"ranks: use a multiple of {args.dp}")
    if per_rank % args.microbatches:
        raise ValueError(f"each data-parallel rank gets {per_rank} sequences, which do not split "
                         f"into --microbatches {args.microbatches}: make batch-size / dp a "
                         "multiple of the microbatch count")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.save_every < 0 or (args.save_every and not args.save):
        raise ValueError(f"--save-every {args.save_every} needs --save DIR and N ≥ 0")


def preflight(args, world_size: int):
    """Every check that needs no process group, so a bad command line fails at once with one
    line (LayoutError / ValueError) instead of after N processes have started."""
    from hplab.data import TokenDataset
    from hplab.models.gpt import config_from_preset
    from hplab.compose import ParallelConfig, check_config

    resolve_layout(args, world_size)
    check_batch(args)
    config = config_from_preset(args.model, args.n_layer, args.n_embd, args.n_head, args.seq_len)
    check_config(ParallelConfig.from_namespace(args), config.n_layer)
    if args.resume:
        from hplab import checkpoint

        found = checkpoint.find(args.resume)  # CheckpointError (one line) if there is none
        step = json.loads((found / "trainer_state.json").read_text())["step"]
        if step >= args.steps:
            raise checkpoint.CheckpointError(
                f"{found} is already at step {step}: ask for more with --steps (it counts "
                "from the first run's start)")
    dataset = TokenDataset(args.data, tokenizer=config.tokenizer, seq_len=config.n_positions)
    if dataset.vocab_size > config.vocab_size:
        raise ValueError(f"{args.data} uses {dataset.vocab_size} token ids but the model has a "
                         f"vocabulary of {config.vocab_size}")
    return config, dataset


def launch(args, argv: list[str]) -> int:
    """`--nproc N` without torchrun: check the flags, then start N processes of this file."""
    import subprocess

    from hplab.dist import torchrun_command

    i = argv.index("--nproc") if "--nproc" in argv else None
    rest = argv[:i] + argv[i + 2:] if i is not None else [a for a in argv
                                                          if not a.startswith("--nproc=")]
    return subprocess.call(torchrun_command(args.nproc, str(Path(__file__).resolve()), *rest))


def summary_table(metrics: dict) -> str:
    """The end-of-run report: loss, throughput; per rank its mesh coordinates, memory by kind,
    and communication by dimension (dp / tp / pp / world) as calls and MiB."""
    MiB = 2**20
    steps = metrics["steps"]
    lines = [f"loss {steps[0]['loss']:.4f} → {steps[-1]['loss']:.4f} over {len(steps)} steps; "
             f"{metrics['tokens_per_s']:,.0f} tokens/s on {metrics['world_size']} processes "
             f"({metrics['backend']})", "",
             "memory per rank (MiB)   params    grads    optim   master  activ.     peak"]
    coords = [f"dp{c['dp_rank']} tp{c['tp_rank']} pp{c['pp_rank']}"
              for c in metrics.get("mesh") or [{"dp_rank": 0, "tp_rank": 0, "pp_rank": 0}] *
              len(metrics["memory"])]
    for r, m in enumerate(metrics["memory"]):
        lines.append(f"  rank {r} {coords[r]:<15}" + "".join(
            f"{m[k] / MiB:9.2f}" for k in ("params_bytes", "grads_bytes", "optim_bytes",
                                           "master_bytes", "activation_bytes", "peak_bytes")))
    by_group = metrics.get("comm_by_group") or [{"all": c} for c in metrics["comm"]]
    for family in ("dp", "tp", "pp", "world", "all"):
        rows = [g.get(family, {}) for g in by_group]
        ops = sorted({op for row in rows for op in row})
        if not ops:
            continue
        lines += ["", f"communication over {family} (calls / MiB)".ljust(25) +
                  "".join(f"{op:>22}" for op in ops)]
        for r, c in enumerate(rows):
            cells = [f"{c[op]['calls']:>8} / {c[op]['bytes'] / MiB:10.2f}" if op in c else
                     f"{'-':>21}" for op in ops]
            lines.append(f"  rank {r} {coords[r]:<15} " + " ".join(cells))
    return "\n".join(lines)


def resume(par, args, config) -> int:
    """Load a unified checkpoint into this layout; return the step to continue from."""
    from hplab import checkpoint

    saved = checkpoint.load(args.resume)  # every rank reads it: the files are local
    checkpoint.check_compatible(saved["config"], config)
    state = saved["trainer_state"]
    checkpoint.load_full_state(par, saved["model"], saved["optimizer"])
    checkpoint.restore_rng(saved["rng"])
    scaler = par.precision.scaler
    if scaler is not None and "loss_scale" in state:
        scaler.scale, scaler.good_steps = state["loss_scale"], state["good_steps"]
    return state["step"]


def save(par, args, config, step: int, steps: list) -> None:
    """Gather the single-device state (a collective), rank 0 writes it atomically, then
    everyone waits so no rank runs ahead of a checkpoint still being written."""
    import torch.distributed as dist

    from hplab import checkpoint

    ledger = par.mesh.ledger  # the gathers are checkpoint traffic, not training: unrecorded
    training_traffic = ledger.by_group
    ledger.reset()
    model_state, optimizer_state = checkpoint.gather_full_state(par)
    ledger.by_group = training_traffic
    if dist.get_rank() == 0:
        scaler = par.precision.scaler
        trainer_state = {"step": step, "config": vars(args),
                         "losses": [s["loss"] for s in steps]}
        if scaler is not None:
            trainer_state.update(loss_scale=scaler.scale, good_steps=scaler.good_steps)
        checkpoint.save(args.save, config, model_state, optimizer_state, trainer_state)
    dist.barrier()


def run(args) -> dict | None:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from hplab.data import get_batch, global_batch_indices, shard_for_rank
    from hplab.dist import Mesh, init_distributed
    from hplab.models.gpt import build_model
    from hplab.compose import ParallelConfig, parallelize, pipeline_report, train_step

    config, dataset = preflight(args, int(os.environ.get("WORLD_SIZE", 1)))
    device = init_distributed(None if args.backend == "auto" else args.backend)
    mesh = Mesh.create(args.dp, args.tp, args.pp, device)
    model = build_model(config, args.seed).to(device)
    par = parallelize(model, mesh, ParallelConfig.from_namespace(args))
    first_step = resume(par, args, config) if args.resume else 0

    is_rank0 = mesh.rank == 0
    bar = tqdm(range(first_step, args.steps), disable=not is_rank0 or args.no_progress,
               unit="step", dynamic_ncols=True, file=sys.stdout)
    steps, tokens_per_step = [], args.batch_size * config.n_positions
    for step in bar:
        indices = global_batch_indices(len(dataset), step, args.batch_size, args.seed)
        x, y = get_batch(dataset, shard_for_rank(indices, mesh.dp_rank, mesh.dp_size))
        start = time.perf_counter()
        loss = train_step(par, x.to(device), y.to(device))
        elapsed = time.perf_counter() - start
        steps.append({"step": step, "loss": loss, "time_s": elapsed, "tokens": tokens_per_step})
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / elapsed:,.0f}")
        if args.save and (step + 1 == args.steps or
                          (args.save_every and (step + 1) % args.save_every == 0)):
            save(par, args, config, step + 1, steps)
    bar.close()

    # First step excluded from throughput: it pays one-time costs (allocations, warm-up).
    timed = steps[1:] or steps
    per_rank = {"memory": par.memory.as_dict(), "comm": mesh.ledger.as_dict(),
                "comm_by_group": mesh.ledger.by_group_dict(), "mesh": mesh.describe(),
                # the last step's timeline of every F, B, W, send, recv (--pp > 1)
                "pipeline": pipeline_report(par) if args.pp > 1 else None}
    gathered = [None] * dist.get_world_size() if is_rank0 else None
    dist.gather_object(per_rank, gathered, dst=0)
    # every rank's collectives, in every group, are finished before any process tears gloo
    # down (a process exiting with work in flight aborts with "terminate called ...")
    mesh.drain()
    if not is_rank0:
        return None
    return {
        "version": METRICS_VERSION,
        "config": vars(args),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": device.type,
        "model": {"num_params": config.num_params(), **vars(config)},
        "steps": steps,
        "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["time_s"] for s in timed),
        "memory": [g["memory"] for g in gathered],
        "comm": [g["comm"] for g in gathered],
        "comm_by_group": [g["comm_by_group"] for g in gathered],
        "mesh": [g["mesh"] for g in gathered],
        "pipeline": None if gathered[0]["pipeline"] is None else {
            "schedule": args.schedule, "stages": args.pp, "microbatches": args.microbatches,
            "virtual_stages": args.virtual_stages,
            **{key: [g["pipeline"][key] for g in gathered] for key in gathered[0]["pipeline"]}},
    }


def with_flags(err: Exception, argv: list[str]) -> Exception:
    """A refusal from the library names its settings (config fields); say them as the flags
    the user gave, e.g. `--zero 3 --pp 2: not supported: ZeRO-3 with a pipeline ...`."""
    settings = getattr(err, "settings", ())
    if not settings:
        return err
    try:
        args = parse_args(argv)
    except ValueError:
        return err
    defaults, shown = build_parser(), []
    for name in settings:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value != defaults.get_default(name):
            shown.append(flag if value is True else f"{flag} {value}")
    return ValueError(f"{' '.join(shown)}: {err}" if shown else str(err))


def main(argv: list[str] | None = None) -> int:
    from hplab.dist import shutdown

    argv = sys.argv[1:] if argv is None else list(argv)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    is_rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        args = parse_args(argv)
        if args.nproc and not under_torchrun:
            preflight(args, args.nproc)
            return launch(args, argv)
        metrics = run(args)
    except (ValueError, RuntimeError) as err:  # includes LayoutError, CommTimeout
        err = with_flags(err, argv)
        if is_rank0 or "timed out" in str(err):
            print(f"hplab: error: {err}", file=sys.stderr)
        shutdown()
        return 2
    if metrics is not None:
        print("\n" + summary_table(metrics))
        if args.metrics:
            path = Path(args.metrics)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(metrics, indent=1))
            os.replace(tmp, path)  # readers never see half a file
            print(f"metrics written to {path}")
    shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written and every process group destroyed: leave now rather than through
    # interpreter finalization, where gloo's worker threads have been seen to abort the process
    # ("terminate called without an active exception", pytorch/pytorch#190489) after a
    # successful run — turning it into a failed launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
