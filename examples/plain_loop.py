"""hplab's building blocks in an ordinary PyTorch training loop — the loop of any tutorial.

    torchrun --nproc_per_node 2 examples/plain_loop.py --wrap ddp
    torchrun --nproc_per_node 2 examples/plain_loop.py --wrap zero2
    torchrun --nproc_per_node 2 examples/plain_loop.py --wrap fsdp
    python examples/plain_loop.py --wrap none          # one process: the reference

Each rank reads its own share of every global batch; the wrapper averages the gradients, so
every layout prints the losses one process prints on the whole batch. Swap `hplab.DDP` for
`torch.nn.parallel.DistributedDataParallel`, `hplab.ZeroOptimizer` for
`torch.distributed.optim.ZeroRedundancyOptimizer` or `hplab.fully_shard` for
`torch.distributed.fsdp.fully_shard` and the loop stays the same.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hplab from this repository

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hplab  # noqa: E402
from hplab.data import TokenDataset, get_batch, global_batch_indices, shard_for_rank  # noqa: E402
from hplab.models.gpt import build_model, config_from_preset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrap", choices=["none", "ddp", "zero1", "zero2", "fsdp"], default="ddp")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8, help="global, in sequences")
    args = parser.parse_args()
    if args.steps < 1 or args.batch_size < 1:  # (the world size is checked below)
        parser.error(
            f"need --steps and --batch-size of at least 1: {args.steps}, {args.batch_size}"
        )

    device = hplab.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = config_from_preset("tiny")
    data = TokenDataset("shakespeare", tokenizer=config.tokenizer, seq_len=config.n_positions)
    model = build_model(config, seed=0).to(device)

    if args.wrap == "ddp":
        model = hplab.DDP(model)  # like DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif args.wrap in ("zero1", "zero2"):  # like ZeroRedundancyOptimizer(params, AdamW, ...)
        optimizer = hplab.ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, stage=int(args.wrap[-1]), lr=1e-3
        )
    elif args.wrap == "fsdp":  # like FSDP2: each block, then the root
        for block in model.transformer.h:
            hplab.fully_shard(block)
        hplab.fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # this rank's shards
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    losses = []
    for step in range(args.steps):
        indices = global_batch_indices(len(data), step, args.batch_size, seed=0)
        x, y = get_batch(data, shard_for_rank(indices, rank, world))
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # for printing only: the global batch's mean loss
        losses.append(float(mean) / world)
    if rank == 0:
        print(json.dumps({"wrap": args.wrap, "processes": world, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
