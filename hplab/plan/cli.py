"""The command line, `python -m hplab.plan`: a plan or a search, as a report for humans or as
JSON (`--json`). A refusal is one line, `hplab.plan: error: ...`, and exit code 2."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import fields, replace

from hplab.config import Layout, LayoutError, ModelConfig
from hplab.flags import add_flags
from hplab.plan.estimate import PlanError, plan
from hplab.plan.formulas import model_state_bytes
from hplab.plan.presets import (
    GB,
    GPU_PRESETS,
    Cluster,
    Efficiency,
    default_batch_size,
    efficiency_problem,
    model_presets,
)
from hplab.plan.reliability import LLAMA3_GPU_MTBF_H, checkpoint_plan, format_checkpoint_plan
from hplab.plan.search_layouts import TIME_PARTS, search

MODEL_FIELDS = {f.name for f in fields(ModelConfig)}
MAX_SEARCH_GPUS = 2**20
LAYOUT_FIELDS = [f.name for f in fields(Layout)]
DESCRIPTION = (
    "The planner: how much memory a layout needs on each GPU, how long a step takes, and why."
)

#: The winner's headline numbers, at the top level of `--search --json` for notebooks.
HEADLINE = (
    "model_state_bytes_per_gpu",
    "activation_bytes_per_gpu",
    "memory_bytes_per_gpu",
    "step_time_s",
    "tflops_per_gpu",
    "mfu",
    "layout",
)


def _rows(pairs, width: int = 34) -> list[str]:
    """One table row per (label, bytes): GB, or TB from 1e12 on."""
    return [
        f"  {label:<{width}s}" + (f"{x / GB:9.3f} GB" if x < 1e12 else f"{x / 1e12:9.3f} TB")
        for label, x in pairs
    ]


def format_plan(p: dict) -> str:
    moe = f", {p['n_experts']} experts, top-{p['moe_top_k']}" * bool(p["n_experts"])
    out = [
        f"{p['model']} (Ψ = {p['params'] / 1e9:.3g} B{moe}) on {p['gpus']} × {p['gpu']} "
        f"({p['gpus_per_node']} per node): {p['layout']}, {p['precision']}",
        "memory per GPU" + f" (worst: {p['worst_stage']} pipeline stage)" * (p["pp"] > 1),
    ]
    rows = {
        "params_bytes": "parameters",
        "grads_bytes": "gradients",
        "optim_bytes": "optimizer state",
        "master_bytes": "fp32 master weights",
        "activation_bytes_per_gpu": f"activations ({p['in_flight_microbatches']:g} mb in flight)",
        "recompute_working_bytes": "recompute working block",
        "zero3_gather_bytes": "ZeRO-3 gathered blocks",
        "memory_bytes_per_gpu": "total",
        "usable_bytes_per_gpu": f"usable ({p['gpu']})",
    }  # (params, acts, totals: never 0)
    out += _rows((label, p[k]) for k, label in rows.items() if p[k])
    out[-1] += "  fits" if p["fits"] else "  DOES NOT FIT"
    out += _rows([("offloaded to host", p["cpu_offload_bytes"])] * bool(p["cpu_offload_bytes"]))
    out.append(f"time per step: {p['step_time_s']:.4g} s")
    out += [
        f"  {label:<34s}{p[key]:10.4g} s  {p[key] / p['step_time_s']:6.1%}"
        for key, label in TIME_PARTS.items()
        if p[key]
    ]  # (compute: never 0)
    if p["dp_comm_s"] and p["dp_comm_exposed_s"] < p["dp_comm_s"]:
        out.append(
            f"  (data-parallel traffic {p['dp_comm_s']:.3g} s, of which hidden "
            f"{p['dp_comm_s'] - p['dp_comm_exposed_s']:.3g} s)"
        )
    out += [
        f"  ({key[:2]} group: each GPU sends {p[key] / GB:.4g} GB per step)"
        for key in ("cp_bytes_per_step", "ep_all_to_all_bytes_per_step")
        if p[key]
    ]
    out.append(
        f"throughput: {p['tokens_per_s']:.4g} tokens/s, {p['tflops_per_gpu']:.1f} TFLOP/s "
        f"per GPU (with recompute), {p['model_tflops_per_gpu']:.1f} model TFLOP/s, "
        f"MFU {p['mfu']:.1%}"
    )
    return "\n".join(out)


def format_search(res: dict, top: int = 10) -> str:
    out = [
        f"{res['model']} (Ψ = {res['params'] / 1e9:.3g} B) on {res['gpus']} × {res['gpu']} "
        f"({res['gpus_per_node']} per node), global batch {res['batch_size']}, "
        f"{res['precision']}: {res['feasible']} of {res['evaluated']} layouts fit "
        "(within 2% of the fastest counts as a tie; the simplest of those is ranked first)"
    ]
    if res["ranking"]:
        out.append(f"{'#':>3} {'layout':44s} {'GB/GPU':>7} {'s/step':>8} {'TFLOP/s':>8} {'MFU':>5}")
        out += [
            f"{i:>3} {p['layout']:44s} {p['memory_bytes_per_gpu'] / GB:7.1f} "
            f"{p['step_time_s']:8.3g} {p['tflops_per_gpu']:8.1f} {p['mfu']:5.1%}"
            for i, p in enumerate(res["ranking"][:top], 1)
        ]
    return "\n".join(out + res["explanation"])


def _positive(kind):
    """An argparse type: a number above 0 (a count: at least 1), else one line and exit 2."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(
                f"must be a positive, finite {kind.__name__}, got {text!r}"
            )
        return value

    return parse


