"""DDP's step time against its bucket size, in one launch: lab 02's plot and bench/bench_link.py.

    torchrun --nproc_per_node 2 hplab/course/bucket_sweep.py --link 50MB/s,1ms --out sweep.json
    python hplab/course/bucket_sweep.py --nproc 2 --link 50MB/s,1ms --out sweep.json   (the
        same, its ranks forked from this process as train.py --nproc forks them)

Every rank builds one `hplab.DDP` model per bucket size (same seed, same data) and steps them
in turn, one step each, round after round, so that the machine's load falls on every size
alike: first with no link, then under `--link`. Each step of the ordinary loop (forward,
`loss.backward()`, `optimizer.step()`, `zero_grad()`) is timed on every rank, and a gradient
hook placed before DDP's notes when backward produced its first and its last gradient:

    step_s      the whole step, the slowest rank's (the job waits for it)
    exposed_s   last gradient → backward returned, on the rank that got there last: the
                communication backward did not hide (the other rank also waited for it)
    window_s    that rank's first gradient → last one: the part of backward that
                gradients come out of
    compute_s   step_s − exposed_s

`--link auto,500us` picks β from the no-link run (`calibrated_link`); `--link h100-80g` puts
the ranks at that machine's balance (`hplab.runtime.balance`, measured on this model). With
`--trace DIR`, two more steps are traced under the link (`observe.Recorder`, as `train.py
--trace` does), of `--trace-mb` or else of the size whose median step was the shortest. Rank 0
writes JSON: `config` (`link`: the link used), `link_balance` (a machine's, else None),
`gradient_bytes`, `tied_bytes`, `buckets` {size: [bytes of each bucket]}, `runs` {"none" |
link: {size: [per step: {step_s, window_s, exposed_s, compute_s}]}}.
"""

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # a script: the repo, not its folder, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from statistics import median

KEYS = ("step_s", "window_s", "exposed_s", "compute_s")


class GradientClock:
    """perf_counter of a backward's first and last gradient (hooks registered before DDP's, so
    they note a gradient before DDP launches its bucket)."""

    def __init__(self, model):
        self.first = self.last = None
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.note)

    def note(self, _param) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last


def one_step(model, clock: GradientClock, optimizer, x, y) -> dict:
    """One step of the ordinary loop, timed: {step_s, window_s, exposed_s} on this rank."""
    start = time.perf_counter()
    clock.first = None
    _, loss = model(x, y)
    loss.backward()  # DDP's hooks launch the buckets; its callback waits for them at the end
    returned = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    return dict(
        step_s=time.perf_counter() - start,
        window_s=clock.last - clock.first,
        exposed_s=returned - clock.last,
    )


def sweep_here(config, sizes, batches, steps: int, warmup: int) -> dict:
    """{size: [per step: this rank's times]}: one DDP model per size, stepped in turn."""
    import torch

    from hplab.models.gpt import build_model
    from hplab.parallel.ddp import DDP
    from hplab.runtime import collector

    runs = []
    for mb in sizes:
        model = build_model(config, seed=0)
        clock = GradientClock(model)  # before DDP's hooks
        ddp = DDP(model, bucket_mb=mb)
        runs.append((ddp, clock, torch.optim.AdamW(ddp.parameters(), lr=1e-3)))
    times = {mb: [] for mb in sizes}
    with collector.between_steps():  # (no rank pauses for Python's collector mid-step)
        for step in range(warmup + steps):
            collector.collect_before(step)
            x, y = batches[step % len(batches)]
            for mb, (ddp, clock, optimizer) in zip(sizes, runs):
                t = one_step(ddp, clock, optimizer, x, y)
                if step >= warmup:
                    times[mb].append(t)
    return times


def job_view(per_rank: list[dict]) -> dict:
    """Per size and step, the job's times from every rank's (see above)."""
    out = {}
    for mb in per_rank[0]:
        out[mb] = []
        for ranks in zip(*(r[mb] for r in per_rank)):
            last = min(ranks, key=lambda t: t["exposed_s"])  # the last to finish backward
            step = max(t["step_s"] for t in ranks)
            out[mb].append(last | dict(step_s=step, compute_s=step - last["exposed_s"]))
    return out


