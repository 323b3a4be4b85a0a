"""Time each collective against message size: the measurement behind lab 01's α-β model.

    torchrun --nproc_per_node 4 hplab/course/collectives_bench.py --out collectives.json
    python hplab/course/collectives_bench.py --nproc 4 --out collectives.json   (the same,
        its 4 ranks forked from this process as train.py --nproc forks them)

Every process calls the collective on S bytes of fp32 (S = min..max in powers of two, the payload
as the ledger counts it). A call's time is the slowest rank's (barrier, clock, call, clock); a
size reports the best of `--repeats` calls after a warm-up, the least disturbed by the machine (4
processes on 2 cores often wait for a core), the median, and `core_wait`: the seconds a rank
spent waiting for a free core per second of those calls, averaged over the ranks. Under an
emulated link (`--link 20MB/s,1ms`, or HPLAB_LINK) every call also pays the link's
α + (bus bytes)/β (`hplab.runtime.link`). Rank 0 writes JSON: `world_size`, `backend`, `link` (its
text, or null), `repeats`, `results` {op: [{bytes, time_s, median_s, core_wait}]}, `runs` {op:
what the backend ran inside one call}, `ledger` (rank 0's CommLedger, timed calls only), `demo`.
"""

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # a script: the repo, not its folder, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import os
import time
from statistics import median

import torch
import torch.distributed as dist
from tqdm import tqdm

from hplab.observe.observers import waited_for_a_core_s
from hplab.runtime.clock import clock_for

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv", "ring_step")


def one_call(comm, op: str, big, small, inbox) -> None:
    """`op` once among the ranks of `comm` on the payload `big` (`small`: this rank's slice;
    `inbox`: room to receive a `big`). A ring step is what each of a ring's 2(n-1) steps does:
    every rank sends to its right neighbour while it receives from its left one."""
    n = comm.size
    r = comm.rank
    if op == "send_recv":  # partners 0↔1, 2↔3, ...
        if r ^ 1 < n:
            (comm.send if r % 2 == 0 else comm.recv)(big, r ^ 1)
    elif op == "ring_step":  # posted together: lone sends on every rank could wait for ever
        for pending in comm.send_and_recv(
            [("send", big, (r + 1) % n), ("recv", inbox, (r - 1) % n)]
        ):
            pending.wait()
    else:
        {
            "all_reduce": lambda: comm.all_reduce(big),
            "broadcast": lambda: comm.broadcast(big, 0),
            "reduce_scatter": lambda: comm.reduce_scatter(small, big),
            "all_gather": lambda: comm.all_gather(big, small),
        }[op]()


def demo(comm) -> dict:
    """{op: (before, after)} of each collective once, to *see* it: rank r starts with
    [10r+1, ..., 10r+n] (all-gather: [10r+1]; send/recv: even ranks send to the next odd rank;
    ring step: what each rank received)."""
    shown = {}
    for op in OPS:
        start = 10 * comm.rank + torch.arange(1, comm.size + 1.0, device=comm.device)
        big = start.clone()
        small = start[:1].clone()
        inbox = torch.zeros_like(start)
        one_call(comm, op, big, small, inbox)
        after = {"reduce_scatter": small, "ring_step": inbox}.get(op, big)
        shown[op] = ((small if op == "all_gather" else start).tolist(), after.tolist())
    return shown


def inside(comm, op: str, *message) -> list[str]:
    """What the backend really runs for one call (torch.profiler): its own collectives and the
    copies around them (gloo's reduce-scatter turns out to be a whole all-reduce)."""
    with torch.profiler.profile() as prof:
        one_call(comm, op, *message)
    return sorted(
        {
            e.key
            for e in prof.key_averages()
            if e.key.startswith(("gloo:", "nccl"))  # gloo's events, NCCL's kernels
            or e.key in ("aten::clone", "aten::copy_", "aten::cat", "aten::add_")
        }
    )


def time_call(comm, op: str, *message, clock=None) -> float:
    """Seconds of one call, as the slowest rank saw it, on the device's clock (runtime/clock.py:
    on a GPU, CUDA events around the work, not the host's queueing of it)."""
    clock = clock or clock_for(comm.device)
    comm.barrier()
    start = clock.mark()
    one_call(comm, op, *message)
    seconds = clock.seconds(start, clock.mark())
    return comm.all_reduce_scalar(seconds, op=dist.ReduceOp.MAX)