#: The planner's own defaults for layout flags, where it decides more than `Layout` does.
LAYOUT_DEFAULTS = dict(dp=None, microbatches=None, batch_size=None, precision=None)
LAYOUT_HELPS = dict(
    dp="data-parallel size (default: --gpus ÷ (cp × tp × pp), else 1)",
    microbatches="microbatches per step (default: one sequence each with --pp, else 1)",
    batch_size="global batch, in sequences (default: the preset's, else 8)",
    precision="parameters and activations (default: fp32 for hplab's presets, bf16 for the others)",
    offload="optimizer state and its step on the host",
    cp_split="the sequence's cut over --cp (the planner prices both alike: it does not model "
    "the causal mask's uneven work)",
)


def _model_flags() -> dict:
    """The model: a preset, and the sizes that override it (as hplab/train.py names them)."""
    n = dict(type=_positive(int))
    preset = dict(action=argparse.BooleanOptionalAction, default=None)
    return {
        "--model": dict(
            default="gpt2",
            help="preset: hplab's tiny/gpt2/gpt2-medium, "
            "gpt3-125m ... gpt3-175b, megatron-1.7b ... megatron-1t",
        ),
        "--n-layer": n,
        "--n-embd": n,
        "--n-head": n,
        "--seq-len": dict(n, dest="n_positions", metavar="SEQ_LEN"),
        "--vocab-size": n,
        "--moe-experts": dict(n, dest="n_experts", help="a mixture of this many experts"),
        "--moe-top-k": dict(n, dest="moe_top_k", help="experts per token (default 2)"),
        "--dropout": dict(preset, help="count dropout masks (default: as the preset)"),
        "--flash-attention": dict(
            preset, help="attention keeps no s×s matrices (default: as the preset)"
        ),
        "--params": dict(
            type=_positive(float),
            help="only the model-state memory of this many "
            "parameters (with --dp, --zero, --precision)",
        ),
    }


def _efficiency(name: str):
    """An argparse type: a number within the range `Efficiency`'s field `name` allows."""

    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if problem := efficiency_problem(name, value):
            raise argparse.ArgumentTypeError(problem)  # (argparse names the flag)
        return value

    return parse


