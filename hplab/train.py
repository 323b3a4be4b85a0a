"""Train the GPT on many processes: `torchrun --nproc_per_node N hplab/train.py [flags]`.

Every process runs this same file. Each one joins the process group, finds its place in the
dp × tp × pp mesh, builds the same initial model from the seed, and trains on its share of
each global batch. Rank 0 shows a progress bar, prints a summary at the end, and writes the
metrics file (`--metrics PATH`) that the labs, tests and benchmarks read.

With the defaults the run finishes in well under a minute on a 2-core laptop:

    torchrun --nproc_per_node 4 hplab/train.py --dp 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while torch is still importing: one line, no traceback
    signal.signal(
        signal.SIGINT, lambda *_: (print("hplab: interrupted", file=sys.stderr), os._exit(130))
    )
if __name__ == "__main__" and not __package__:  # run as a script: import hplab from the repo
    here = Path(__file__).resolve().parent  # (no stdlib name among hplab's modules)
    sys.path[:] = [str(here.parent)] + [p for p in sys.path if p not in ("", str(here))]

from hplab.formulas import CP_SPLITS, CP_STYLES, LR_DECAYS, SCHEDULES
from hplab.metrics import METRICS_VERSION, columns, is_metrics_file, summary_table
from hplab.metrics import write as write_metrics
from hplab.observe import Recorder, is_trace_folder


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (via ValueError) instead of usage text."""

    def error(self, message):
        raise ValueError(f"{message} (see --help)")


