"""Tensor parallel benchmark: hplab's TP against PyTorch's DTensor TP, in one run.

    python bench/bench_tp.py            # 2 ranks (gloo on CPU), writes bench/results/tp.json
    python bench/bench_tp.py --quick    # fewer timed steps

1. Throughput: the same MLP (Linear → GeLU → Linear) and the same GPT block, on the same
   ranks and inputs, forward + backward, cut by hplab (`tp.parallelize`: `ColumnParallelLinear`
   / `RowParallelLinear`, heads split per Q/K/V) and by `parallelize_module` with
   `ColwiseParallel` / `RowwiseParallel`. DTensor's colwise split takes contiguous rows, so
   for the block c_attn's rows are first permuted to [q₀ k₀ v₀ | q₁ k₁ v₁] (per rank: its
   heads of Q, K, V) — otherwise it would compute a different function. Both sides' outputs
   are checked against one process before timing. The two are timed alternately, step by
   step, so both see the same machine load; tokens/s ratio hplab / DTensor (target ≥ 1.0).
2. Memory, measured by the MemoryLedger: parameter bytes per rank of a GPT under TP, next
   to the formula (split weights)/T + padding + replicated weights; activation bytes one
   block saves for backward: one process, TP, TP + sequence parallel.
3. Communication per block, from the CommLedger (calls and bytes, forward + backward).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import torch
import torch.nn as nn

from hplab.models import gpt as gpt_model

WORLD = 2
BATCH, SEQ = 8, 128
SHAPES = {"mlp": dict(n_embd=256), "block": dict(n_embd=256, n_head=8)}


def _timed(fn, x) -> float:
    """Seconds of one forward + backward on the device's clock (CUDA events on a GPU)."""
    from hplab.runtime.clock import clock_for

    xi, clock = x.clone().requires_grad_(), clock_for(x.device)
    start = clock.mark()
    fn(xi).sum().backward()
    return clock.seconds(start, clock.mark())


def _max_rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _permute_qkv_for_contiguous_split(c_attn: nn.Linear, T: int) -> None:
    """Reorder c_attn's output rows from [Q | K | V] to [q₀ k₀ v₀ | q₁ k₁ v₁ | ...] so a plain
    contiguous split (what ColwiseParallel does) hands each rank its heads' Q, K and V."""
    with torch.no_grad():
        for t in (c_attn.weight, c_attn.bias):
            q, k, v = (b.chunk(T) for b in t.chunk(3))
            t.copy_(torch.cat([torch.cat([q[r], k[r], v[r]]) for r in range(T)]))


