"""Time each collective against message size: the measurement behind lab 01's α-β model.

    torchrun --nproc_per_node 4 hplab/collectives_bench.py --out collectives.json

Every process calls the collective on S bytes of fp32 (S = min..max in powers of two, the payload
as `hplab.comm` counts it). A call's time is the slowest rank's (barrier, clock, call, clock); a
size reports the best of `--repeats` calls after a warm-up, the least disturbed by the machine (4
processes on 2 cores often wait for a core). Rank 0 writes JSON: `world_size`, `backend`,
`repeats`, `results` {op: [{bytes, time_s, median_s}]}, `ledger` (rank 0's CommLedger), `demo`.
"""

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # a script: the repo, not hplab/, on sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import time
from statistics import median

import torch
import torch.distributed as dist
from tqdm import tqdm

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv")


def one_call(comm, op: str, big, small) -> None:
    """`op` once among the ranks of `comm` on the payload `big` (`small`: this rank's slice)."""
    if op == "send_recv":
        partner = comm.rank ^ 1  # 0↔1, 2↔3, ...
        if partner < comm.size:
            (comm.send if comm.rank % 2 == 0 else comm.recv)(big, partner)
        return
    {"all_reduce": lambda: comm.all_reduce(big), "broadcast": lambda: comm.broadcast(big, src=0),
     "reduce_scatter": lambda: comm.reduce_scatter(small, big),
     "all_gather": lambda: comm.all_gather(big, small)}[op]()


def demo(comm) -> dict:
    """{op: (before, after)} of each collective once, to *see* it: rank r starts with
    [10r+1, ..., 10r+n] (all-gather: [10r+1]; send/recv: even ranks send to the next odd rank)."""
    shown = {}
    for op in OPS:
        start = 10 * comm.rank + torch.arange(1, comm.size + 1.0, device=comm.device)
        big, small = start.clone(), start[:1].clone()
        one_call(comm, op, big, small)
        shown[op] = ((small if op == "all_gather" else start).tolist(),
                     (small if op == "reduce_scatter" else big).tolist())
    return shown


def time_call(comm, op: str, big, small) -> float:
    """Seconds of one call, as the slowest rank saw it."""
    comm.barrier()
    start = time.perf_counter()
    one_call(comm, op, big, small)
    return comm.all_reduce_scalar(time.perf_counter() - start, op=dist.ReduceOp.MAX)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node N hplab/collectives_bench.py",
                                description=__doc__.split("\n")[0])
    for flag, default in (("--min-bytes", 2**10), ("--max-bytes", 2**22), ("--repeats", 5)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--out", help="write the JSON here (rank 0)")
    args = p.parse_args(argv)
    n = int(os.environ.get("WORLD_SIZE", 1))
    if args.min_bytes < 4 * n or args.max_bytes < args.min_bytes:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"hplab: error: need {4 * n} <= --min-bytes <= --max-bytes "
                  f"(got {args.min_bytes}, {args.max_bytes})", file=sys.stderr)
        return 2

    from hplab.dist import Mesh, init_distributed, shutdown

    mesh = Mesh.create(dp=n, device=init_distributed())
    comm = mesh.world
    sizes = [args.min_bytes << k for k in range((args.max_bytes // args.min_bytes).bit_length())]
    buffer = torch.ones(args.max_bytes // 4, device=comm.device)
    shown = demo(comm)
    mesh.ledger.reset()  # the ledger below counts the timed calls only
    results = {op: [] for op in args.ops}
    for op, nbytes in tqdm([(op, s) for op in args.ops for s in sizes], disable=comm.rank != 0,
                           unit="size", file=sys.stdout):
        numel = (nbytes - nbytes % (4 * n)) // 4  # whole fp32 slices for every rank
        message = (comm, op, buffer[:numel], buffer[:numel // n].clone())
        times = [time_call(*message) for _ in range(1 + args.repeats)][1:]  # [0]: warm-up
        results[op].append(dict(bytes=4 * numel, time_s=min(times), median_s=median(times)))
    demos = [None] * n if comm.rank == 0 else None
    dist.gather_object(shown, demos, dst=0)
    if comm.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(
            {"world_size": n, "backend": dist.get_backend(), "repeats": args.repeats,
             "results": results, "ledger": mesh.ledger.as_dict(), "demo": demos}, indent=1))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