def at_least(low: float, kind=int, above: bool = False):
    """An argparse type: a number of `kind` that is at least `low` (`above`: more than `low`)."""

    def parse(text: str):
        value = kind(text)
        if value < low or above and not value > low:
            raise argparse.ArgumentTypeError(
                f"must be {'a positive number' if above else f'at least {low}'}, got {text}"
            )
        return value

    parse.__name__ = "positive_float" if above else kind.__name__  # "invalid int value"
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="torchrun --nproc_per_node N hplab/train.py",
        description="Train hplab's GPT with any dp × tp × pp layout (dp × tp × pp = N).",
    )
    n, on, nonneg = dict(type=at_least(1)), dict(action="store_true"), dict(type=at_least(0, float))
    for title, flags in {
        "layout": {
            "--dp": dict(n, help="data-parallel size (default: N / (tp × pp))"),
            "--tp": dict(n, default=1, help="tensor-parallel size"),
            "--pp": dict(n, default=1, help="pipeline-parallel stages"),
            "--zero": dict(
                type=int,
                default=0,
                choices=[0, 1, 2, 3],
                help="ZeRO stage over the data-parallel group",
            ),
            "--schedule": dict(default="1f1b", choices=SCHEDULES, help="pipeline schedule"),
            "--virtual-stages": dict(
                n, default=1, help="model chunks per pipeline rank (interleaved schedule)"
            ),
            "--microbatches": dict(
                n, default=1, help="microbatches per step (gradient accumulation, pipeline fill)"
            ),
            "--sequence-parallel": dict(
                on, help="with --tp: split layer norms and dropout along the sequence"
            ),
            "--ep": dict(n, default=1, help="expert-parallel size, out of the --dp ranks"),
            "--cp": dict(n, default=1, help="context-parallel size: ranks sharing each sequence"),
            "--cp-style": dict(
                default="ring",
                choices=CP_STYLES,
                help="context-parallel attention: K/V around a ring, or Ulysses' all-to-all",
            ),
            "--cp-split": dict(
                default="zigzag",
                choices=CP_SPLITS,
                help="the sequence's cut over --cp: zig-zag evens the causal mask's work",
            ),
            "--bucket-mb": dict(
                nonneg, default=25.0, help="data-parallel gradient bucket size in MiB"
            ),
        },
        "model": {
            "--model": dict(default="tiny", help="preset: tiny, gpt2, gpt2-medium"),
            "--n-layer": n,
            "--n-embd": n,
            "--n-head": n,
            "--seq-len": n,
            "--moe-experts": dict(type=at_least(0), default=0, help="experts per MLP"),
            "--moe-top-k": dict(n, default=2, help="experts each token goes to"),
            "--moe-capacity-factor": dict(
                type=at_least(0, float, above=True),
                help=("drop token-slots beyond cf · tokens · k / E per expert (default: none)"),
            ),
            "--moe-aux-coef": dict(nonneg, default=0.01, help="load-balancing loss weight"),
        },
        "training": {
            "--data": dict(
                default="shakespeare",
                help="token file name in data/ or path (see python -m hplab.data)",
            ),
            "--batch-size": dict(n, default=16, help="global batch, in sequences"),
            "--steps": dict(n, default=100),
            "--lr": dict(type=at_least(0, float, above=True), default=1e-3, help="peak lr"),
            "--warmup-steps": dict(type=at_least(0), default=0, help="lr up from 0 over N steps"),
            "--warmup-fraction": dict(type=at_least(0, float), help="or: a fraction of --steps"),
            "--lr-decay": dict(
                default="constant",
                choices=LR_DECAYS,
                help="then decay the lr to --min-lr at --decay-steps (default: --steps)",
            ),
            "--decay-steps": n,
            "--min-lr": dict(nonneg, default=0.0),
            "--weight-decay": dict(nonneg, default=0.0),
            "--no-decay-bias-norm": dict(
                on,
                help="no weight decay on biases, norms, embeddings "
                "(the default when --weight-decay > 0)",
            ),
            "--decay-bias-norm": dict(on, help="decay every parameter alike"),
            "--grad-clip": dict(
                nonneg, default=0.0, help="clip gradients to this global L2 norm (0: off)"
            ),
            "--seed": dict(type=int, default=0),
            "--precision": dict(default="fp32", choices=["fp32", "bf16", "fp16"]),
            "--recompute": dict(on, help="recompute each block's activations in backward"),
            "--offload": dict(on, help="keep optimizer state and step on the CPU (with --zero)"),
        },
        "output": {
            "--metrics": dict(help="write the metrics JSON here (rank 0)"),
            "--eval-every": dict(type=at_least(0), default=0, help="validation loss every N steps"),
            "--eval-batches": dict(n, default=4, help="fixed validation batches of --batch-size"),
            "--save": dict(
                help="save a unified checkpoint to this directory at the end "
                "(one single-device, Hugging Face-loadable layout)"
            ),
            "--trace": dict(
                metavar="DIR",
                help="write a Chrome trace per rank, DIR/rank0.json, "
                "... (ui.perfetto.dev) of the run's 2nd and 3rd steps: forward per "
                "block, backward, every collective from launch to completion",
            ),
            "--save-every": dict(
                type=at_least(0),
                default=0,
                help="with --save: also save every N steps (0: only at the end)",
            ),
            "--resume": dict(
                help="resume from a unified checkpoint directory, under any "
                "layout; --steps counts from the start of the first run"
            ),
            "--init-from": dict(
                metavar="DIR",
                help="start from the weights of a Hugging Face "
                "GPT-2 folder or checkpoint, in any layout: new optimizer, step 0",
            ),
            "--config": dict(help="a recipe file from configs/"),
            "--backend": dict(default="auto", choices=["auto", "gloo", "nccl"]),
            "--nproc": dict(
                n,
                help="launch N local processes yourself (checks the flags "
                "first, then starts and watches them); not needed under torchrun",
            ),
            "--no-progress": dict(on, help="no tqdm bar"),
        },
    }.items():
        group = p.add_argument_group(title)
        for flag, kwargs in flags.items():
            group.add_argument(flag, **kwargs)
    return p


