"""Check a lab exercise: `python -m hplab.check NAME [FILE]`.

The runner: which file and checker each exercise has (EXERCISES), its checks run in this
process or on several (run_check), and the command line (main).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections import namedtuple
from pathlib import Path

import torch

from hplab.course.check.guard import Snapshot
from hplab.course.check.lab00_memory import check_memory
from hplab.course.check.lab01_ring_allreduce import check_ring
from hplab.course.check.lab02_buckets import check_buckets
from hplab.course.check.lab03_zero1 import check_zero1
from hplab.course.check.lab04_tp_linear import check_tp_linear
from hplab.course.check.lab05_1f1b import check_one_f_one_b
from hplab.course.check.lab06_mesh import check_mesh
from hplab.course.check.lab07_planning import check_planning
from hplab.course.check.lab08_lse_merge import check_lse_merge
from hplab.course.check.lab09_dispatch import check_dispatch
from hplab.course.check.lab10_gqa_heads import check_gqa_heads
from hplab.course.check.lab11_goodput import check_goodput
from hplab.course.check.report import CheckTimeout, Report, Result
from hplab.course.check.sandbox import Sandbox
from hplab.parallel.mesh import Mesh
from hplab.runtime.launch import run_distributed

EXERCISES_DIR, SOLUTIONS_DIR = (
    Path(__file__).resolve().parents[3] / "labs" / folder for folder in ("exercises", "solutions")
)
FILE_LIMIT_S = 120.0  # for one file's whole check; the solutions need a few seconds
OWN_FILES = "the checker's files"  # the case that fails when a checked file wrote to hplab


# nproc: the processes it runs on (0: this one, no Mesh); hint: what a CommTimeout often means
Exercise = namedtuple("Exercise", "lab file nproc check hint", defaults=("",))
SAME_ORDER = "do all ranks launch the same collectives (buckets) in the same order?"
EXERCISES = {
    "memory": Exercise("00", "lab00_memory.py", 0, check_memory),
    "ring_allreduce": Exercise(
        "01",
        "lab01_ring_allreduce.py",
        4,
        check_ring,
        "did a send wait for a receive that never came? post each step's send and receive "
        'together: comm.send_and_recv([("send", ...), ("recv", ...)])',
    ),
    "buckets": Exercise("02", "lab02_buckets.py", 2, check_buckets, SAME_ORDER),
    "zero1": Exercise("03", "lab03_zero1.py", 2, check_zero1, SAME_ORDER),
    "tp_linear": Exercise("04", "lab04_tp_linear.py", 2, check_tp_linear, SAME_ORDER),
    "one_f_one_b": Exercise("05", "lab05_1f1b.py", 0, check_one_f_one_b),
    "mesh": Exercise("06", "lab06_mesh.py", 0, check_mesh),
    "planning": Exercise("07", "lab07_planning.py", 0, check_planning),
    "lse_merge": Exercise("08", "lab08_lse_merge.py", 0, check_lse_merge),
    "dispatch": Exercise("09", "lab09_dispatch.py", 0, check_dispatch),
    "gqa_heads": Exercise("10", "lab10_gqa_heads.py", 0, check_gqa_heads),
    "goodput": Exercise("11", "lab11_goodput.py", 0, check_goodput),
}


def check_files(name: str, paths: list[str], limit_s: float, fork=False) -> list[list[Result]]:
    """Per file, its Results as this process sees them; each file gets `limit_s` seconds
    (`fork`: a lone check's sandbox forks from this process, see Sandbox). A lone check keeps
    hplab's files as they were (guard.py) file by file; a distributed one, run_check."""

    def expire(*_):  # SIGALRM's handler (checks run in a main thread)
        raise CheckTimeout

    exercise = EXERCISES[name]
    previous = signal.signal(signal.SIGALRM, expire)
    mesh = [Mesh(dp=exercise.nproc)] if exercise.nproc else []
    out = []
    for path in paths:
        report = Report(path, exercise.hint)
        sandbox = None
        files = None if mesh else Snapshot()
        try:
            signal.setitimer(signal.ITIMER_REAL, limit_s)
            with report.case("import"):  # the learner's file, in a sandbox of its own (with
                sandbox = Sandbox(path, mesh[0].world if mesh else None, fork)  # its comm)
                exercise.check(sandbox, report, *mesh)
        except CheckTimeout:
            report.add(f"did not finish in {limit_s:g} s: an endless loop, or ranks waiting?", "")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sandbox and sandbox.close()
        if files and (problem := files.restore()):
            report.add(problem, "", OWN_FILES)
        out.append(report.results)
    signal.signal(signal.SIGALRM, previous)
    return out


def _merge(per_rank: list[list[Result]]) -> list[Result]:
    """Rank 0's cases, each failed when it failed on any rank (the first such rank's message)."""
    return [
        next(
            (
                Result(r.name, False, f"{rows[c].message} (rank {k})")
                for k, rows in enumerate(per_rank)
                if c < len(rows) and not rows[c].passed
            ),
            r,
        )
        for c, r in enumerate(per_rank[0])
    ]


def check_exercise_file(path: Path, file: str) -> None:
    """ValueError, one line, unless `path` is a regular file (a folder names the file in it)."""
    if path.is_dir():
        inside = path / file
        hint = f"did you mean {inside}?" if inside.is_file() else f"name a file in it, {file}"
        raise ValueError(f"{path} is a folder, not your exercise file: {hint}")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a regular file (a pipe or a device?): name a .py file")
    if not path.exists():
        raise ValueError(f"no such file: {path}")


def run_check(name: str, paths: list[str | Path], limit_s: float = FILE_LIMIT_S, fork=False):
    """Per file, its Results, all checked in one launch (ValueError: unknown exercise or file)."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}: choose one of {', '.join(EXERCISES)}")
    nproc, paths = EXERCISES[name].nproc, [str(Path(p).resolve()) for p in paths]
    for path in map(Path, paths):
        check_exercise_file(path, EXERCISES[name].file)
    if nproc == 0:
        return check_files(name, paths, limit_s, fork)
    files = Snapshot()  # (the ranks and their sandboxes have all ended when it is compared)
    try:
        by_rank = run_distributed(
            check_files, nproc, name, paths, limit_s, timeout_s=limit_s * len(paths) + 60
        )
    except (TimeoutError, RuntimeError) as err:  # a process died or hung outside the limit
        line = f"the {nproc}-process check ended early: {str(err).strip().splitlines()[-1]}"
        by_file = [[Result("run", False, line)] for _ in paths]
    else:
        by_file = [_merge(per_rank) for per_rank in zip(*by_rank)]
    if problem := files.restore():  # one launch: every file it checked is suspect
        by_file = [[*results, Result(OWN_FILES, False, problem)] for results in by_file]
    return by_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m hplab.check", description=__doc__.split("\n")[0])
    parser.add_argument("name", help=", ".join(f"{n} (lab {v.lab})" for n, v in EXERCISES.items()))
    parser.add_argument("file", nargs="?", help="your file (default: labs/exercises/...)")
    args = parser.parse_args(argv)
    exercise = EXERCISES.get(args.name, Exercise("", "", 0, None))
    path = args.file or str(EXERCISES_DIR / exercise.file)
    try:  # alone in this process: on one thread, its sandbox can fork from here (no server)
        torch.set_num_threads(1)
        results = run_check(args.name, [path], fork=True)[0]
    except ValueError as err:
        print(f"hplab: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hplab: interrupted", file=sys.stderr)
        return 130
    shown = os.path.relpath(path)
    failed = sum(not r.passed for r in results)
    where = f"on {exercise.nproc} processes" if exercise.nproc else "in this process"
    print(
        f"check {args.name} (lab {exercise.lab}) {where}: "
        f"{path if shown.startswith('..') else shown}"
    )
    for r in results:
        print(f"  {'✓' if r.passed else '✗'} {r.name}: {r.message}")
    print(
        f"FAIL: {failed} of {len(results)} checks failed"
        if failed
        else f"PASS: all {len(results)} checks passed"
    )
    return int(failed > 0)
