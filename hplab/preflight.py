"""Every check of a run that needs no process group: a bad command line fails at once, with
one line, before N processes start (or, under torchrun, before any rank joins the group).

    preflight(args, world_size)   the flags → a `Run`: the model, the layout, the optimizer's
                                  settings, the data, and the checkpoint to start from

In order: the layout's --dp, the flags that exclude each other, the lr schedule in steps, the
model (a preset with overrides, or --init-from's config.json), `config.validate` (every rule of
the layout), --resume's checkpoint, the outputs (writable, never someone else's files), this
machine (GPUs, the planner's estimate of the memory), and the token files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hplab import checkpoint
from hplab.cli import DEFAULT_MODEL, layout_of, optim_of
from hplab.config import Layout, LayoutError, ModelConfig, OptimConfig, validate
from hplab.data import TokenDataset
from hplab.models.gpt import config_from_preset
from hplab.observe.metrics import is_metrics_file
from hplab.observe.observers import is_trace_folder
from hplab.plan import plan
from hplab.runtime import balance, faults, link
from hplab.runtime.group import TIMEOUT_PROBLEM, choose_backend
from hplab.runtime.launch import supervised


@dataclass
class Run:
    """What a checked command line asks for (the library's typed configs, no flags)."""

    model: ModelConfig
    layout: Layout
    optim: OptimConfig
    dataset: TokenDataset
    validation: TokenDataset | None  # with --eval-every
    saved: dict | None  # --resume's checkpoint, or --init-from's weights


def preflight(args, world_size: int) -> Run:
    """Check everything (LayoutError / ValueError, one line each); fill in --dp, --warmup-steps
    (from --warmup-fraction), --decay-steps and --no-decay-bias-norm's default."""
    if TIMEOUT_PROBLEM:
        raise ValueError(TIMEOUT_PROBLEM)
    check_switches(args)  # (--resume auto: which checkpoint, if any)
    if args.dp is None:
        try:
            args.dp = resolve_dp(world_size, args.tp, args.pp, args.cp)
        except LayoutError as err:  # e.g. resuming on fewer processes than tp × pp
            reshard = " (a checkpoint reshards into any layout)" if args.resume else ""
            raise LayoutError(f"{err}{reshard}") from None
    keep_microbatch_size(args)
    if args.link and int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) < world_size:
        raise ValueError(
            "--link emulates a network between the processes of one machine; this job spans "
            "machines, whose network is real: drop --link (and HPLAB_LINK)"
        )
    settle_lr_schedule(args)
    check_faults(args, world_size)
    saved, model = model_of(args)
    layout = layout_of(args)
    validate(layout, model, world_size)
    if args.resume:  # damaged, of another shape, or already done: say so before starting
        saved = resumable(args, model)
    check_outputs(args)
    check_machine(args, model, layout, world_size)
    dataset, validation = token_files(args, model)
    return Run(model, layout, optim_of(args), dataset, validation, saved)


def check_faults(args, world_size: int) -> None:
    """Every fault HPLAB_FAULT plans must be able to strike (ValueError, one line, if not; a
    malformed HPLAB_FAULT too): one that never could is a test or a lesson that proves nothing.
    Those of earlier attempts have struck already (and an elastic job may have shrunk since)."""
    for fault in faults.planned():
        if fault.attempt is not None and fault.attempt < faults.attempt():
            continue
        asks = f"HPLAB_FAULT asks rank {fault.rank} to fail at step {fault.step}"
        if fault.rank >= world_size:
            raise ValueError(
                f"HPLAB_FAULT asks rank {fault.rank} to fail, but the job has {world_size} "
                f"process{'es' * (world_size > 1)} (ranks 0 to {world_size - 1})"
            )
        if fault.step >= args.steps + (fault.kind == "kill-in-save"):  # (saves count steps done)
            raise ValueError(f"{asks}, but the run has --steps {args.steps}: it never gets there")
        restarts = args.max_restarts or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
        if fault.attempt is not None and fault.attempt > restarts:
            raise ValueError(
                f"{asks} in attempt {fault.attempt}, but --max-restarts {restarts} ends the job "
                f"after attempt {restarts}"
            )
        saved_then = args.save and (
            fault.step == args.steps or (args.save_every and fault.step % args.save_every == 0)
        )
        saved_then = saved_then and fault.step > 0  # (the first checkpoint holds one step)
        if fault.kind == "kill-in-save" and not saved_then:
            raise ValueError(
                f"{asks}'s checkpoint, but no checkpoint is written after step {fault.step}: "
                "give --save DIR and a --save-every K that divides it"
            )