def parse_args(argv=None):
    """The command line; None (and the error printed by rank 0) for impossible sizes."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N hplab/course/collectives_bench.py",
        description=__doc__.split("\n")[0],
    )
    for flag, default in (("--min-bytes", 2**10), ("--max-bytes", 2**22), ("--repeats", 5)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--out", help="write the JSON here (rank 0)")
    p.add_argument("--link", help="an emulated link, BANDWIDTH[,LATENCY] (default: HPLAB_LINK)")
    p.add_argument("--nproc", type=int, help="start this many ranks here (without torchrun)")
    args = p.parse_args(argv)
    n = int(os.environ.get("WORLD_SIZE", args.nproc or 1))
    if machine := machine_named(args.link or os.environ.get("HPLAB_LINK")):
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"hplab: error: {machine}", file=sys.stderr)
        return None
    if args.min_bytes < 4 * n or args.max_bytes < args.min_bytes:
        if int(os.environ.get("RANK", 0)) == 0:
            print(
                f"hplab: error: need {4 * n} <= --min-bytes <= --max-bytes "
                f"(got {args.min_bytes}, {args.max_bytes})",
                file=sys.stderr,
            )
        return None
    return args


def machine_named(text: str | None) -> str | None:
    """Why a machine (`--link h100-80g`) cannot time collectives here, or None: its balance is
    measured on a model's compute, and this benchmark has no model."""
    from hplab.runtime import balance, link

    try:
        machine = balance.parse_machine(text)
    except link.LinkError as err:
        return str(err)
    if machine is None:
        return None
    return (
        f"--link {text!r}: a machine's balance is measured on a model's compute, and the "
        "collectives have none; give a link's numbers, e.g. --link 20MB/s,200us"
    )


def measure(comm, op: str, nbytes: int, buffer, inbox, repeats: int) -> dict:
    """`op` on `nbytes` (whole fp32 slices for every rank), timed `repeats` times after a
    warm-up: the best and the median call, and the ranks' mean wait for a core per second."""
    n = comm.size
    numel = (nbytes - nbytes % (4 * n)) // 4  # whole fp32 slices for every rank
    message = (comm, op, buffer[:numel], buffer[: numel // n].clone(), inbox[:numel])
    waited = waited_for_a_core_s()
    wall = time.perf_counter()
    times = [time_call(*message) for _ in range(1 + repeats)][1:]  # [0]: warm-up
    waited = (waited_for_a_core_s() - waited) / (time.perf_counter() - wall)
    return dict(
        bytes=4 * numel,
        time_s=min(times),
        median_s=median(times),
        core_wait=comm.all_reduce_scalar(waited) / n,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args is None:
        return 2
    if args.nproc and "RANK" not in os.environ:  # the launcher: its ranks run main again
        from hplab.runtime.launch import launch

        return launch(args.nproc, sys.argv[1:] if argv is None else list(argv), main, __file__)

    from hplab.parallel.mesh import Mesh
    from hplab.runtime import collector, link
    from hplab.runtime.group import init_distributed, shutdown

    n = int(os.environ.get("WORLD_SIZE", 1))
    mesh = Mesh(dp=n, device=init_distributed())
    if args.link:
        link.use(args.link)
    comm = mesh.world
    sizes = [args.min_bytes << k for k in range((args.max_bytes // args.min_bytes).bit_length())]
    buffer = torch.ones(args.max_bytes // 4, device=comm.device)
    inbox = torch.empty_like(buffer)
    shown = demo(comm)
    runs = {
        op: inside(comm, op, buffer, buffer[: buffer.numel() // n].clone(), inbox)
        for op in args.ops
    }
    mesh.ledger.reset()  # the ledger below counts the timed calls only
    results = {op: [] for op in args.ops}
    with collector.between_steps():  # (no rank pauses for Python's collector mid-call)
        for op, nbytes in tqdm(
            [(op, s) for op in args.ops for s in sizes],
            disable=comm.rank != 0,
            unit="size",
            file=sys.stdout,
        ):
            results[op].append(measure(comm, op, nbytes, buffer, inbox, args.repeats))
    demos = [None] * n if comm.rank == 0 else None
    dist.gather_object(shown, demos, dst=0)
    if comm.rank == 0 and args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "world_size": n,
                    "backend": dist.get_backend(),
                    "link": (args.link or os.environ.get("HPLAB_LINK")) if link.WIRE else None,
                    "repeats": args.repeats,
                    "results": results,
                    "runs": runs,
                    "ledger": mesh.ledger.as_dict(),
                    "demo": demos,
                },
                indent=1,
            )
        )
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