def parse_args(argv: list[str]):
    """Flags, with `--config FILE` (a TOML recipe from configs/) supplying defaults that the
    command line overrides. Keys are flag names (`batch-size` or `batch_size`); the recipe
    becomes the flags it stands for, so its values pass the same checks as typed ones."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    parser = build_parser()
    first = parser.parse_args(argv)
    if not first.config:
        return first
    path = Path(first.config)
    if not path.is_file():
        raise ValueError(f"config file {path} not found: see configs/ for the recipes")
    try:
        recipe = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from None
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    unknown = sorted(
        k
        for k in (k.replace("-", "_") for k in recipe)
        if k not in actions or k in ("config", "help")
    )
    if unknown:
        raise ValueError(
            f"{path}: unknown setting(s) {', '.join(unknown)}; the keys are train.py's flag names"
        )
    flags = []
    for key, value in recipe.items():
        action = actions[key.replace("-", "_")]
        flag, switch = action.option_strings[0], action.nargs == 0
        if switch != isinstance(value, bool) or isinstance(value, (list, dict)):
            want = "true or false" if switch else "a single value"
            raise ValueError(f"{path}: {key} = {value!r} should be {want}")
        flags += ([flag] if value else []) if switch else [flag, str(value)]
    try:
        parser.parse_args(flags)
    except ValueError as err:
        raise ValueError(f"{first.config}: {err}") from None
    return parser.parse_args(flags + argv)  # a flag given twice: the last one wins


def preflight(args, world_size: int):
    """Every check that needs no process group, so a bad command line fails at once with one
    line (LayoutError / ValueError) instead of after N processes have started. Fills in --dp,
    --warmup-steps (from --warmup-fraction) and --decay-steps; returns the model config, the
    dataset, the checkpoint to resume and the validation split (None without them)."""
    from hplab import checkpoint
    from hplab.compose import ParallelConfig, check_config
    from hplab.config import Layout, check_mesh, resolve_dp
    from hplab.data import TokenDataset
    from hplab.models.gpt import config_from_preset

    if args.dp is None:
        args.dp = resolve_dp(world_size, args.tp, args.pp, args.cp)
    check_mesh(Layout(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp), world_size)
    per_rank, rest = divmod(args.batch_size, args.dp)
    if rest:
        raise ValueError(
            f"--batch-size {args.batch_size} does not split over dp={args.dp} "
            f"ranks: use a multiple of {args.dp}"
        )
    if per_rank % args.microbatches:
        raise ValueError(
            f"each data-parallel rank gets {per_rank} sequences, which do not split "
            f"into --microbatches {args.microbatches}: make batch-size / dp a "
            "multiple of the microbatch count"
        )
    if args.warmup_fraction is not None:  # the lr schedule, in steps
        if args.warmup_steps:
            raise ValueError("give --warmup-steps or --warmup-fraction, not both")
        args.warmup_steps = round(args.warmup_fraction * args.steps)
    if args.lr_decay != "constant":
        args.decay_steps = args.decay_steps or args.steps
    if args.warmup_steps > max(args.steps, args.decay_steps or 0):  # (a run stopping early)
        raise ValueError(
            f"the warm-up ({args.warmup_steps} steps) is longer than the run "
            f"(--steps {args.steps}) and --decay-steps"
        )
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}: it decays to it")
    if args.lr_decay != "constant" and args.decay_steps <= args.warmup_steps:
        raise ValueError(
            f"--decay-steps {args.decay_steps} must be larger than the warm-up "
            f"({args.warmup_steps} steps)"
        )
    if args.no_decay_bias_norm and args.decay_bias_norm:
        raise ValueError("give --no-decay-bias-norm or --decay-bias-norm, not both")
    args.no_decay_bias_norm = args.weight_decay > 0 and not args.decay_bias_norm  # (as the seeds)
    if args.save_every and not args.save:
        raise ValueError(f"--save-every {args.save_every} needs --save DIR")
    if args.init_from and args.resume:
        raise ValueError("--init-from starts a new run, --resume continues one: give one of them")
    saved = checkpoint.load_pretrained(args.init_from) if args.init_from else None
    model = (
        saved["config"]
        if saved and args.model == build_parser().get_default("model")
        else args.model
    )  # --init-from: its config.json sets the model, flags may only agree
    config = config_from_preset(model, args.n_layer, args.n_embd, args.n_head, args.seq_len)
    if args.moe_experts:  # each block's MLP a mixture of experts
        config = dataclasses.replace(
            config,
            n_experts=args.moe_experts,
            moe_top_k=args.moe_top_k,
            moe_capacity_factor=args.moe_capacity_factor or 0.0,
            moe_aux_coef=args.moe_aux_coef,
        )
    if saved:  # (after --moe-experts, which it may contradict too)
        checkpoint.check_compatible(
            saved["config"],
            config,
            f"leave those flags out: --init-from {args.init_from} sets the model",
        )
    check_config(ParallelConfig.from_namespace(args), config)
    if args.resume:  # damaged, of another shape, or already done: say so before starting
        saved = checkpoint.load(args.resume)
        checkpoint.check_compatible(saved["config"], config)
        state, step = saved["trainer_state"], saved["trainer_state"]["step"]
        if step >= args.steps:
            raise checkpoint.CheckpointError(
                f"{saved['directory']} is already at step {step}: ask for more with --steps "
                "(it counts from the first run's start)"
            )
        shape = ("warmup_steps", "lr_decay", "decay_steps", "min_lr")  # (--lr may change)
        changed = [
            f"--{k.replace('_', '-')} {state['config'][k]}"
            for k in shape
            if "lr_scheduler" in state and state["config"][k] != getattr(args, k)
        ]
        if changed:  # (older checkpoints, without one, had a constant lr)
            raise checkpoint.CheckpointError(
                f"{saved['directory']} continues its lr schedule: resume with {' '.join(changed)}"
            )
    check_outputs(args, checkpoint)
    check_machine(args, config, world_size)
    tokens = functools.partial(TokenDataset, args.data, config.tokenizer, config.n_positions)
    dataset, validation = tokens(), tokens(split="val") if args.eval_every else None
    if dataset.vocab_size > config.vocab_size:
        raise ValueError(
            f"{args.data} uses {dataset.vocab_size} token ids but the model has a "
            f"vocabulary of {config.vocab_size}"
        )
    if validation is not None and len(validation) < args.eval_batches * args.batch_size:
        raise ValueError(
            f"--eval-batches {args.eval_batches} × --batch-size {args.batch_size}"
            f" exceeds the validation split: {len(validation)} sequences (last 5%)"
        )
    return config, dataset, saved, validation


def check_outputs(args, checkpoint) -> None:
    """An output that cannot be written fails now, not after all the steps have run."""
    outputs = {"--metrics": args.metrics, "--save": args.save, "--trace": args.trace}
    for flag, path in ((flag, Path(path)) for flag, path in outputs.items() if path):
        if flag == "--metrics" and path.is_dir():
            raise ValueError(
                f"--metrics {path} is a folder: give a file name, e.g. {path / 'metrics.json'}"
            )
        if flag == "--metrics" and path.is_file() and not is_metrics_file(path):
            raise ValueError(
                f"--metrics {path} exists and is not an hplab metrics file: "
                "choose another name (it was not changed)"
            )
        if flag == "--trace" and path.exists() and not (path.is_dir() and is_trace_folder(path)):
            raise ValueError(
                f"--trace {path} exists and holds other files than hplab's traces: "
                "choose a new or empty folder (nothing was changed)"
            )
        if flag == "--save":
            try:
                checkpoint.check_save_target(path)  # never replaces someone's own files
            except checkpoint.CheckpointError as err:
                raise ValueError(f"--save: {err}") from None
        base = next(p for p in [path.absolute(), *path.absolute().parents] if p.exists())
        if base != path.absolute() and not base.is_dir():
            raise ValueError(f"{flag} {path}: {base} is a file, not a folder")
        try:  # the one sure test: write there
            tempfile.TemporaryFile(dir=base if base.is_dir() else base.parent).close()
        except OSError as err:
            raise ValueError(f"{flag} {path}: cannot write in {base} ({err.strerror})") from None


def check_machine(args, config, world_size: int) -> None:
    """Refuse --backend nccl without a GPU per process, and a run whose memory, as the planner
    estimates it, cannot fit here."""
    import torch

    from hplab.config import Layout
    from hplab.plan import PlanError, plan

    gpus = torch.cuda.device_count() if torch.distributed.is_nccl_available() else 0
    if args.backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"--backend nccl needs one GPU per process: {world_size} processes, "
            f"{gpus} GPU(s) usable by NCCL here: use --backend gloo"
        )
    layout = Layout(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(Layout)  # flags
            if f.name != "recompute"
        },
        recompute="full" if args.recompute else "none",
    )
    try:
        planned = plan(config, layout)  # the planner's memory, checked against real runs
    except PlanError:  # a layout it does not model (interleaved chunks of unequal layers)
        return
    states, need = planned["model_state_bytes_per_gpu"], planned["memory_bytes_per_gpu"]
    if torch.cuda.is_available() and args.backend != "gloo":
        have, per = torch.cuda.get_device_properties(0).total_memory, "per GPU"
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size
        per = f"per process ({world_size} share this machine's memory)"
    if need > have:
        raise ValueError(
            f"this run needs about {need / 2**30:.1f} GiB per process (estimated: model states "
            f"{states / 2**30:.1f}, activations and logits {(need - states) / 2**30:.1f}) but "
            f"there are {have / 2**30:.1f} GiB {per}: use a smaller --seq-len or "
            "--batch-size, more --microbatches, --recompute, or more --tp / --pp / --cp"
        )


def launch(args, argv: list[str]) -> int:
    """`--nproc N` without torchrun: after the checks, start N ranks and watch them as torchrun
    would: one fails or Ctrl-C, all stop. The ranks are forked from this process once it has
    imported torch and hplab, instead of N fresh interpreters importing them (~3 s of CPU each),
    except on a GPU machine: CUDA does not survive a fork."""
    import subprocess

    import torch

    from hplab.dist import free_port, import_before_the_group_exists, torchrun_env

    import_before_the_group_exists()
    port, pids, codes, fork = free_port(), [], {}, not torch.cuda.is_available()

    def poll(pid: int) -> int | None:  # its exit code (-N: killed by signal N); None: running
        if pid not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
            codes[pid] = os.waitstatus_to_exitcode(done[1])
        return codes.get(pid)

    def stop_all() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut this short
        for pid in pids:  # SIGCONT after: a stopped process ends on waking, saying nothing
            for sig in (signal.SIGTERM, signal.SIGCONT):
                if poll(pid) is None:
                    os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while any(poll(pid) is None for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in (pid for pid in pids if poll(pid) is None):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

    try:  # start them (a Ctrl-C meanwhile waits until all are started), then watch them
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        sys.stdout.flush(), sys.stderr.flush()  # or every child would print it again
        for env in (torchrun_env(rank, args.nproc, port) for rank in range(args.nproc)):
            if fork and (pid := os.fork()) == 0:
                run_forked_rank(env, argv)
            pids.append(
                pid
                if fork
                else subprocess.Popen(  # Ctrl-C reaches only the launcher
                    [sys.executable, __file__, *argv],
                    start_new_session=True,
                    env={"OMP_NUM_THREADS": "1", **os.environ, **env},
                ).pid
            )
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        while not any(poll(pid) for pid in pids) and any(poll(pid) is None for pid in pids):
            time.sleep(0.1)
        first = next(((r, codes[pid]) for r, pid in enumerate(pids) if codes.get(pid)), None)
        deadline = time.monotonic() + 3  # the others, cut off from it, say why and exit
        while first and any(poll(pid) is None for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop_all()
        print(f"hplab: interrupted: stopped all {args.nproc} processes", file=sys.stderr)
        return 130
    stop_all()
    rank, code = first or (0, 0)
    if code < 0:  # killed: it could not say why
        print(
            f"hplab: error: process {rank} was killed by {signal.Signals(-code).name}"
            + (" (out of memory?)" if code == -signal.SIGKILL else ""),
            file=sys.stderr,
        )
        return 1
    return code


def run_forked_rank(env: dict[str, str], argv: list[str]):
    """One rank of `--nproc N`, just forked: out of the terminal's process group (Ctrl-C reaches
    the launcher, which stops every rank), then as under torchrun. It never returns into the
    launcher's code."""
    import torch

    code = 1
    try:
        os.setsid()  # (it dies with the launcher: init_distributed asks Linux for that)
        os.environ.update(env)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # N share the cores
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        code = main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def unrecorded(ledger):
    """Collectives that are not training (checkpoint gathers, evaluation) stay out of `comm`."""
    training_traffic = ledger.by_group
    ledger.reset()
    yield
    ledger.by_group = training_traffic