def _planner_flags() -> dict[str, dict]:
    """The cluster, the efficiency assumptions (`Efficiency`'s fields) and the output."""
    n = dict(type=_positive(int))
    real = dict(type=_positive(float))
    on = dict(action="store_true")
    return {
        "cluster": {
            "--gpu": dict(default="a100-80g", choices=tuple(GPU_PRESETS)),
            "--gpus": dict(n, help="total GPUs (required with --search)"),
            "--gpus-per-node": dict(n, default=8),
            "--intra-bw": dict(real, help="GB/s per GPU inside a node (default NVLink)"),
            "--inter-bw": dict(real, help="GB/s per GPU between nodes (default its NIC)"),
        },
        "efficiency assumptions": {
            "--eff-" + f.name.replace("_", "-"): dict(
                type=_efficiency(f.name), default=f.default, dest="eff_" + f.name
            )
            for f in fields(Efficiency)
        },
        "failures (with --gpus: how often to checkpoint, and the goodput)": {
            "--checkpoint-seconds": dict(
                real, help="training stops this long for each checkpoint (measured: metrics)"
            ),
            "--restart-seconds": dict(
                real, default=60.0, help="to restart after a failure, besides lost training"
            ),
            "--gpu-mtbf-hours": dict(
                real,
                default=LLAMA3_GPU_MTBF_H,
                help="hours between failures of one GPU (default: Llama 3's, 419 in 54 days "
                "on 16,384 GPUs)",
            ),
        },
        "output": {
            "--search": dict(on, help="rank every layout of --gpus GPUs that hplab runs"),
            "--include-refused": dict(
                on, help="with --search: rank the layouts hplab refuses too (priced all the same)"
            ),
            "--top": dict(n, default=10),
            "--json": on,
        },
    }


def build_parser() -> argparse.ArgumentParser:
    """The planner's flags: the model's as today, the layout's from `config.Layout` (as
    hplab/train.py derives its own), then the cluster, efficiency and output."""
    ap = argparse.ArgumentParser(prog="python -m hplab.plan", description=DESCRIPTION)
    ap.error = lambda message: ap.exit(2, f"hplab.plan: error: {message}\n")  # one line, exit 2
    _add_group(ap, "model (as hplab/train.py)", _model_flags())
    layout = ap.add_argument_group("layout (as hplab/train.py)")
    add_flags(layout, Layout, LAYOUT_DEFAULTS, skip=("bucket_mb", "prefetch"), helps=LAYOUT_HELPS)
    layout.add_argument(
        "--selective-recompute", action="store_true", help="the same as --recompute selective"
    )
    layout.add_argument(
        "--padded",
        action="store_true",
        help="ZeRO shards padded to a multiple of dp, as hplab allocates them",
    )
    for title, flags in _planner_flags().items():
        _add_group(ap, title, flags)
    return ap


def _add_group(ap: argparse.ArgumentParser, title: str, flags: dict) -> None:
    group = ap.add_argument_group(title)
    for flag, kwargs in flags.items():
        group.add_argument(flag, **kwargs)


def _model_states(args) -> tuple[dict, str]:
    """--params: the model states of a bare parameter count, per GPU [ZeRO Sec. 5]."""
    dp = args.dp or 1
    precision = args.precision or "bf16"
    st = model_state_bytes(
        args.params / (args.tp * args.pp), dp, args.zero, precision, args.offload, args.padded
    )
    res = {
        "params": args.params,
        "dp": dp,
        "tp": args.tp,
        "pp": args.pp,
        "zero": args.zero,
        "precision": precision,
        **st,
        "cpu_offload_bytes": st["cpu_bytes"],
        "model_state_bytes_per_gpu": st["total_bytes"],
    }
    rows = _rows(
        [(k[:-6].replace("cpu", "on host"), x) for k, x in st.items() if x or k != "cpu_bytes"],
        8,
    )
    title = (
        f"model states of Ψ = {args.params:.4g} parameters, {precision}, "
        f"ZeRO-{args.zero} over dp={dp} (per GPU) [ZeRO Sec. 5]"
    )
    return res, "\n".join([title, *rows])


