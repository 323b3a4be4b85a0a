"""hplab DDP against PyTorch's DistributedDataParallel: same model, same data, same ranks.

    python bench/bench_ddp.py            # 4 processes, tiny and a ~10x larger model
    python bench/bench_ddp.py --quick    # one repeat, fewer steps

Each measurement is its own `torchrun` launch of this file (worker mode), alternating hplab and
PyTorch and repeating, so both see the same machine state; the median of the repeats is kept.
Reported per model:

* tokens/s ratio hplab / PyTorch (target ≥ 0.9),
* peak memory ratio: CUDA's `max_memory_allocated` on GPU; on CPU, the growth of the process's
  peak resident set over its size right before the model was built (the CPU allocator keeps
  no statistics; the baseline removes the PyTorch runtime both share),
* how much of the all-reduce time hplab's buckets hid behind backward, read from a timeline
  of two more steps (`hplab.course.timeline`, the same measurement as `train.py --trace` and the
  labs): of the time the all-reduces ran, from launch to completion on gloo's thread, the share
  during which the rank was still computing backward (`timeline.hidden_fraction`), mean over
  ranks.
  One bucket is launched when backward ends: nothing can hide, and ~0% is the check.

Results go to bench/results/ddp.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import MODELS, rss_bytes  # noqa: E402  (bench/ is on sys.path as the script dir)

from hplab.observe.memory import peak_rss_bytes  # noqa: E402


def worker(impl: str, model_name: str, steps: int, batch: int, bucket_mb: float, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from hplab.course.timeline import hidden_fraction, read_timeline
    from hplab.data import TokenDataset, get_batch, global_batch_indices, shard_for_rank
    from hplab.models.gpt import build_model, config_from_preset
    from hplab.observe.observers import Recorder
    from hplab.parallel.ddp import DDP
    from hplab.runtime.group import init_distributed, shutdown

    device = init_distributed()
    config = config_from_preset("tiny", **dict(MODELS[model_name].items()))
    ds = TokenDataset("shakespeare", seq_len=config.n_positions)
    n, rank = dist.get_world_size(), dist.get_rank()
    batches = [
        get_batch(ds, shard_for_rank(global_batch_indices(len(ds), s, batch, 0), rank, n))
        for s in range(steps)
    ]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    baseline = rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    model = build_model(config, 0).to(device)
    wrapped = (
        DDP(model, bucket_mb=bucket_mb)
        if impl == "hplab"
        else TorchDDP(model, bucket_cap_mb=bucket_mb)
    )
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.0)

    def step(x, y):  # the ordinary loop, the same for both
        _, loss = wrapped(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    warmup = 3
    for x, y in batches[:warmup]:
        step(x, y)
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches[warmup:]:
        step(x, y)
    dist.barrier()
    elapsed = time.perf_counter() - start
    tokens = (steps - warmup) * batch * config.n_positions
    result = {
        "tokens_per_s": tokens / elapsed,
        "peak_bytes": (
            torch.cuda.max_memory_allocated(device)
            if device.type == "cuda"
            else peak_rss_bytes() - baseline
        ),
        "num_params": config.num_params(),
    }

    if impl == "hplab":  # how much communication the buckets hid behind backward: a timeline
        trace_dir = f"{out}.trace"  # of steps 2 and 3 of three, one Chrome trace per rank
        recorder = Recorder(model, trace_dir, rank, range(3))
        for i, (x, y) in enumerate(batches[:3]):
            with recorder.step(i):
                step(x, y)
        dist.barrier()  # every rank's trace is written
        spans = read_timeline(trace_dir)[rank]
        result.update(  # (one process: nothing to all-reduce, nothing to hide)
            hidden_fraction=hidden_fraction(spans, ops=("all_reduce",)) if n > 1 else None,
            buckets=len(wrapped.buckets),
        )
    gathered = [None] * n
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    shutdown()  # before torch's DDP lets go of the group (a deadlock otherwise: see shutdown)


def launch(nproc, impl, model_name, steps, batch, bucket_mb) -> list[dict]:
    from hplab.runtime.launch import torchrun_command

    out = ROOT / "bench" / "results" / f".tmp_{impl}.json"
    cmd = torchrun_command(
        nproc,
        __file__,
        "--worker",
        impl,
        "--model",
        model_name,
        "--steps",
        str(steps),
        "--batch",
        str(batch),
        "--bucket-mb",
        str(bucket_mb),
        "--out",
        str(out),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{impl} on {model_name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    shutil.rmtree(f"{out}.trace", ignore_errors=True)  # the worker's own timeline
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=23)
    p.add_argument("--batch", type=int, default=32, help="global batch in sequences")
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--bucket-mb",
        type=float,
        nargs="+",
        default=[25.0, 1.0],
        help="bucket sizes to compare (both implementations use the same)",
    )
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "ddp.json"))
    p.add_argument("--worker"), p.add_argument("--model"), p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.steps, args.batch, args.bucket_mb[0], args.out)
    if args.quick:
        args.repeats, args.steps = 1, 8

    rows = []
    for model_name, bucket_mb in [(m, b) for m in MODELS for b in args.bucket_mb]:
        runs = {"hplab": [], "torch": []}
        for _ in range(args.repeats):
            for impl in runs:  # alternate, so both see the same machine
                runs[impl].append(
                    launch(args.nproc, impl, model_name, args.steps, args.batch, bucket_mb)
                )

        def med(impl, key):
            return statistics.median(statistics.mean(r[key] for r in run) for run in runs[impl])

        ours_all = runs["hplab"][-1]  # the last repeat, per rank
        ours = ours_all[0]
        rows.append(
            {
                "model": model_name,
                "num_params": ours["num_params"],
                "nproc": args.nproc,
                "bucket_mb": bucket_mb,
                "hplab_tokens_per_s": med("hplab", "tokens_per_s"),
                "torch_tokens_per_s": med("torch", "tokens_per_s"),
                "tokens_per_s_ratio": med("hplab", "tokens_per_s") / med("torch", "tokens_per_s"),
                "hplab_peak_bytes": med("hplab", "peak_bytes"),
                "torch_peak_bytes": med("torch", "peak_bytes"),
                "peak_memory_ratio": med("hplab", "peak_bytes") / med("torch", "peak_bytes"),
                "allreduce_hidden_fraction": None
                if args.nproc == 1
                else med("hplab", "hidden_fraction"),
                "allreduce_hidden_fraction_per_rank": [r["hidden_fraction"] for r in ours_all],
                "buckets": ours["buckets"],
            }
        )
    results = {
        "benchmark": "hplab DDP vs torch DistributedDataParallel",
        "command": "python bench/bench_ddp.py",
        "repeats": args.repeats,
        "steps_timed": args.steps - 3,
        "global_batch": args.batch,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores",
        "rows": rows,
    }
    path = Path(args.results)
    path.write_text(json.dumps(results, indent=1))
    print(
        "| model | params | bucket | tokens/s hplab | tokens/s PyTorch | ratio | peak mem ratio "
        "| all-reduce hidden behind backward |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['num_params'] / 1e6:.2f} M | {r['bucket_mb']:g} MiB "
            f"| {r['hplab_tokens_per_s']:,.0f} "
            f"| {r['torch_tokens_per_s']:,.0f} | {r['tokens_per_s_ratio']:.2f} "
            f"| {r['peak_memory_ratio']:.2f} | {100 * (r['allreduce_hidden_fraction'] or 0):.0f}% "
            f"({r['buckets']} bucket{'s' if r['buckets'] > 1 else ''}) |"
        )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
