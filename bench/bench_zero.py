"""hplab ZeRO against PyTorch's own: ZeRO-3 vs FSDP2 `fully_shard`, ZeRO-1 vs
DistributedDataParallel + ZeroRedundancyOptimizer. Same model, same data, same ranks.

    python bench/bench_zero.py            # 4 processes, tiny and a ~10x larger model
    python bench/bench_zero.py --quick    # one repeat, fewer steps

Each measurement is its own `torchrun` launch of this file (worker mode), alternating hplab and
PyTorch and repeating, so both see the same machine state; the median of the repeats is kept.
Both sides use AdamW(foreach=False). ZeRO-3: the same per-block sharding (hplab: one unit per
block + root; FSDP2: `fully_shard` on every block, then on the root). ZeRO-1: hplab's
`ZeroOptimizer(stage=1)` in the plain loop (it averages the gradients itself) against DDP +
`ZeroRedundancyOptimizer`. `--pairs zero1` runs one comparison only. Reported per model:

* tokens/s ratio hplab / PyTorch (target ≥ 0.9), timed over the steps after 3 warm-up steps;
* peak memory ratio: CUDA's `max_memory_allocated` on GPU; on CPU, the growth of the process's
  peak resident set over its size right before the model was built (the CPU allocator keeps
  no statistics; the baseline removes the PyTorch runtime both share), as bench_ddp.py. Both
  sides' modules (FSDP2, ZeroRedundancyOptimizer, hplab.parallel.zero) are imported before the
  baseline, so their code pages are not counted as data. (The PyTorch profiler's memory
  events are no alternative here: they miss frees made on gloo's threads, which is where
  the tensors of asynchronous collectives are released.)

Results go to bench/results/zero.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import MODELS, rss_bytes  # noqa: E402  (bench/ is on sys.path as the script dir)

from hplab.observe.memory import peak_rss_bytes  # noqa: E402

PAIRS = {"zero3": ("hplab-zero3", "torch-fsdp2"), "zero1": ("hplab-zero1", "torch-zero1")}


def make_optimizer(params, lr: float, weight_decay: float):
    """The AdamW every side uses (hplab's training settings)."""
    import torch

    return torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, foreach=False
    )