def check_switches(args) -> None:
    for flag in ("resume", "save", "metrics", "trace", "init_from", "data"):
        if getattr(args, flag) == "":  # (an unset shell variable, often)
            raise ValueError(f"--{flag.replace('_', '-')} needs a path, got an empty one")
    if args.no_decay_bias_norm and args.decay_bias_norm:
        raise ValueError("give --no-decay-bias-norm or --decay-bias-norm, not both")
    args.no_decay_bias_norm = args.weight_decay > 0 and not args.decay_bias_norm  # (as the seeds)
    if args.async_save and not args.save:
        raise ValueError("--async-save writes --save's checkpoints: give --save DIR")
    if args.save_every and not args.save:
        raise ValueError(f"--save-every {args.save_every} needs --save DIR")
    if os.environ.get("HPLAB_LINK"):  # (read by every rank as it starts, even beside --link)
        network_text(os.environ["HPLAB_LINK"], "HPLAB_LINK")
    source = "--link" if args.link else "HPLAB_LINK"
    args.link = args.link or os.environ.get("HPLAB_LINK") or None
    if args.link:  # (LinkError: one line) in the metrics as the library spells it
        args.link = network_text(args.link, source)
    resume_point(args)
    if args.init_from and args.resume:
        raise ValueError("--init-from starts a new run, --resume continues one: give one of them")
    if args.max_restarts and not args.save:
        raise ValueError(
            f"--max-restarts {args.max_restarts} restarts from --save's newest checkpoint: "
            "give --save DIR (and --save-every K)"
        )
    cut = [f"--{k} {getattr(args, k)}" for k in ("tp", "pp", "cp") if getattr(args, k) > 1]
    cut += ["--zero 3"] * (args.zero == 3) + ["--moe-experts"] * bool(args.moe_experts)
    if args.compile and cut:
        raise ValueError(
            f"--compile compiles each block's forward whole, with data parallel and ZeRO-1/2 "
            f"only: drop --compile or {' '.join(cut)}"
        )


class RunComplete(Exception):
    """A run that resumes by itself finds that its checkpoint holds every step: nothing is left
    to train (a rank lost after the last save, or the same command run again)."""


def network_text(text: str, source: str) -> str:
    """--link as the library spells it: a machine (`hplab.runtime.balance`, its link measured
    once the ranks run) or a link's numbers (`link.parse_wire`); LinkError: one line."""
    machine = balance.parse_machine(text, source)
    return str(machine) if machine else str(link.parse_wire(text, source))


def resume_point(args) -> None:
    """`--resume auto`, and every restart after a failure (HPLAB_ATTEMPT or torchrun's restart
    count above 0) with --save: resume from --save's newest complete checkpoint. With none
    there yet, --resume auto starts afresh, and a restart starts as the first attempt did."""
    if args.resume == "auto" and not args.save:
        raise ValueError("--resume auto resumes from --save's newest checkpoint: give --save DIR")
    if args.resume == "auto" or (faults.attempt() > 0 and args.save):
        folder = checkpoint.newest(args.save)
        state = saved_state(folder) if folder else None
        if state is not None and (differences := other_run(state.get("config"), args)):
            if args.resume == "auto":
                raise ValueError(
                    f"--resume auto: {args.save} holds the checkpoint of another run "
                    f"({'; '.join(differences)}): resume it with --resume {args.save}, or "
                    "--save into another folder (nothing was changed)"
                )
            folder = None  # a restart of a run that had not saved yet: it starts afresh again
        if folder:
            args.resume = args.save
            args.init_from = None
            if state is not None and state.get("step") == args.steps:
                raise RunComplete(
                    f"{args.save} already holds all {args.steps} steps: nothing is left to train"
                )
        elif args.resume == "auto":
            args.resume = None