def trace_steps(config, mb: float, batches, directory: str, rank: int) -> None:
    """Two steps of bucket size `mb` traced (after one untraced), as `train.py --trace`."""
    import torch

    from hplab.models.gpt import build_model
    from hplab.observe.observers import Recorder
    from hplab.parallel.ddp import DDP

    model = build_model(config, seed=0)
    ddp = DDP(model, bucket_mb=mb)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    recorder = Recorder(model, directory, rank, range(3))
    for step in range(3):
        x, y = batches[step % len(batches)]
        with recorder.step(step):
            _, loss = ddp(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--link",
        required=True,
        help="the emulated link, e.g. 50MB/s,1ms; none; a machine, e.g. h100-80g (at its "
        "balance); or auto,ALPHA (with --no-link-too: β from the window measured with no link, "
        "see calibrated_link)",
    )
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[0, 0.05, 0.25, 25])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--n-layer", type=int, help="the preset's depth, overridden")
    p.add_argument("--n-embd", type=int, help="the preset's width, overridden")
    p.add_argument("--batch-size", type=int, default=16, help="global, in sequences")
    p.add_argument("--steps", type=int, default=8, help="timed steps per size")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-link-too", action="store_true", help="first the same with no link")
    p.add_argument("--trace"), p.add_argument("--trace-mb", type=float)
    p.add_argument("--out", required=True)
    p.add_argument("--nproc", type=int, help="start this many ranks here (without torchrun)")
    return p.parse_args(argv)


def my_batches(config, global_batch: int, rank: int, n: int, count: int = 4) -> list:
    """This rank's share of the first `count` global batches (as train.py takes them)."""
    from hplab.data import TokenDataset, get_batch, global_batch_indices, shard_for_rank

    data = TokenDataset("shakespeare", seq_len=config.n_positions)
    return [
        get_batch(
            data, shard_for_rank(global_batch_indices(len(data), s, global_batch, 0), rank, n)
        )
        for s in range(count)
    ]


def calibrated_link(no_link: dict, config, text: str) -> str:
    """`auto,ALPHA`: the link whose β lets the window hide what it can. With no link and the
    largest bucket size (one bucket), backward's window W is measured; the gradients produced
    during W, all but the tied embedding's, take W on a link of β = (S − S_tied) / W."""
    from hplab.models.gpt import build_model

    params = [p for p in build_model(config, seed=0).parameters() if p.requires_grad]
    window = median(t["window_s"] for t in no_link[max(no_link)])
    beta = sum(p.nbytes for p in params[1:]) / window  # params[0]: the tied embedding
    return f"{beta / 1e6:.3g}MB/s,{text.partition(',')[2] or '0us'}"


def at_machines_balance(config, text: str, batch) -> dict:
    """`--link h100-80g`: the wire at that machine's balance, measured on a forward and
    backward of this model on this rank's batch (`hplab.runtime.balance`; what it measured)."""
    from hplab.models.gpt import build_model
    from hplab.runtime import balance

    return balance.model_at_balance(text, build_model(config, seed=0), *batch, config)


def describe(args, config, runs: dict, n: int) -> dict:
    """The JSON rank 0 writes (see above)."""
    from hplab.models.gpt import build_model
    from hplab.parallel.buckets import bucket_params

    params = [p for p in build_model(config, seed=0).parameters() if p.requires_grad]
    return dict(
        config=vars(args) | dict(world_size=n, seq_len=config.n_positions),
        gradient_bytes=sum(p.nbytes for p in params),
        tied_bytes=params[0].nbytes,  # the embedding (= the LM head): listed first, sent last
        buckets={
            mb: [sum(p.nbytes for p in b) for b in bucket_params(params, mb)]
            for mb in args.bucket_mb
        },
        runs=runs,
    )