def validation_loss(par, validation, args) -> float:
    """The mean loss of the --eval-batches fixed validation batches, batch k = samples
    [k·B, (k+1)·B), each dp rank its shard of each, forward only (compose.evaluate)."""
    from hplab.compose import evaluate
    from hplab.data import get_batch, shard_for_rank

    mesh, B = par.mesh, args.batch_size
    with unrecorded(mesh.ledger):
        return (
            sum(
                evaluate(
                    par,
                    *(
                        t.to(mesh.device)
                        for t in get_batch(
                            validation,
                            shard_for_rank(
                                list(range(k * B, (k + 1) * B)), mesh.dp_rank, mesh.dp_size
                            ),
                        )
                    ),
                )
                for k in range(args.eval_batches)
            )
            / args.eval_batches
        )


def save(par, args, config, step: int, steps: list) -> None:
    """Gather the single-device state (a collective), rank 0 writes it atomically, then
    everyone waits so no rank runs ahead of a checkpoint still being written."""
    import torch.distributed as dist

    from hplab import checkpoint

    with unrecorded(par.mesh.ledger):  # the gathers are checkpoint traffic, not training
        model_state, optimizer_state = checkpoint.gather_full_state(par)
    if dist.get_rank() == 0:
        scaler = par.precision.scaler
        trainer_state = {
            "step": step,
            "config": vars(args),
            "losses": [s["loss"] for s in steps],
            "lr_scheduler": {"last_epoch": par.scheduler.last_epoch},
        }
        if scaler is not None:
            trainer_state.update(loss_scale=scaler.scale, good_steps=scaler.good_steps)
        checkpoint.save(args.save, config, model_state, optimizer_state, trainer_state)
    dist.barrier()