def saved_state(folder: Path) -> dict | None:
    """A checkpoint's trainer_state.json, or None if it cannot be read (`resumable` then says
    what is wrong with it, in one line)."""
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(checkpoint.regular_file(folder / "trainer_state.json").read_text())
        return state if isinstance(state, dict) else None
    return None


# The flags that decide which model a run trains, besides its layout (which a checkpoint
# reshards into any other): two runs that agree on them train the same model, step by step.
RUN_IDENTITY = (
    "seed", "data", "batch_size", "lr", "weight_decay", "grad_clip",
    "model", "n_layer", "n_embd", "n_head", "n_kv_head", "seq_len",
    "moe_experts", "moe_top_k", "moe_capacity_factor", "moe_aux_coef", "moe_balance",
)  # fmt: skip


def other_run(saved_flags, args) -> list[str]:
    """How the run that saved a checkpoint (its flags, in trainer_state.json) differs from this
    one, flag by flag ("--seed 1, this run 0"); empty when it is this run, which a restart or
    --resume auto may go on with. Never another run's: their losses would be spliced into one
    history, and its weights trained on as if they were this run's."""
    if not isinstance(saved_flags, dict):
        return ["its flags are not recorded"]
    this_run = {name: getattr(args, name) for name in RUN_IDENTITY}
    this_run["model"] = this_run["model"] or DEFAULT_MODEL  # (preflight settles it later)
    return [
        f"--{name.replace('_', '-')} {saved_flags[name]}, this run {this_run[name]}"
        for name in RUN_IDENTITY
        if name in saved_flags and saved_flags[name] != this_run[name]
    ]


def keep_microbatch_size(args) -> None:
    """Resuming on fewer data-parallel ranks than saved the checkpoint (a lost node, a smaller
    --nproc), the global batch stays, so each rank takes a larger share of it: as many more
    microbatches keep each rank's microbatch, and its memory, as they were (and a restart on
    as many ranks keeps the checkpoint's microbatches). Only when --microbatches is 1 or what
    the saved run used, and not with experts balanced over the batch (their loss counts each
    microbatch over dp: only the same global microbatch keeps it)."""
    batch_balanced = args.moe_experts and args.moe_balance == "batch"
    folder = checkpoint.newest(args.resume) if args.resume and not batch_balanced else None
    try:  # (a damaged checkpoint: `resumable` says so in one line)
        saved = json.loads((folder / "trainer_state.json").read_text())["config"]
        sequences = int(saved["dp"]) * int(saved["microbatches"])  # per microbatch, over dp
    except (TypeError, ValueError, KeyError, OSError):
        return
    not_more = args.dp <= int(saved["dp"])
    if not_more and args.microbatches in (1, saved["microbatches"]) and sequences % args.dp == 0:
        args.microbatches = sequences // args.dp


def settle_lr_schedule(args) -> None:
    """Warm-up and decay in steps (`formulas.learning_rate` draws the curve)."""
    if args.warmup_fraction is not None:
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


def model_of(args) -> tuple[dict | None, ModelConfig]:
    """(--init-from's weights or None, the model): a preset with the size flags, or the
    config.json of --init-from, which the flags may only agree with."""
    saved = checkpoint.load_pretrained(args.init_from) if args.init_from else None
    typed = args.model is not None  # (--model typed beside --init-from: they must agree)
    args.model = args.model or DEFAULT_MODEL  # (as the metrics file and checkpoints record it)
    name = saved["config"] if saved and not typed else args.model
    model = config_from_preset(
        name, args.n_layer, args.n_embd, args.n_head, args.seq_len, args.n_kv_head
    )
    if args.moe_experts:  # each block's MLP a mixture of experts
        model = dataclasses.replace(
            model,
            n_experts=args.moe_experts,
            moe_top_k=args.moe_top_k,
            moe_capacity_factor=args.moe_capacity_factor or 0.0,
            moe_aux_coef=args.moe_aux_coef,
            moe_balance=args.moe_balance,
        )
    if saved:  # (after --moe-experts, which it may contradict too)
        advice = f"leave those flags out: --init-from {args.init_from} sets the model"
        checkpoint.check_compatible(saved["config"], model, advice)
    return saved, model