def link_problem(text: str) -> str | None:
    """What is wrong with --link, in one line, or None."""
    from hplab.runtime import balance, link

    if text == "none":
        return None
    auto = text.startswith("auto")  # (auto,ALPHA: β is measured later, α is read here)
    probe = "1MB/s," + text.partition(",")[2] if auto else text
    try:
        balance.parse_machine(probe) or link.parse_wire(probe)
    except link.LinkError as err:
        return str(err).replace(repr(probe), repr(text))
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := link_problem(args.link):  # (before any process starts)
        print(f"hplab: error: {problem}", file=sys.stderr)
        return 2
    if args.nproc and "RANK" not in os.environ:  # the launcher: its ranks run main again
        from hplab.runtime.launch import launch

        return launch(args.nproc, sys.argv[1:] if argv is None else list(argv), main, __file__)
    import torch.distributed as dist

    from hplab.models.gpt import config_from_preset
    from hplab.runtime import balance, link
    from hplab.runtime.group import init_distributed, shutdown

    init_distributed()
    balanced = None
    n = dist.get_world_size()
    rank = dist.get_rank()
    config = config_from_preset(
        args.model, n_layer=args.n_layer, n_embd=args.n_embd, seq_len=args.seq_len
    )
    batches = my_batches(config, args.batch_size, rank, n)
    runs = {}
    for text in dict.fromkeys(["none"] * args.no_link_too + [args.link]):
        if text.startswith("auto"):  # (every rank has the same times: all pick the same β)
            text = args.link = calibrated_link(runs["none"], config, text)
        if text != "none" and balance.parse_machine(
            text
        ):  # a machine's balance, measured on this model
            balanced = at_machines_balance(config, text, batches[0])
        else:
            link.use(None if text == "none" else text)
        gathered = [None] * n
        dist.all_gather_object(
            gathered, sweep_here(config, args.bucket_mb, batches, args.steps, args.warmup)
        )
        runs[text] = job_view(gathered)
    if args.trace:  # (every rank has the same medians: all pick the same size)
        steps = runs[args.link]
        best = min(steps, key=lambda mb: median(t["step_s"] for t in steps[mb]))
        mb = best if args.trace_mb is None else args.trace_mb
        trace_steps(config, mb, batches, args.trace, rank)
    dist.barrier()  # every trace written
    if rank == 0:
        out = describe(args, config, runs, n) | {"link_balance": balanced}
        Path(args.out).write_text(json.dumps(out, indent=1))
    shutdown()
    return 0


# --- the notebook's and the benchmark's side ----------------------------------------------
@dataclass
class Sweep:
    """One launch's measurements (the JSON above), with their medians."""

    data: dict
    seconds: float = 0.0
    output: str = field(default="", repr=False)

    sizes = property(lambda self: self.data["config"]["bucket_mb"])

    def median(self, key: str, link: str | None = None) -> list[float]:
        """Per bucket size, the median over steps of `key` (step_s, window_s, ...) under
        `link` (default: the sweep's link; "none": without one)."""
        run = self.data["runs"][link or self.data["config"]["link"]]
        return [median(t[key] for t in run[str(float(mb))]) for mb in self.sizes]

    def buckets(self, mb: float) -> list[int]:
        """The bytes of each bucket at size `mb`, in launch order."""
        return self.data["buckets"][str(float(mb))]


def sweep(nproc: int = 2, link: str = "50MB/s,1ms", progress: bool = True, **flags) -> Sweep:
    """Launch this file on `nproc` processes with `flags` (python names: bucket_mb=[0, 25],
    no_link_too=True, trace="DIR") and return its Sweep."""
    from hplab.course.jobs import as_flags, launch_json

    lists = {k: v for k, v in flags.items() if isinstance(v, (list, tuple))}
    args = as_flags({k: v for k, v in flags.items() if k not in lists} | dict(link=link))
    for key, values in lists.items():
        args += ["--" + key.replace("_", "-"), *map(str, values)]
    label = f"bucket sweep on {nproc} processes, link {link}"
    return Sweep(*launch_json(nproc, Path(__file__), args, "--out", label, progress, 600.0))


if __name__ == "__main__":
    sys.exit(main())
