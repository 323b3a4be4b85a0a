"""The one-GPU check: what of hplab's NCCL/CUDA path one GPU can run, run there, in one command.

    python bench/gpu_check.py            # under 8 minutes on one H100; bench/results/gpu.json
    python bench/gpu_check.py --quick    # fewer steps, no benchmarks

NCCL refuses two ranks on one GPU, so every run here is one rank in an NCCL group of one: the
device, the backend choice, the CUDA clocks, memory, checkpoints and traces, not a collective
between GPUs (those are correct by design and tested on the CPU: tests/test_gpu_path.py).

1. train.py, one rank, on every layout that fits one: fp32, bf16, fp16, recompute, ZeRO-1 and
   ZeRO-3 with offload, experts, and with --compile: each learns (the loss falls), on the GPU,
   with NCCL; tokens/s and peak memory (CUDA's max_memory_allocated) per layout;
2. save after 3 steps, resume to 6: the losses equal an uninterrupted run's;
3. --trace on the GPU, read back by hplab.course.timeline: its kernels are there;
4. the DDP and ZeRO benchmarks at world size 1 (hplab against PyTorch's own, same GPU);
5. lab 00's MFU for GPT-2 (124M) in bf16 at sequence 1024: tokens/s × FLOPs per token over the
   matmul peak measured on this GPU (and over the data sheet's, for the record), with and
   without --compile.

Each check passes or fails on its own (the reason is kept); the results, with the device's
name, torch's, CUDA's and NCCL's versions, go to bench/results/gpu.json. Without CUDA the script
says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

LAYOUTS = {  # one rank each: what fits one GPU
    "fp32": [],
    "bf16": ["--precision", "bf16"],
    "fp16": ["--precision", "fp16"],
    "recompute": ["--recompute"],
    "zero1 bf16": ["--zero", "1", "--precision", "bf16"],
    "zero3 offload": ["--zero", "3", "--offload"],
    "experts": ["--moe-experts", "4", "--moe-top-k", "2"],
    "compile": ["--compile"],
}
DATASHEET_TFLOPS = {"H100": 989, "H200": 989, "A100": 312}  # bf16 dense, per GPU


def train(flags: list[str], directory: Path, name: str) -> dict:
    """One run of train.py in a group of one (no launcher: this process's child); its metrics."""
    metrics = directory / f"{name.replace(' ', '_')}.json"
    command = [sys.executable, str(ROOT / "hplab" / "train.py"), "--no-progress"]
    done = subprocess.run(
        [*command, *flags, "--metrics", str(metrics)], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(errors[-1] if errors else f"exit code {done.returncode}")
    return json.loads(metrics.read_text())


def learned(metrics: dict) -> dict:
    """What a run shows of the GPU path: device, backend, the loss falling, speed, memory."""
    losses = [s["loss"] for s in metrics["steps"]]
    where = (metrics["device"], metrics["backend"])
    problems = [f"ran on {where[0]} with {where[1]}"] * (where != ("cuda", "nccl"))
    problems += ["a loss is not finite"] * (not all(math.isfinite(x) for x in losses))
    problems += [f"the loss did not fall: {losses[0]:.4f} → {losses[-1]:.4f}"] * (
        losses[-1] >= losses[0]
    )
    return {
        "pass": not problems,
        "problems": problems,
        "losses": losses,
        "tokens_per_s": metrics["tokens_per_s"],
        "peak_bytes": metrics["memory"][0]["peak_bytes"],
    }


def check(results: dict, name: str, run) -> None:
    """Run one check; keep its result, or its failure in one line."""
    start = time.perf_counter()
    try:
        results[name] = run()
    except Exception as err:  # (every check reports; none stops the others)
        results[name] = {"pass": False, "problems": [f"{type(err).__name__}: {err}"]}
    results[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"  {'ok ' if results[name]['pass'] else 'FAIL'} {name} ({results[name]['seconds']} s)")


def save_and_resume(directory: Path, steps: list[str]) -> dict:
    whole = train([*steps, "--steps", "6"], directory, "uninterrupted")
    train([*steps, "--steps", "3", "--save", str(directory / "ckpt")], directory, "saved")
    resumed = train([*steps, "--steps", "6", "--resume", str(directory / "ckpt")], directory, "r")
    a = [s["loss"] for s in whole["steps"][3:]]
    b = [s["loss"] for s in resumed["steps"]]
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
    problems = [] if worst < 1e-4 else [f"resumed losses differ by {worst:.1e} (relative)"]
    return {"pass": not problems, "problems": problems, "max_rel_diff": worst}


def trace_read_back(directory: Path, steps: list[str]) -> dict:
    from hplab.course.timeline import read_timeline

    train([*steps, "--steps", "3", "--trace", str(directory / "trace")], directory, "traced")
    (spans,) = read_timeline(directory / "trace")
    kernels = sum(s["kind"] == "kernel" for s in spans)
    problems = [] if kernels else ["no GPU kernel in the trace"]
    return {"pass": not problems, "problems": problems, "kernels": kernels, "spans": len(spans)}


def benchmark(script: str, directory: Path) -> dict:
    out = directory / f"{script}.json"
    command = [sys.executable, str(ROOT / "bench" / script), "--nproc", "1", "--quick"]
    done = subprocess.run([*command, "--results", str(out)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1])
    rows = json.loads(out.read_text())["rows"]
    return {"pass": True, "problems": [], "rows": rows}


def mfu(directory: Path, quick: bool, compiled: bool) -> dict:
    """GPT-2 (124M), bf16, sequence 1024: model FLOPs/s over the measured bf16 matmul peak."""
    from hplab.course.lab import measure_peak_flops
    from hplab.plan.formulas import training_flops_per_token

    flags = ["--model", "gpt2", "--precision", "bf16", "--batch-size", "16"]
    flags += ["--steps", "6" if quick else "15"] + ["--compile"] * compiled
    metrics = train(flags, directory, "gpt2_compiled" if compiled else "gpt2")
    m = metrics["model"]
    per_token = training_flops_per_token(m["num_params"], m["n_layer"], m["n_embd"], 1024)
    peak = measure_peak_flops(8192, device="cuda", dtype=torch.bfloat16, threads=None)
    sheet = next((v for k, v in DATASHEET_TFLOPS.items() if k in torch.cuda.get_device_name()), 0)
    flops = metrics["tokens_per_s"] * per_token
    return {
        "pass": True,
        "problems": [],
        "tokens_per_s": metrics["tokens_per_s"],
        "measured_peak_tflops": peak / 1e12,
        "mfu_of_measured_peak": flops / peak,
        "mfu_of_datasheet": flops / (sheet * 1e12) if sheet else None,
        "peak_bytes": metrics["memory"][0]["peak_bytes"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no benchmarks")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: nothing to check (run it on a machine with a GPU)")
        return 0
    steps = ["--steps", "8" if args.quick else "20", "--batch-size", "16"]
    results: dict = {}
    print(f"one-GPU check on {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory(prefix="hplab-gpu-") as tmp:
        directory = Path(tmp)
        for name, flags in LAYOUTS.items():

            def run(f=flags, n=name):
                return learned(train([*steps, *f], directory, n))

            check(results, f"train {name}", run)
        check(results, "save and resume", lambda: save_and_resume(directory, steps[2:]))
        check(results, "trace read back", lambda: trace_read_back(directory, steps[2:]))
        for script in () if args.quick else ("bench_ddp.py", "bench_zero.py"):
            check(results, script, lambda s=script: benchmark(s, directory))
        check(results, "gpt2 bf16 MFU", lambda: mfu(directory, args.quick, compiled=False))
        check(results, "gpt2 bf16 MFU compiled", lambda: mfu(directory, args.quick, True))
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "date": time.strftime("%Y-%m-%d"),
        "passed": sum(r["pass"] for r in results.values()),
        "checks": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['passed']} of {len(results)} checks passed; written to {args.out}")
    return 0 if report["passed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