def resumable(args, model: ModelConfig) -> dict:
    """--resume's checkpoint, if it holds this model, is not done yet and continues its lr
    schedule (the schedule's shape may not change; --lr may)."""
    saved = checkpoint.load(args.resume)
    checkpoint.check_compatible(saved["config"], model)
    state, step = trainer_state(saved)
    if step >= args.steps:
        raise checkpoint.CheckpointError(
            f"{saved['directory']} is already at step {step}: ask for more with --steps "
            "(it counts from the first run's start)"
        )
    shape = ("warmup_steps", "lr_decay", "decay_steps", "min_lr")
    changed = [
        f"--{k.replace('_', '-')} {state['config'][k]}"
        for k in shape
        if "lr_scheduler" in state and state["config"][k] != getattr(args, k)
    ]
    if changed:  # (older checkpoints, without one, had a constant lr)
        raise checkpoint.CheckpointError(
            f"{saved['directory']} continues its lr schedule: resume with {' '.join(changed)}"
        )
    return saved


def trainer_state(saved: dict) -> tuple[dict, int]:
    """(trainer_state.json, its step) if they can continue a run (the file has no checksum of
    its own: it holds them); else a CheckpointError naming what is wrong."""
    state = saved["trainer_state"]
    step = state.get("step") if isinstance(state, dict) else None

    def whole(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    problem = None
    if not isinstance(state, dict):
        problem = "trainer_state.json is not a JSON object {...}"
    elif not whole(step):
        problem = f"trainer_state.json has step {step!r}, not a whole number of steps from 0"
    elif not isinstance(state.get("config"), dict) or "warmup_steps" not in state["config"]:
        problem = "trainer_state.json lacks the flags of the run that saved it (config)"
    elif not isinstance(losses := state.get("losses", []), list) or not all(
        isinstance(x, int | float) for x in losses
    ):
        problem = "trainer_state.json's losses are not a list of numbers"
    elif "lr_scheduler" in state and not (
        isinstance(state["lr_scheduler"], dict) and whole(state["lr_scheduler"].get("last_epoch"))
    ):
        problem = "trainer_state.json's lr_scheduler has no last_epoch"
    elif not isinstance(saved["rng"].get("cpu"), torch.Tensor):
        problem = "rng.safetensors lacks the random state of the CPU"
    if problem:
        raise checkpoint.CheckpointError(
            f"{saved['directory']} is damaged: {problem}; resume from another copy"
        )
    return state, step


def check_outputs(args) -> None:
    """An output that cannot be written fails now, not after all the steps have run; an output
    never replaces someone's own files."""
    outputs = {"--metrics": args.metrics, "--save": args.save, "--trace": args.trace}
    for flag, path in ((flag, Path(path)) for flag, path in outputs.items() if path):
        if path.exists() and not (path.is_file() or path.is_dir()):
            raise ValueError(
                f"{flag} {path} is not a regular file or folder (a device, a FIFO?): give a "
                "path of your own (nothing was changed)"
            )
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
                checkpoint.check_save_target(path)
            except checkpoint.CheckpointError as err:
                raise ValueError(f"--save: {err}") from None
            claim_save_folder(path)
        check_writable(flag, path)


CLAIMED: dict = {}  # --save folder → its lock file, held by this process until it ends


def claim_save_folder(path: Path) -> None:
    """One run at a time writes a --save folder: the launcher (train.py --nproc), or else rank
    0, holds a lock beside it (.NAME.lock, flock) for the job's life; a second run is refused
    in one line (two saving there would delete each other's half-written saves)."""
    real = Path(os.path.realpath(path))  # one lock however the folder is named (a link too)
    if supervised() or int(os.environ.get("RANK", 0)) != 0 or real in CLAIMED:
        return  # (the launcher holds it for its ranks, and through every restart)
    real.parent.mkdir(parents=True, exist_ok=True)
    lock = open_lock_file(lock_path(real))
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(
            f"--save {path} is being written by another run: wait until it ends, or choose "
            "another folder (nothing was changed)"
        ) from None
    CLAIMED[real] = lock


def lock_path(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


def open_lock_file(path: Path):
    """The lock file, opened without waiting: a FIFO or a device put where it goes would block
    the open (a FIFO waits for a reader) or take the lock's writes; either is refused."""
    not_a_file = ValueError(
        f"--save: {path}, where its lock file goes, is not a regular file: remove it"
    )
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise not_a_file
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_NOFOLLOW
    try:  # (without waiting, should one appear meanwhile)
        descriptor = os.open(path, flags, 0o644)
    except OSError as err:
        raise ValueError(f"--save: cannot create its lock file {path} ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise not_a_file
    return os.fdopen(descriptor, "a")


def release_save_folders() -> None:
    """Let go of the --save folders this process claimed (their lock files go too)."""
    while CLAIMED:
        path, lock = CLAIMED.popitem()
        lock_path(path).unlink(missing_ok=True)
        lock.close()


def check_writable(flag: str, path: Path) -> None:
    base = next(p for p in [path.absolute(), *path.absolute().parents] if p.exists())
    if base != path.absolute() and not base.is_dir():
        raise ValueError(f"{flag} {path}: {base} is a file, not a folder")
    try:  # the one sure test: write there
        tempfile.TemporaryFile(dir=base if base.is_dir() else base.parent).close()
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write in {base} ({err.strerror})") from None


def check_machine(args, model: ModelConfig, layout: Layout, world_size: int) -> None:
    """Refuse --backend nccl without a GPU per process on this machine (its LOCAL_WORLD_SIZE
    under torchrun: a job of many machines counts its own), and a run whose memory, as the
    planner estimates it, cannot fit on the device each process will use."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count() if torch.distributed.is_nccl_available() else 0
    asked = None if args.backend == "auto" else args.backend
    if asked == "nccl" and gpus < local:
        raise ValueError(
            f"--backend nccl needs one GPU per process: {local} processes on this machine, "
            f"{gpus} GPU(s) usable by NCCL here: use --backend gloo"
        )
    _, device, _ = choose_backend(asked, 0, local, gpus, None)
    try:
        planned = plan(model, layout)  # the planner's memory, checked against real runs
    except LayoutError:  # a layout it does not model (e.g. unequal interleaved chunks)
        return
    states = planned["model_state_bytes_per_gpu"]
    need = planned["memory_bytes_per_gpu"]
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(0).total_memory
        per = "per GPU"
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local
        per = f"per process ({local} share this machine's memory)"
    if need > have:
        raise ValueError(
            f"this run needs about {need / 2**30:.1f} GiB per process (estimated: model states "
            f"{states / 2**30:.1f}, activations and logits {(need - states) / 2**30:.1f}) but "
            f"there are {have / 2**30:.1f} GiB {per}: use a smaller --seq-len or "
            "--batch-size, more --microbatches, --recompute, or more --tp / --pp / --cp"
        )


def token_files(args, model: ModelConfig) -> tuple[TokenDataset, TokenDataset | None]:
    """The training split and, with --eval-every, the validation split (the last 5%)."""
    tokens = functools.partial(TokenDataset, args.data, model.tokenizer, model.n_positions)
    dataset = tokens()
    validation = tokens(split="val") if args.eval_every else None
    if dataset.vocab_size > model.vocab_size:
        raise ValueError(
            f"{args.data} uses {dataset.vocab_size} token ids but the model has a "
            f"vocabulary of {model.vocab_size}"
        )
    if validation is not None and len(validation) < args.eval_batches * args.batch_size:
        raise ValueError(
            f"--eval-batches {args.eval_batches} × --batch-size {args.batch_size}"
            f" exceeds the validation split: {len(validation)} sequences (last 5%)"
        )
    return dataset, validation


def resolve_dp(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """--dp when not given: what is left of the processes, world ÷ (tp × pp × cp)."""
    if world_size % (tp * pp * cp):
        cp_text = (f" × cp={cp}", " × cp") if cp > 1 else ("", "")
        raise LayoutError(
            f"{world_size} processes cannot be split into tp={tp} × pp={pp}"
            f"{cp_text[0]} groups: make tp × pp{cp_text[1]} divide the number of processes"
        )
    return world_size // (tp * pp * cp)