def run(args) -> dict | None:
    import torch.distributed as dist
    from torch.optim.lr_scheduler import LambdaLR
    from tqdm import tqdm

    from hplab import checkpoint, moe
    from hplab.compose import ParallelConfig, parallelize, pipeline_report, train_step
    from hplab.cp import AttentionMeter
    from hplab.data import get_batch, global_batch_indices, shard_for_rank
    from hplab.dist import Mesh, init_distributed
    from hplab.models.gpt import build_model

    config, dataset, saved, validation = preflight(args, int(os.environ.get("WORLD_SIZE", 1)))
    device = init_distributed(None if args.backend == "auto" else args.backend)
    mesh = Mesh.create(args.dp, args.tp, args.pp, device, ep=args.ep, cp=args.cp)
    model = build_model(config, args.seed).to(device)
    par = parallelize(model, mesh, ParallelConfig.from_namespace(args))
    first_step, scaler = 0, par.precision.scaler
    if saved:  # every rank cuts its pieces (the files are local); --init-from: weights alone
        checkpoint.load_full_state(par, saved["model"], saved.get("optimizer", {}))
    if args.resume:  # (--init-from: a new optimizer, from step 0)
        state, first_step = saved["trainer_state"], saved["trainer_state"]["step"]
        checkpoint.restore_rng(saved["rng"])
        if scaler is not None and "loss_scale" in state:
            scaler.scale, scaler.good_steps = state["loss_scale"], state["good_steps"]
        if "lr_scheduler" in state:  # the schedule goes on from its step (torch's way)
            par.scheduler = LambdaLR(
                par.optimizer,
                par.scheduler.lr_lambdas[0],
                last_epoch=state["lr_scheduler"]["last_epoch"] - 1,
            )

    is_rank0 = mesh.rank == 0
    bar = tqdm(
        range(first_step, args.steps),
        disable=not is_rank0 or args.no_progress,
        unit="step",
        dynamic_ncols=True,
        file=sys.stdout,
    )
    steps, evals, tokens_per_step = [], [], args.batch_size * config.n_positions
    recorder = Recorder(par.gpt, args.trace, mesh.rank, range(first_step, args.steps))
    routing = moe.RoutingStats(par.gpt)  # tokens per expert, per step (none if dense)
    meter = (
        AttentionMeter(par.gpt, mesh.cp, args.cp_style, args.cp_split) if args.cp > 1 else None
    )  # each step's attention seconds and query-key pairs, on every rank
    for step in bar:
        indices = global_batch_indices(len(dataset), step, args.batch_size, args.seed)
        x, y = get_batch(dataset, shard_for_rank(indices, mesh.dp_rank, mesh.dp_size))
        lr, start = par.optimizer.param_groups[0]["lr"], time.perf_counter()
        with recorder.step(step), meter.step() if meter else contextlib.nullcontext():
            with routing.step():
                loss = train_step(par, x.to(device), y.to(device))
        elapsed = time.perf_counter() - start
        steps.append(
            {"step": step, "loss": loss, "time_s": elapsed, "tokens": tokens_per_step, "lr": lr}
        )
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            evals.append({"step": step + 1, "loss": validation_loss(par, validation, args)})
        val = {"val": f"{evals[-1]['loss']:.4f}"} if evals else {}  # the latest
        bar.set_postfix(loss=f"{loss:.4f}", **val, tok_s=f"{tokens_per_step / elapsed:,.0f}")
        if args.save and (
            step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0)
        ):
            save(par, args, config, step + 1, steps)
    bar.close()

    # First step excluded from throughput: it pays one-time costs (allocations, warm-up).
    timed = steps[1:] or steps
    per_op = mesh.ledger.by_group_dict().get("cp", {})
    per_rank = {
        "memory": par.memory.as_dict(),
        "comm": mesh.ledger.as_dict(),
        "comm_by_group": mesh.ledger.by_group_dict(),
        "mesh": mesh.describe(),
        "experts": routing.per_step,  # this rank's routing, per step
        # the last step's timeline of every F, B, W, send, recv (--pp > 1)
        "pipeline": pipeline_report(par) if args.pp > 1 else None,
        "context_parallel": meter
        and {
            **meter.per_step,  # + the cp family's bytes
            "bytes_per_step": {op: o["bytes"] / len(steps) for op, o in per_op.items()},
        },
    }
    gathered = [None] * dist.get_world_size() if is_rank0 else None
    dist.gather_object(per_rank, gathered, dst=0)
    if not is_rank0:
        return None
    ranks = columns(gathered)  # {key: [rank 0's, rank 1's, ...]}
    return {
        "version": METRICS_VERSION,
        "config": vars(args),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": device.type,
        "model": {"num_params": config.num_params(), **vars(config)},
        "steps": steps,
        "eval": evals,  # the validation loss after `step` training steps (--eval-every)
        "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["time_s"] for s in timed),
        "experts": None
        if not config.n_experts
        else {  # per rank (its tokens), step, layer
            "n_experts": config.n_experts,
            "top_k": config.moe_top_k,
            "ep": args.ep,
            **{
                key: [[s[key] for s in per_step] for per_step in ranks["experts"]]
                for key in ("tokens_per_expert", "dropped", "slots", "aux_loss")
            },
        },
        **{key: ranks[key] for key in ("memory", "comm", "comm_by_group", "mesh")},
        "pipeline": None
        if args.pp == 1
        else {
            "schedule": args.schedule,
            "stages": args.pp,
            "microbatches": args.microbatches,
            "virtual_stages": args.virtual_stages,
            **columns(ranks["pipeline"]),
        },
        "context_parallel": None
        if meter is None
        else {  # per rank (lists), per step
            "cp": args.cp,
            "style": args.cp_style,
            "split": args.cp_split,
            **columns(ranks["context_parallel"]),
        },
    }


