"""Time each collective against message size: the measurement behind lab 01's α-β model.

    torchrun --nproc_per_node 4 hplab/collectives_bench.py --out collectives.json

Every process calls the same collective on a message of S bytes (fp32), for S = min..max in
powers of two. One call is timed as: barrier, start clock, collective, stop clock; the time of
the call is the slowest rank's (a collective is done when everyone is done), and the time
reported for a size is the best of `--repeats` calls after one warm-up call: the call least
disturbed by everything else the machine runs (on a 2-core laptop, 4 processes share 2 cores,
so a rank is often waiting for a core, not for the network).

S is the payload as `hplab.comm` counts it: the tensor for all-reduce and broadcast, the
gathered output of all-gather, the full input of reduce-scatter, the message of send/recv.
For send/recv, ranks pair up (0→1, 2→3, ...) and every pair sends at the same time.

The JSON written by rank 0: `world_size`, `backend`, `repeats`, `results` {op: [{bytes, time_s,
median_s}]}, `ledger` (rank 0's CommLedger totals over the timed calls: calls, bytes, bus bytes)
and `demo` (per rank, each operation once on a tiny tensor: before and after).
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
import statistics
import sys
import time
from pathlib import Path

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv")


def one_call(comm, op: str, nbytes: int, buffers: dict):
    """Run `op` once on a message of `nbytes` payload bytes among the ranks of `comm`."""
    n, numel = comm.size, nbytes // 4
    big, small = buffers["big"][:numel], buffers["small"][:numel // n]
    if op == "all_reduce":
        comm.all_reduce(big)
    elif op == "reduce_scatter":
        comm.reduce_scatter(small, big)
    elif op == "all_gather":
        comm.all_gather(big, small)
    elif op == "broadcast":
        comm.broadcast(big, src=0)
    elif op == "send_recv":
        partner = comm.rank ^ 1  # 0↔1, 2↔3, ...
        if partner < n:
            (comm.send if comm.rank % 2 == 0 else comm.recv)(big, partner)
    else:
        raise ValueError(f"unknown operation {op!r}: choose from {', '.join(OPS)}")


def demo(comm) -> dict:
    """Each collective once on tiny tensors, to *see* what it does: rank r starts with
    [10r+1, 10r+2, ..., 10r+n] (all-gather: [10r+1]; send/recv: even ranks send to the next
    odd rank). Returns {op: (what this rank had before, what it has after)}."""
    import torch

    shown = {}
    for op in OPS:
        start = torch.arange(1, comm.size + 1, dtype=torch.float32, device=comm.device) + 10 * comm.rank
        big, small = start.clone(), start[:1].clone()  # small: all-gather in, reduce-scatter out
        one_call(comm, op, big.nbytes, {"big": big, "small": small})
        shown[op] = ((small if op == "all_gather" else start).tolist(),
                     (small if op == "reduce_scatter" else big).tolist())
    return shown


def time_call(comm, op: str, nbytes: int, buffers: dict) -> float:
    """Seconds of one call, as the slowest rank saw it."""
    import torch.distributed as dist

    comm.barrier()
    start = time.perf_counter()
    one_call(comm, op, nbytes, buffers)
    elapsed = time.perf_counter() - start
    return comm.all_reduce_scalar(elapsed, op=dist.ReduceOp.MAX)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node N hplab/collectives_bench.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--min-bytes", type=int, default=2**10)
    p.add_argument("--max-bytes", type=int, default=2**22)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--out", help="write the JSON here (rank 0)")
    args = p.parse_args(argv)

    import torch
    from tqdm import tqdm

    from hplab.dist import Mesh, init_distributed, shutdown

    device = init_distributed()
    mesh = Mesh.create(dp=int(torch.distributed.get_world_size()), device=device)
    comm = mesh.world
    if args.min_bytes < 4 * comm.size or args.max_bytes < args.min_bytes:
        if comm.rank == 0:
            print(f"hplab: error: need {4 * comm.size} <= --min-bytes <= --max-bytes "
                  f"(got {args.min_bytes}, {args.max_bytes})", file=sys.stderr)
        shutdown()
        return 2
    sizes = [args.min_bytes << k for k in range((args.max_bytes // args.min_bytes).bit_length())]
    buffers = {"big": torch.ones(args.max_bytes // 4, device=device),
               "small": torch.ones(args.max_bytes // 4 // comm.size, device=device)}
    shown = demo(comm)
    mesh.ledger.reset()  # the ledger below counts the timed calls only
    results = {op: [] for op in args.ops}
    bar = tqdm(total=len(args.ops) * len(sizes), disable=comm.rank != 0, unit="size",
               file=sys.stdout)
    for op in args.ops:
        for nbytes in sizes:
            nbytes -= nbytes % (4 * comm.size)  # whole fp32 slices for every rank
            time_call(comm, op, nbytes, buffers)  # warm-up
            times = [time_call(comm, op, nbytes, buffers) for _ in range(args.repeats)]
            results[op].append({"bytes": nbytes, "time_s": min(times),
                                "median_s": statistics.median(times)})
            bar.update()
    bar.close()
    demos = [None] * comm.size if comm.rank == 0 else None
    torch.distributed.gather_object(shown, demos, dst=0)
    if comm.rank == 0 and args.out:
        data = {"world_size": comm.size, "backend": torch.distributed.get_backend(),
                "repeats": args.repeats, "results": results, "ledger": mesh.ledger.as_dict(),
                "demo": demos}
        Path(args.out).write_text(json.dumps(data, indent=1))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