def _model(args) -> ModelConfig:
    """The preset, with the sizes the flags give."""
    presets = model_presets()
    if args.model not in presets:
        raise PlanError(f"unknown model preset {args.model!r}: choose one of {', '.join(presets)}")
    sizes = {k: v for k, v in vars(args).items() if v is not None and k in MODEL_FIELDS}
    return replace(presets[args.model], **sizes)


def _layout(args, batch: int, precision: str) -> Layout:
    """The layout the flags give, with the planner's defaults for --dp (what --gpus leaves)
    and --microbatches (one sequence each with a pipeline)."""
    tp = args.tp
    pp = args.pp
    cp = args.cp
    dp = args.dp or (args.gpus // (cp * tp * pp) if args.gpus else 1)
    if args.gpus and dp * cp * tp * pp != args.gpus:
        raise PlanError(f"dp×cp×tp×pp = {dp}×{cp}×{tp}×{pp} ≠ --gpus {args.gpus}")
    recompute = args.recompute
    if args.selective_recompute and recompute == "none":  # (--recompute's mode wins)
        recompute = "selective"
    given = {name: getattr(args, name) for name in LAYOUT_FIELDS if hasattr(args, name)}
    given |= dict(
        dp=dp,
        microbatches=args.microbatches or (max(1, batch // dp) if pp > 1 else 1),
        batch_size=batch,
        precision=precision,
        recompute=recompute,
    )
    return Layout(**given)


def _run(args) -> tuple[dict, str]:
    """The result of the command line (its JSON) and the report for humans."""
    if args.params is not None:
        return _model_states(args)
    if args.checkpoint_seconds is not None:
        if not args.gpus:
            raise PlanError("--checkpoint-seconds needs --gpus N (the cluster that may fail)")
        res = checkpoint_plan(
            args.gpus, args.checkpoint_seconds, args.restart_seconds, args.gpu_mtbf_hours
        )
        return res, format_checkpoint_plan(res)
    model = _model(args)
    precision = args.precision or (
        "bf16" if args.model.startswith(("gpt3-", "megatron-")) else "fp32"
    )
    cluster = Cluster(GPU_PRESETS[args.gpu], args.gpus_per_node, args.intra_bw, args.inter_bw)
    eff = Efficiency(**{f.name: getattr(args, "eff_" + f.name) for f in fields(Efficiency)})
    batch = args.batch_size or default_batch_size(model)
    if args.search:
        if not args.gpus:
            raise PlanError("--search needs --gpus N")
        if args.gpus > MAX_SEARCH_GPUS:  # (its layouts grow with the divisors of N)
            raise PlanError(f"--search ranks layouts of up to {MAX_SEARCH_GPUS:,} GPUs")
        res = search(
            model,
            args.gpus,
            cluster,
            eff,
            batch,
            precision,
            allow_offload=args.offload,
            include_refused=args.include_refused,
        )
        del res["_all"]
        text = format_search(res, args.top)
        res["ranking"] = res["ranking"][: args.top]
        # the headline numbers of the winner, at top level for notebooks
        return {**res, **{k: res["winner"][k] for k in HEADLINE if res["winner"]}}, text
    res = plan(model, _layout(args, batch, precision), cluster, eff, args.padded)
    return res, format_plan(res)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        res, text = _run(args)
    except LayoutError as e:  # (PlanError too)
        parser.error(str(e))  # one line, exit code 2, like a bad flag
    except KeyboardInterrupt:
        parser.exit(130, "hplab.plan: interrupted\n")
    print(json.dumps(res, indent=2, default=str, ensure_ascii=False) if args.json else text)
    return 0
