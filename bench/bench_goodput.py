"""Goodput against the checkpoint interval, measured: jobs whose processes are killed at random
times, restarted from their newest checkpoint, beside the formula of `hplab.plan.reliability`.

    python bench/bench_goodput.py           # ~12 minutes on 2 cores; bench/results/goodput.json
    python bench/bench_goodput.py --quick   # three intervals, shorter jobs

Every job is the same command, `python -m hplab.train --nproc 2 --steps N --save-every K
--max-restarts ...` (tiny, foreground saves), for several K. While it runs, this script kills
one of its processes (SIGKILL, as a lost node) at times drawn from a Poisson process of mean M
seconds, the same seeded draw for every K; the launcher stops the others and starts them all
again from the newest complete checkpoint, as it would after a real failure.

* measured goodput = N · t_step / (T − S): the clean training time the job needed over the time
  it took, its first start S left out (a long job pays it once), t_step the median of the job's
  own steps (a shared machine's speed drifts by ±20% between jobs; this takes it out);
* the formula, `reliability.goodput(τ, C, R, M)` with τ = K · t_step, C a save's measured cost
  (training stood still: the median of every save of every job), R a restart's (from each job's
  time taken, what its start, steps and saves do not account for, per failure: `accounting`;
  the median over the jobs) and the M of the failures it was given.

One failure schedule, a few failures per job: the measured points scatter around the expectation
by the luck of where each failure fell in its interval; their shape, and where the best K lies,
is what carries over. R is fitted (one number for every K); the shape against K is not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hplab.flags import at_least  # noqa: E402
from hplab.plan import reliability  # noqa: E402

RUN = ["--nproc", "2", "--batch-size", "8", "--no-progress"]


def workers_of(pid: int) -> list[int]:
    """The launcher's children: its ranks (train.py --nproc forks them)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def kill_on_schedule(job: subprocess.Popen, times: list[float], killed: list) -> None:
    """SIGKILL one of the job's ranks at each of `times` (seconds since it started)."""
    start, pick = time.monotonic(), random.Random(0)
    for at in times:
        while time.monotonic() - start < at:
            if job.poll() is not None:
                return
            time.sleep(0.01)
        while not (ranks := workers_of(job.pid)):  # between attempts: the next one's
            if job.poll() is not None:
                return
            time.sleep(0.01)
        try:
            os.kill(pick.choice(ranks), signal.SIGKILL)
            killed.append(round(time.monotonic() - start, 3))
        except ProcessLookupError:
            pass


def job(folder: Path, steps: int, every: int | None, failures: list[float]) -> dict:
    """One job; its metrics, wall-clock seconds and the times it was struck."""
    metrics, flags = folder / f"k{every}.json", ["--steps", str(steps)]
    if every:
        flags += ["--save", str(folder / f"ckpt{every}"), "--save-every", str(every)]
        flags += ["--max-restarts", str(len(failures) + 5)]
    command = [sys.executable, "-m", "hplab.train", *RUN, *flags, "--metrics", str(metrics)]
    start, killed = time.monotonic(), []
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    killer = threading.Thread(target=kill_on_schedule, args=(process, failures, killed))
    killer.start()
    try:
        _, err = process.communicate()
    except BaseException:  # Ctrl-C: the launcher stops its ranks on SIGTERM, as torchrun does
        process.terminate()
        process.wait()
        raise
    seconds = time.monotonic() - start
    killer.join()
    if process.returncode != 0:
        sys.exit(f"bench_goodput: the job with --save-every {every} failed:\n{err[-2000:]}")
    return dict(metrics=json.loads(metrics.read_text()), seconds=seconds, killed=killed)


def accounting(run: dict, steps: int, every: int, save_s: float, start_s: float) -> dict:
    """One job's numbers. Its time T = the first start S + the steps it trained (those a
    failure made it train again included) + its saves + a restart per failure, so a restart
    costs R = (T − S − trained · t_step − saves · C) / failures: what is left, its own first
    save included (it imports transformers' config: ~1 s here)."""
    metrics, seconds = run["metrics"], run["seconds"]
    step_s = statistics.median(s["time_s"] for s in metrics["steps"][1:])  # this job's speed
    redone = sum(  # a rank struck while starting has trained nothing: no step
        max((r["failed_at_step"] or 0) - (r["resumed_from_step"] or 0), 0)
        for r in metrics["restarts"]
    )
    trained, failures = steps + redone, len(metrics["restarts"])
    spent = start_s + trained * step_s + trained / every * save_s
    return dict(
        save_every=every,
        step_s=step_s,
        tau_s=every * step_s,
        seconds=round(seconds, 2),
        failures=failures,
        killed_at_s=run["killed"],
        steps_trained_again=redone,
        restart_s=(seconds - spent) / failures if failures else None,
        measured=steps * step_s / (seconds - start_s),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="three intervals, shorter jobs")
    seconds = at_least(0, float, above=True)  # (0, negative, inf, nan: one line)
    parser.add_argument("--mtbf", type=seconds, default=15.0, help="M: mean seconds between kills")
    args = parser.parse_args()
    steps, intervals = (400, [2, 16, 128]) if args.quick else (2000, [1, 4, 16, 64, 256])
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        clean = job(Path(tmp), steps, None, [])  # no saves, no failures
        step_s = statistics.median(s["time_s"] for s in clean["metrics"]["steps"][1:])
        start_s = clean["seconds"] - sum(s["time_s"] for s in clean["metrics"]["steps"])
        draw, horizon, failures = random.Random(1), 0.0, []
        while horizon < 3 * steps * step_s:  # more than any job lasts
            horizon += draw.expovariate(1 / args.mtbf)
            failures.append(round(horizon, 3))
        runs = {}
        for every in intervals:
            runs[every] = job(Path(tmp), steps, every, failures)
            print(f"--save-every {every:>4}: {runs[every]['seconds']:.0f} s", flush=True)
    saves = [c["seconds"] for run in runs.values() for c in run["metrics"]["checkpoints"]]
    save_s = statistics.median(saves)
    rows = [accounting(run, steps, every, save_s, start_s) for every, run in runs.items()]
    restart_s = statistics.median(r["restart_s"] for r in rows if r["failures"])
    for r in rows:
        r["formula"] = reliability.goodput(r["tau_s"], save_s, restart_s, args.mtbf)
    best = reliability.young_interval_s(save_s, args.mtbf)
    result = dict(
        machine=f"{os.cpu_count()} CPU cores, gloo, 2 processes",
        date=time.strftime("%Y-%m-%d"),
        steps=steps,
        step_s=step_s,
        mtbf_s=args.mtbf,
        save_s=save_s,
        restart_s=restart_s,
        young_interval_s=best,
        young_every=best / step_s,
        rows=rows,
    )
    print(
        f"t_step {step_s * 1e3:.0f} ms, C {save_s * 1e3:.0f} ms, R {restart_s:.2f} s, "
        f"M {args.mtbf:g} s: √(2·C·M) = {best:.2f} s = every {best / step_s:.0f} steps"
    )
    for r in rows:
        print(
            f"  every {r['save_every']:>4} steps: measured {r['measured']:.1%}, "
            f"formula {r['formula']:.1%}"
        )
    if not args.quick:
        out = ROOT / "bench" / "results" / "goodput.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the job got the same Ctrl-C; its folder is removed
        sys.exit("bench_goodput: interrupted; bench/results/goodput.json was not changed")