def with_flags(err: Exception, argv: list[str]) -> Exception:
    """A refusal from the library names its settings (config fields); say them as the flags
    the user gave, e.g. `--zero 3 --pp 2: not supported: ZeRO-3 with a pipeline ...`."""
    settings = getattr(err, "settings", ())  # (only after the flags were parsed: they parse)
    if not settings:
        return err
    args, defaults, shown = parse_args(argv), build_parser(), []
    for name in settings:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value != defaults.get_default(name):
            shown.append(flag if value is True else f"{flag} {value}")
    return ValueError(f"{' '.join(shown)}: {err}" if shown else str(err))


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from hplab.dist import shutdown

    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here: KeyboardInterrupt
    argv = sys.argv[1:] if argv is None else list(argv)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    try:
        args = parse_args(argv)
        if args.nproc and not under_torchrun:
            preflight(args, args.nproc)
            return launch(args, argv)
        metrics = run(args)
    except KeyboardInterrupt:
        if rank == 0:
            print("hplab: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as err:  # includes LayoutError, CommTimeout
        err = with_flags(err, argv)
        if dist.is_initialized() or rank == 0:  # started: each rank says its own (a timeout)
            print(f"hplab: error: {f'rank {rank}: ' if rank else ''}{err}", file=sys.stderr)
        else:  # every rank found the same: rank 0 says it; wait so that the launcher, which
            time.sleep(5)  # stops all ranks when one exits, does not stop rank 0 first
        shutdown()
        return 2
    if metrics is not None:
        print("\n" + summary_table(metrics))
        if args.metrics:
            write_metrics(args.metrics, metrics)
            print(f"metrics written to {args.metrics}")
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
