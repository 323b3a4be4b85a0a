"""Pipeline parallel benchmark: hplab's schedules on 4 ranks, in one run.

1. Throughput: hplab 1F1B against torch.distributed.pipelining's Schedule1F1B on the same
   model, split the same way, same microbatches; tokens/s ratio (target ≥ 0.9). The two are
   timed alternately, step by step (which goes first alternates too), so both see the same
   machine load; the median step time of each gives its tokens/s, and the ratio of the
   fastest steps (least disturbed by other processes) is reported beside it.
2. Bubble: for each schedule (GPipe, 1F1B, interleaved v=2, ZB-H1), the measured bubble per
   rank (1 − compute time / step time, from the trace of the step) next to the simulated one
   (plan.simulate of the same action lists with the mean F, B, W durations this run measured,
   messages free) and the formula (F = B = W).

    python bench/bench_pp.py            # writes bench/results/pp.json, prints a table

On a CPU box with fewer cores than ranks, ranks share cores: a rank's compute also slows
while another rank computes, and waiting ranks spin in gloo. The measured bubble is then
larger than the ideal one; on one GPU per rank the two get close. Numbers are what this
machine measured, nothing else.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

WORLD = 4
MICROBATCHES = 8
PER_MICROBATCH = 4
SEQ = 64
WARMUP_STEPS = 2  # not timed: one-time costs (allocations, first messages)
TIMED_STEPS = 30  # per side; enough that the median holds on a shared, noisy machine
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def model_config():
    from hplab.models.gpt import GPTConfig

    return GPTConfig(vocab_size=2048, n_positions=SEQ, n_embd=128, n_layer=8, n_head=4)


def batches(n):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 2048, (n, PER_MICROBATCH * MICROBATCHES, SEQ + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in t]


def hplab_engine(schedule, v):
    from hplab.cli import build_parser, layout_of, optim_of
    from hplab.models.gpt import build_model
    from hplab.observe.observers import MemoryWatch, PipelineTrace
    from hplab.parallel.compose import parallelize
    from hplab.parallel.mesh import Mesh
    from hplab.training import TrainState, build_lr_scheduler, build_optimizer, mark_no_decay

    args = build_parser().parse_args(
        [
            "--pp",
            str(WORLD),
            "--dp",
            "1",
            "--schedule",
            schedule,
            "--virtual-stages",
            str(v),
            "--microbatches",
            str(MICROBATCHES),
            "--batch-size",
            str(PER_MICROBATCH * MICROBATCHES),
        ]
    )
    mesh = Mesh(pp=WORLD)  # on the device init_distributed chose: a GPU each, or the CPU
    model = build_model(model_config(), seed=0).to(mesh.device)
    layout = layout_of(args)
    optim = optim_of(args)
    if optim.no_decay_bias_norm:  # by role, while the model is whole
        mark_no_decay(model)
    stages = parallelize(model, mesh, layout)
    optimizer = build_optimizer(stages, mesh, layout, optim)
    scheduler = build_lr_scheduler(optimizer, optim)
    engine = TrainState(stages, optimizer, scheduler, mesh, layout, optim)
    # measured as train.py measures a run: the trace, then every forward's saved activations
    trace, memory = PipelineTrace(engine.pipeline), MemoryWatch(engine)
    return engine, lambda: trace.report(engine.mesh.pp, memory)


def torch_1f1b():
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from hplab.config import Layout, OptimConfig
    from hplab.models.gpt import build_model
    from hplab.parallel import pp
    from hplab.parallel.mesh import Mesh
    from hplab.parallel.precision import MixedPrecision
    from hplab.training import make_sharded_optimizer

    mesh = Mesh(pp=WORLD)
    model = build_model(model_config(), seed=0).to(mesh.device)
    (stage,) = pp.build_stages(model, mesh.pp_rank, WORLD)
    pp.free_unowned_parameters(model, [stage])
    tied = pp.tied_embedding_group(mesh)
    runner = Schedule1F1B(
        PipelineStage(stage, mesh.pp_rank, WORLD, mesh.device, group=mesh.pp.group),
        MICROBATCHES,
        loss_fn=pp.loss_fn,
    )
    optim = OptimConfig(lr=1e-3)  # grouped as hplab's: the tied weight apart
    opt = make_sharded_optimizer(
        model, stage, [stage], mesh, Layout(pp=WORLD), optim, MixedPrecision()
    )

    def step(x, y):
        if mesh.pp_rank == 0:
            runner.step(x)
        elif mesh.pp_rank == WORLD - 1:
            runner.step(target=y)
        else:
            runner.step()
        pp.sum_tied_gradient([stage], tied)  # the embedding's two copies: one gradient
        opt.step()
        opt.zero_grad()

    return step, mesh


def _worker():
    import torch.distributed as dist

    from hplab.runtime.group import current_device
    from hplab.training import train_step

    device = current_device()  # a GPU per rank where there are enough, else the CPU
    data = [(x.to(device), y.to(device)) for x, y in batches(WARMUP_STEPS + TIMED_STEPS)]
    out = {"throughput": {}, "bubble": {}}

    # 1. hplab 1F1B vs torch Schedule1F1B, alternating step by step
    ours, _ = hplab_engine("1f1b", 1)
    theirs, mesh = torch_1f1b()
    times = {"hplab": [], "torch": []}
    for i, (x, y) in enumerate(data):
        for name in ("hplab", "torch") if i % 2 else ("torch", "hplab"):  # fair: alternate
            mesh.world.barrier()
            start = time.perf_counter()
            train_step(ours, x, y) if name == "hplab" else theirs(x, y)
            mesh.world.barrier()
            if i >= WARMUP_STEPS:
                times[name].append(time.perf_counter() - start)
    tokens = PER_MICROBATCH * MICROBATCHES * SEQ
    out["throughput"] = {name: tokens / statistics.median(t) for name, t in times.items()}
    out["step_times_s"] = times

    # 2. bubble of each schedule, measured on the last of a few steps
    for schedule, v in SCHEDULES:
        engine, report = hplab_engine(schedule, v)
        for x, y in data[:3]:
            train_step(engine, x, y)
        out["bubble"][f"{schedule}" + (f" v={v}" if v > 1 else "")] = {
            "schedule": schedule,
            "virtual_stages": v,
            **report(),
        }
    dist.barrier()
    return out


def main() -> dict:
    from hplab.course.viz import simulated_costs
    from hplab.parallel import pp
    from hplab.plan.simulate import simulate
    from hplab.runtime.launch import run_distributed

    results = run_distributed(_worker, WORLD, backend=None, timeout_s=900)  # NCCL on GPUs
    throughput = results[0]["throughput"]
    summary = {
        "world_size": WORLD,
        "microbatches": MICROBATCHES,
        "model": vars(model_config()),
        "tokens_per_step": PER_MICROBATCH * MICROBATCHES * SEQ,
        "tokens_per_s": throughput,
        "ratio_hplab_over_torch_1f1b": throughput["hplab"] / throughput["torch"],
        "ratio_best_step": min(results[0]["step_times_s"]["torch"])
        / min(results[0]["step_times_s"]["hplab"]),
        "step_times_s": results[0]["step_times_s"],
        "bubble": {},
    }
    for label, rank0 in results[0]["bubble"].items():
        schedule, v = rank0["schedule"], rank0["virtual_stages"]
        trace = [r["bubble"][label]["trace"] for r in results]
        measured = [r["bubble"][label]["bubble_fraction"] for r in results]
        costs = simulated_costs({"trace": trace, "virtual_stages": v})
        if schedule != "zb-h1":
            costs["w"] = 0.0  # a measured B includes the weight gradients
        sim = simulate(pp.build_schedule(schedule, WORLD, MICROBATCHES, v), **costs)
        summary["bubble"][label] = {
            "measured": measured,
            "simulated_with_measured_costs": [sim.bubble_fraction(r) for r in range(WORLD)],
            "formula": pp.bubble_formula(schedule, WORLD, MICROBATCHES, v)["of_step"],
            "mean_costs_ms": {k: c * 1e3 / v for k, c in costs.items()},
            "in_flight_max": [r["bubble"][label]["in_flight_max"] for r in results],
            "activation_bytes_in_flight_max": [
                r["bubble"][label]["activation_bytes_in_flight_max"] for r in results
            ],
        }
    return summary


def table(summary: dict) -> str:
    t = summary["tokens_per_s"]
    lines = [
        f"**Throughput, 4 ranks, 1F1B, m={summary['microbatches']}**: hplab "
        f"{t['hplab']:,.0f} tokens/s, torch.distributed.pipelining Schedule1F1B "
        f"{t['torch']:,.0f} tokens/s — ratio "
        f"**{summary['ratio_hplab_over_torch_1f1b']:.2f}** (median step; fastest step "
        f"of each: {summary['ratio_best_step']:.2f})",
        "",
        "| schedule | measured bubble (mean; per rank) | simulated, measured costs | "
        "formula (F=B=W) | in-flight max per rank |",
        "|---|---|---|---|---|",
    ]
    for label, b in summary["bubble"].items():
        mean = sum(b["measured"]) / len(b["measured"])
        sim = sum(b["simulated_with_measured_costs"]) / len(b["simulated_with_measured_costs"])
        per_rank = ", ".join(f"{x:.0%}" for x in b["measured"])
        lines.append(
            f"| {label} | {mean:.0%} ({per_rank}) | {sim:.0%} | {b['formula']:.0%} | "
            f"{b['in_flight_max']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    summary = main()
    out = Path(__file__).resolve().parent / "results" / "pp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(f"\nwritten to {out}")