def _pair(kind: str, comm):
    """(reference, hplab, dtensor) modules computing the same function."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from hplab.models.gpt import Block, GPTConfig
    from hplab.parallel import tp

    torch.manual_seed(0)
    T, mesh = comm.size, init_device_mesh(comm.device.type, (comm.size,))
    if kind == "mlp":
        h = SHAPES["mlp"]["n_embd"]
        ref = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU("tanh"), nn.Linear(4 * h, h))
        ref = ref.to(comm.device)
        ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
        tp.parallelize(ours, comm, {"0": tp.ColumnParallelLinear, "2": tp.RowParallelLinear})
        parallelize_module(theirs, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return ref, ours, theirs
    config = GPTConfig(**SHAPES["block"], n_layer=1, n_positions=SEQ)
    ref = Block(config).to(comm.device)
    for p in ref.parameters():  # non-trivial biases and norms, so every piece is checked
        nn.init.normal_(p, 0.0, 0.05 if p.dim() > 1 else 0.2)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    block_plan = {
        name.removeprefix("transformer.h.*."): style  # the GPT plan's entries for a block
        for name, style in gpt_model.TP_PLAN.items()
        if name.startswith("transformer.h.")
    }
    tp.parallelize(ours, comm, block_plan)
    _permute_qkv_for_contiguous_split(theirs.attn.c_attn, T)
    parallelize_module(
        theirs,
        mesh,
        {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        },
    )
    theirs.attn.n_head //= T
    return ref, ours, theirs


def _throughput(kind: str, comm, steps: int) -> dict:
    ref, ours, theirs = _pair(kind, comm)
    x = torch.randn(BATCH, SEQ, SHAPES[kind]["n_embd"], generator=torch.Generator().manual_seed(1))
    x = x.to(comm.device)
    with torch.no_grad():
        want = ref(x)
        check = {"hplab": _max_rel(ours(x), want), "dtensor": _max_rel(theirs(x), want)}
    for _ in range(2):  # warm-up
        _timed(ours, x), _timed(theirs, x)
    times = {"hplab": [], "dtensor": []}
    for _ in range(steps):  # alternate, so both see the same load
        times["hplab"].append(_timed(ours, x))
        times["dtensor"].append(_timed(theirs, x))
    tokens = BATCH * SEQ
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    return {
        "tokens_per_s": tps,
        "ratio": tps["hplab"] / tps["dtensor"],
        "max_rel_err_vs_one_process": check,
    }


def _param_bytes(comm) -> list[dict]:
    from hplab.models.gpt import build_model, config_from_preset
    from hplab.observe.memory import MemoryLedger
    from hplab.parallel import tp

    out = []
    for name, overrides in (
        ("tiny", {}),
        ("tiny, vocab 2049 (padded)", None),
        ("n_embd 256, 4 layers", {"n_embd": 256}),
    ):
        config = config_from_preset("tiny", **(overrides or {}))
        if overrides is None:
            from dataclasses import replace

            config = replace(config, vocab_size=2049)
        model = build_model(config, 0).to(comm.device)
        full = {n: p.numel() * 4 for n, p in model.named_parameters()}
        tp.parallelize(model, comm, gpt_model.TP_PLAN)
        split_names = {n for n, p in model.named_parameters() if tp.is_split(p)}
        padded_vocab = -(-config.vocab_size // comm.size) * comm.size
        padding = (padded_vocab - config.vocab_size) * config.n_embd * 4
        expected = (sum(full[n] for n in split_names) + padding) // comm.size + sum(
            b for n, b in full.items() if n not in split_names
        )
        ledger = MemoryLedger(comm.device)
        measured = ledger.measure({"params": list(model.parameters())})["params"]
        out.append(
            {
                "model": name,
                "single_process_bytes": sum(full.values()),
                "measured_bytes_per_rank": measured,
                "formula_bytes_per_rank": expected,
                "split_fraction": sum(full[n] for n in split_names) / sum(full.values()),
            }
        )
    return out


def _activations_and_comm(comm, ledger) -> dict:
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.observe.memory import MemoryLedger
    from hplab.parallel import tp

    config = GPTConfig(n_embd=256, n_head=8, n_layer=1, n_positions=SEQ, vocab_size=512)
    activations, comm_per_block = {}, {}
    for name in ("one process", "tp", "tp + sequence parallel"):
        model = build_model(config, 0).to(comm.device)
        if name != "one process":
            tp.parallelize(
                model, comm, gpt_model.TP_PLAN, sequence_parallel=name.endswith("parallel")
            )
        s = SEQ // comm.size if name.endswith("parallel") else SEQ
        hidden = torch.randn(BATCH, s, config.n_embd, device=comm.device, requires_grad=True)
        memory = MemoryLedger(comm.device)
        ledger.reset()
        with memory.track_activations(exclude=list(model.parameters()) + [hidden]):
            y = model.transformer.h[0](hidden)
        y.sum().backward()
        activations[name] = memory.activation_bytes
        comm_per_block[name] = ledger.by_group_dict().get("tp", {})
    return {
        "activation_bytes_per_block": activations,
        "comm_per_block": comm_per_block,
        "bsh_bytes": BATCH * SEQ * config.n_embd * 4,
    }


def worker(steps: int) -> dict:
    from hplab.parallel.mesh import Mesh

    torch.set_num_threads(1)
    mesh = Mesh(tp=WORLD)
    return {
        "throughput": {k: _throughput(k, mesh.tp, steps) for k in ("mlp", "block")},
        "params": _param_bytes(mesh.tp),
        **_activations_and_comm(mesh.tp, mesh.ledger),
    }


def table(r: dict) -> str:
    MiB = 2**20
    lines = [
        f"TP on {WORLD} ranks, {BATCH}×{SEQ} tokens, forward + backward",
        "",
        "| module | hplab tokens/s | DTensor tokens/s | ratio | max rel err hplab / DTensor |",
        "|---|---:|---:|---:|---|",
    ]
    for k, t in r["throughput"].items():
        e = t["max_rel_err_vs_one_process"]
        lines.append(
            f"| {k} (h={SHAPES[k]['n_embd']}) | {t['tokens_per_s']['hplab']:,.0f} | "
            f"{t['tokens_per_s']['dtensor']:,.0f} | {t['ratio']:.2f} | "
            f"{e['hplab']:.1e} / {e['dtensor']:.1e} |"
        )
    lines += [
        "",
        "| model | params, 1 process | measured per rank | formula per rank | split share |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in r["params"]:
        lines.append(
            f"| {p['model']} | {p['single_process_bytes']:,} | "
            f"{p['measured_bytes_per_rank']:,} | {p['formula_bytes_per_rank']:,} | "
            f"{p['split_fraction']:.0%} |"
        )
    a = r["activation_bytes_per_block"]
    lines += [
        "",
        "| one block (h=256, 8 heads) | activation MiB per rank | tp collectives (calls × b·s·h) |",
        "|---|---:|---|",
    ]
    for name, nbytes in a.items():
        ops = (
            ", ".join(
                f"{d['calls']} {op} ({d['bytes'] / r['bsh_bytes']:.0f})"
                for op, d in r["comm_per_block"][name].items()
            )
            or "none"
        )
        lines.append(f"| {name} | {nbytes / MiB:.2f} | {ops} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--out", default=str(ROOT / "bench/results/tp.json"))
    args = parser.parse_args()
    from hplab.runtime.launch import run_distributed

    steps = 5 if args.quick else 20
    result = run_distributed(worker, WORLD, steps, backend=None)[0]  # NCCL when each has a GPU
    result["config"] = {
        "world": WORLD,
        "batch": BATCH,
        "seq": SEQ,
        "timed_steps": steps,
        "torch": torch.__version__,
        "threads_per_rank": 1,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
