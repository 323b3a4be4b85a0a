"""Train the GPT on many processes: `torchrun --nproc_per_node N hplab/train.py [flags]`, or
`python -m hplab.train --nproc N [flags]`, which checks the flags first and then starts and
watches the N processes itself.

Every process runs this same file, top to bottom:

1. read the flags (`hplab.cli`) and check everything that needs no process (`hplab.preflight`):
   a bad command line ends here, in one line;
2. join the process group and find this rank's place in the dp × cp × tp × pp mesh;
3. build the *whole* model from the seed (the same initial weights in every layout), and let
   `parallelize` cut it into this rank's share: its stages, its slices, its shards; then the
   optimizer and its learning-rate schedule beside it (`build_training`);
4. load a checkpoint (`--resume`, `--init-from`), resharded into this layout;
5. train: each step takes the global batch the seed and the step choose, this rank's share of
   it, and `train_step` (forward, backward, every synchronisation, the optimizer step); rank 0
   shows a progress bar; the observers (`hplab.observe.observers`) measure from outside;
   Python's garbage collector runs only between steps (`hplab.runtime.collector`);
6. rank 0 gathers what every rank measured, prints a summary and writes the metrics file
   (`--metrics PATH`) that the labs, tests and benchmarks read.

With the defaults the run finishes in well under a minute on a 2-core laptop:

    torchrun --nproc_per_node 4 hplab/train.py --dp 4
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while torch is still importing: one line, no traceback
    signal.signal(
        signal.SIGINT, lambda *_: (print("hplab: interrupted", file=sys.stderr), os._exit(130))
    )
if __name__ == "__main__" and not __package__:  # run as a script: import hplab from the repo
    here = Path(__file__).resolve().parent  # (no stdlib name among hplab's modules)
    sys.path[:] = [str(here.parent)] + [p for p in sys.path if p not in ("", str(here))]

import torch
import torch.distributed as dist
from tqdm import tqdm

from hplab import checkpoint
from hplab.cli import in_flags, parse_args
from hplab.data import get_batch, global_batch_indices, shard_for_rank
from hplab.models.gpt import build_model
from hplab.observe import metrics
from hplab.observe.observers import Observers
from hplab.parallel.compose import parallelize
from hplab.parallel.mesh import Mesh
from hplab.parallel.precision import DTYPES
from hplab.preflight import RunComplete, preflight, release_save_folders
from hplab.runtime import balance, collector, faults, link
from hplab.runtime.errors import explained
from hplab.runtime.group import init_distributed, shutdown
from hplab.runtime.launch import launch, note_error, note_step, supervised
from hplab.training import (
    TrainState,
    build_lr_scheduler,
    build_optimizer,
    evaluate,
    mark_no_decay,
    train_step,
)


def main(argv: list[str] | None = None) -> int:
    """The command: its exit code (0, 2 for a refused command line, 130 on Ctrl-C). Every
    error is one line, `hplab: error: ...`, said by rank 0 (or by the rank it happened on)."""
    try:
        return command(argv)
    finally:
        release_save_folders()  # (--save's lock: `preflight.claim_save_folder`)
        if not supervised():  # (a launcher's restarts set it for its ranks: `restart`)
            os.environ.pop("HPLAB_ATTEMPT", None)


def command(argv: list[str] | None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here: KeyboardInterrupt
    argv = sys.argv[1:] if argv is None else list(argv)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    try:
        args = parse_args(argv)
        if args.max_restarts and under_torchrun and not supervised():
            raise ValueError(
                "--max-restarts is train.py --nproc's: under torchrun give torchrun "
                "--max-restarts N (a restarted train.py resumes from --save by itself)"
            )
        if args.max_restarts and not args.nproc and not under_torchrun:
            raise ValueError(
                f"--max-restarts {args.max_restarts} restarts the job's processes, which takes a "
                "launcher: add --nproc N (1 for one process)"
            )
        if args.nproc and not under_torchrun:
            preflight(args, args.nproc)  # (each rank checks again: the same flags, quickly)
            return launch(args.nproc, argv, main, __file__, args.max_restarts, restart(argv))
        result = run(args)
    except KeyboardInterrupt:
        finish_saves()
        if rank == 0:
            print("hplab: interrupted", file=sys.stderr)
        return 130
    except RunComplete as done:  # (a restart under torchrun after the last save, say)
        if rank == 0:
            print(f"hplab: {done}", file=sys.stderr)
        return 0
    except (ValueError, RuntimeError, OSError) as err:  # includes LayoutError, CommTimeout
        err = in_flags(err, argv)
        finish_saves()
        if supervised():  # train.py --nproc's launcher names the process that failed, once
            note_error(str(err))
        elif dist.is_initialized() or rank == 0:  # started: each rank says its own (a timeout)
            print(f"hplab: error: {f'rank {rank}: ' if rank else ''}{err}", file=sys.stderr)
        else:  # every rank found the same: rank 0 says it; wait so that the launcher, which
            time.sleep(5)  # stops all ranks when one exits, does not stop rank 0 first
        shutdown()
        return 2
    if result is not None:
        print("\n" + metrics.summary_table(result))
        if args.metrics:
            metrics.write(args.metrics, result)
            print(f"metrics written to {args.metrics}")
    shutdown()
    return 0


def finish_saves() -> None:
    """A checkpoint still being written (--async-save) gets to disk before this rank goes: it
    may be the newest one a restart can resume from (its failure was said already). A rank a
    launcher stops (SIGTERM) goes at once: its write is lost, and the previous one stays."""
    with contextlib.suppress(checkpoint.CheckpointError):
        checkpoint.finish_saves()


def restart(argv: list[str]):
    """For `launch`: before restart `attempt`, check everything again as its ranks will (a
    restart resumes from --save's newest checkpoint: `preflight.resume_point`); returns the
    step it resumes from, or None when that checkpoint already holds every step."""

    def check(attempt: int) -> int | None:
        os.environ["HPLAB_ATTEMPT"] = str(attempt)  # (as its ranks will see it)
        args = parse_args(argv)
        try:
            job = preflight(args, args.nproc)
        except RunComplete:  # the failure came after the last save: nothing to restart
            return None
        return job.saved["trainer_state"]["step"] if args.resume else 0

    return check


def run(args) -> dict | None:
    """This rank's whole run (steps 1 to 6 above); the metrics on rank 0, None elsewhere."""
    try:
        return run_claimed(args)
    finally:
        release_save_folders()  # (rank 0 held --save's lock: `preflight.claim_save_folder`)


def run_claimed(args) -> dict | None:
    """`run`'s steps, the --save folder held by rank 0 meanwhile."""
    job = preflight(args, int(os.environ.get("WORLD_SIZE", 1)))
    device = init_distributed(None if args.backend == "auto" else args.backend, env_link=False)
    at_balance = use_link(args.link, job, args.seed, device)  # an emulated network, or none
    layout = job.layout
    mesh = Mesh(pp=layout.pp, dp=layout.dp, cp=layout.cp, tp=layout.tp, ep=layout.ep, device=device)
    par = build_training(job, args.seed, mesh, device)
    if args.compile:
        for block in par.decoder.blocks:  # (their hooks stay eager)
            block.forward = torch.compile(block.forward)
    first_step = checkpoint.restore(par, job.saved, bool(args.resume)) if job.saved else 0
    earlier = job.saved["trainer_state"]["losses"] if args.resume else []
    watch = Observers(par, args.trace, range(first_step, args.steps))
    steps, evals, saves = train(par, job, args, range(first_step, args.steps), watch, earlier)
    mine = watch.per_rank(len(steps))
    everyone = [None] * dist.get_world_size() if mesh.rank == 0 else None
    with explained("the metrics' gather"):
        dist.gather_object(mine, everyone, dst=0)
    if mesh.rank != 0:
        return None
    backend = dist.get_backend()
    out = metrics.collect(args, job.model, layout, backend, device.type, steps, evals, everyone)
    out["link_balance"] = at_balance
    return metrics.recovery(out, first_step, earlier, saves)


def use_link(text: str | None, job, seed: int, device) -> dict | None:
    """The ranks' emulated network (--link, else HPLAB_LINK: `preflight` merged them): a link's
    numbers as given, or a machine at this machine's balance, measured on the run's model
    (`hplab.runtime.balance`; what the metrics keep of it, else None)."""
    if not balance.parse_machine(text):
        link.use(text)
        return None
    model = build_model(job.model, seed).to(device, DTYPES[job.layout.precision])
    shape = (job.layout.micro_batch_size, job.model.seq_len)
    tokens = torch.randint(job.model.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    precision = job.layout.precision
    return balance.model_at_balance(text, model, tokens, tokens, job.model, precision, device)


def build_training(job, seed: int, mesh: Mesh, device) -> TrainState:
    """Step 3: the whole model from the seed, cut by `parallelize` into this rank's share, the
    optimizer and its schedule built beside it (as torchtitan's train.py builds them)."""
    model = build_model(job.model, seed).to(device)
    if job.optim.no_decay_bias_norm:  # by role, while the model is whole
        mark_no_decay(model)
    model = parallelize(model, mesh, job.layout)
    optimizer = build_optimizer(model, mesh, job.layout, job.optim)
    scheduler = build_lr_scheduler(optimizer, job.optim)
    return TrainState(model, optimizer, scheduler, mesh, job.layout, job.optim)


def train(par, job, args, steps_to_run: range, watch, earlier: list) -> tuple[list, list, list]:
    """The loop: per step, this rank's share of the global batch, one `train_step`, its record
    (loss, seconds, tokens, lr); the validation loss every --eval-every steps and a checkpoint
    every --save-every steps and at the end (with the losses of every step before it, those
    of the run it resumed, `earlier`, first). Returns (steps, evaluations, saves)."""
    mesh = par.mesh
    tokens_per_step = args.batch_size * job.model.n_positions
    bar = tqdm(
        steps_to_run,
        disable=mesh.rank != 0 or args.no_progress,
        unit="step",
        dynamic_ncols=True,
        file=sys.stdout,
    )
    steps = []
    evals = []
    saves = []
    planned_faults = faults.planned()
    with collector.between_steps():
        for step in bar:
            collector.collect_before(step, steps_to_run.start)  # (every rank, the same step)
            note_step(step)  # (for the launcher's line, should this rank fail)
            faults.strike(step, mesh.rank, planned_faults)  # HPLAB_FAULT: none unless asked
            indices = global_batch_indices(len(job.dataset), step, args.batch_size, args.seed)
            x, y = get_batch(job.dataset, shard_for_rank(indices, mesh.dp_rank, mesh.dp_size))
            lr = par.optimizer.param_groups[0]["lr"]
            start = time.perf_counter()
            with watch.step(step):
                loss = train_step(par, x.to(mesh.device), y.to(mesh.device))
            elapsed = time.perf_counter() - start
            steps.append(
                {"step": step, "loss": loss, "time_s": elapsed, "tokens": tokens_per_step, "lr": lr}
            )
            done = step + 1
            last = step + 1 == args.steps
            if args.eval_every and (done % args.eval_every == 0 or last):
                evals.append({"step": done, "loss": validation_loss(par, job.validation, args)})
            latest = {"val": f"{evals[-1]['loss']:.4f}"} if evals else {}
            bar.set_postfix(loss=f"{loss:.4f}", **latest, tok_s=f"{tokens_per_step / elapsed:,.0f}")
            if args.save and (last or args.save_every and done % args.save_every == 0):
                losses = earlier + [s["loss"] for s in steps]
                saves.append(
                    checkpoint.save_run(par, args.save, vars(args), done, losses, args.async_save)
                )
    checkpoint.finish_saves()  # (--async-save: the last one is on disk)
    bar.close()
    return steps, evals, saves


def validation_loss(par, validation, args) -> float:
    """The mean loss of the --eval-batches fixed validation batches, batch k = samples
    [k·B, (k+1)·B), each dp rank its shard of each, forward only (training.evaluate); its
    messages stay out of the training traffic the metrics count."""
    mesh = par.mesh
    B = args.batch_size
    losses = []
    with mesh.ledger.unrecorded():
        for k in range(args.eval_batches):
            mine = shard_for_rank(list(range(k * B, (k + 1) * B)), mesh.dp_rank, mesh.dp_size)
            x, y = get_batch(validation, mine)
            losses.append(evaluate(par, x.to(mesh.device), y.to(mesh.device)))
    return sum(losses) / args.eval_batches


if __name__ == "__main__":
    sys.exit(main())