def build(impl: str, model, mesh, lr: float = 1e-3):
    """The model wrapped by `impl` and a `step(x, y)` that trains one step."""
    import torch

    if impl == "hplab-zero1":  # the tutorial loop, no DDP: the optimizer averages the grads
        from hplab.parallel.zero import ZeroOptimizer

        opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            mesh.dp,
            stage=1,
            lr=lr,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            foreach=False,
        )

        def step(x, y):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()

        return step

    if impl == "hplab-zero3":  # the same tutorial loop as FSDP2's below
        from hplab.parallel.fsdp import fully_shard as hplab_fully_shard

        for block in model.transformer.h:
            hplab_fully_shard(block, mesh.dp)
        hplab_fully_shard(model, mesh.dp)
        opt = make_optimizer(model.parameters(), lr, 0.0)
        wrapped = model
    elif impl == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dmesh = init_device_mesh(mesh.device.type, (mesh.dp_size,))
        for block in model.transformer.h:
            fully_shard(block, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        opt = make_optimizer(model.parameters(), lr, 0.0)
        wrapped = model
    else:  # torch-zero1
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(
            wrapped.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=lr,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            foreach=False,
        )

    def step(x, y):
        wrapped(x, y)[1].backward()
        opt.step()
        opt.zero_grad()

    return step


def worker(impl: str, model_name: str, steps: int, batch: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from hplab.data import TokenDataset, get_batch, global_batch_indices, shard_for_rank
    from hplab.models.gpt import build_model, config_from_preset
    from hplab.parallel.mesh import Mesh
    from hplab.runtime.group import init_distributed, shutdown

    device = init_distributed()
    mesh = Mesh(dp=dist.get_world_size(), device=device)
    config = config_from_preset("tiny", **MODELS[model_name])
    ds = TokenDataset("shakespeare", seq_len=config.n_positions)
    n, rank = mesh.dp_size, mesh.dp_rank
    batches = [
        get_batch(ds, shard_for_rank(global_batch_indices(len(ds), s, batch, 0), rank, n))
        for s in range(steps)
    ]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    import torch.distributed.device_mesh  # noqa: E401,F401
    import torch.distributed.fsdp
    import torch.distributed.optim  # noqa: E401,F401
    import torch.nn.parallel

    import hplab.parallel.zero  # noqa: F401

    baseline = rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step = build(impl, build_model(config, 0).to(device), mesh)
    warmup = 3
    for x, y in batches[:warmup]:
        step(x, y)
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches[warmup:]:
        step(x, y)
    dist.barrier()
    elapsed = time.perf_counter() - start
    result = {
        "tokens_per_s": (steps - warmup) * batch * config.n_positions / elapsed,
        "peak_bytes": (
            torch.cuda.max_memory_allocated(device)
            if device.type == "cuda"
            else peak_rss_bytes() - baseline
        ),
        "num_params": config.num_params(),
    }
    gathered = [None] * n
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    shutdown()  # before torch's wrappers let go of the group (see hplab.runtime.group.shutdown)


def launch(nproc, impl, model_name, steps, batch) -> list[dict]:
    from hplab.runtime.launch import torchrun_command

    out = ROOT / "bench" / "results" / f".tmp_zero_{impl}.json"
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
        "--out",
        str(out),
    )
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    result = json.loads(out.read_text())
    out.unlink()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=23)
    p.add_argument("--batch", type=int, default=32, help="global batch in sequences")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pairs", default=",".join(PAIRS), help="which comparisons, e.g. zero1")
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "zero.json"))
    p.add_argument("--worker"), p.add_argument("--model"), p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.steps, args.batch, args.out)
    if args.quick:
        args.repeats, args.steps = 1, 8

    rows = []
    for model_name in MODELS:
        for pair, (ours, theirs) in PAIRS.items():
            if pair not in args.pairs.split(","):
                continue
            runs = {ours: [], theirs: []}
            for _ in range(args.repeats):
                for impl in runs:  # alternate, so both see the same machine
                    runs[impl].append(launch(args.nproc, impl, model_name, args.steps, args.batch))

            def med(impl, key):
                return statistics.median(statistics.mean(r[key] for r in run) for run in runs[impl])

            rows.append(
                {
                    "model": model_name,
                    "num_params": runs[ours][-1][0]["num_params"],
                    "nproc": args.nproc,
                    "hplab": ours,
                    "torch": theirs,
                    "hplab_tokens_per_s": med(ours, "tokens_per_s"),
                    "torch_tokens_per_s": med(theirs, "tokens_per_s"),
                    "tokens_per_s_ratio": med(ours, "tokens_per_s") / med(theirs, "tokens_per_s"),
                    "hplab_peak_bytes": med(ours, "peak_bytes"),
                    "torch_peak_bytes": med(theirs, "peak_bytes"),
                    "peak_memory_ratio": med(ours, "peak_bytes") / med(theirs, "peak_bytes"),
                }
            )
    results = {
        "benchmark": "hplab ZeRO-3 vs FSDP2, hplab ZeRO-1 vs ZeroRedundancyOptimizer",
        "command": "python bench/bench_zero.py",
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
        "| model | params | hplab | PyTorch | tokens/s hplab | tokens/s PyTorch | ratio "
        "| peak mem hplab | peak mem PyTorch | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    MiB = 2**20
    for r in rows:
        print(
            f"| {r['model']} | {r['num_params'] / 1e6:.2f} M | {r['hplab']} | {r['torch']} "
            f"| {r['hplab_tokens_per_s']:,.0f} | {r['torch_tokens_per_s']:,.0f} "
            f"| {r['tokens_per_s_ratio']:.2f} | {r['hplab_peak_bytes'] / MiB:.1f} MiB "
            f"| {r['torch_peak_bytes'] / MiB:.1f} MiB | {r['peak_memory_ratio']:.2f} |"
        )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
