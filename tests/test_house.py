"""The house style: ruff formats and lints every Python file (pyproject.toml holds the rules).

A line budget without a formatter rewards packing lines; with one, `ruff format` decides where
lines break and the budgets count what a reader reads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("command", "fix"),
    [(["format", "--check"], "ruff format ."), (["check"], "ruff check --fix .")],
)
def test_ruff(command, fix):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"run `{fix}`:\n{done.stdout}{done.stderr}"


# --- the rooms and their budgets, as ruff formats the code ------------------------------------
# hplab/parallel/ is the course's subject: each strategy file reads top to bottom as the
# explanation of its strategy, and the room is kept short enough to read whole. A file holds one
# concept however long it needs (no per-file cap: that rewarded packing); a function stays short.

LIBRARY = REPO / "hplab"
PARALLEL = LIBRARY / "parallel"
COURSE = LIBRARY / "course"
PARALLEL_LINES, FUNCTION_LINES = 3600, 60
# The names a learner has always typed, re-exported from the course: nothing else in them.
SHIMS = {"check.py"}
# The strategies, each knowing nothing of the others; compose.py puts them together.
STRATEGIES = [
    "ddp.py", "zero.py", "fsdp.py", "tp.py", "pp.py", "schedule.py", "cp.py", "moe.py",
    "precision.py",
]  # fmt: skip
ROOMS = ["parallel", "models", "runtime", "observe", "plan", "course"]


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def library_files() -> list[Path]:
    return [p for p in LIBRARY.rglob("*.py") if COURSE not in p.parents]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (`from hplab import lab` counts as hplab.lab)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_every_room_exists_with_a_docstring():
    """Each room says in its __init__ what it holds, for a reader who opens the folder."""
    for room in ROOMS:
        init = LIBRARY / room / "__init__.py"
        assert init.exists(), f"hplab/{room}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), (
            f"hplab/{room}/__init__.py: no docstring"
        )


@pytest.mark.xfail(
    strict=True,
    reason="the issue's target, not met yet: the room measured 3,755 lines when it was first "
    "drawn (the strategies' 3,050 with the collectives, the mesh, sync and optim); the "
    "placement record, FSDP2's methods, the DeviceMesh and the gradient hooks brought it to "
    "4,109, moving the training step (hplab/training.py) and ZeRO's checkpoint state "
    "(hplab/zero_checkpoint.py) out to the run's room back to 3,811; DTensor's three "
    "placements as small classes (not a 2.5 s import), the experts' guard, the hooks' home and "
    "receives posted ahead make 3,941, the plans' shared styles moving to models/ 3,908, and "
    "one K/V communicator per count 3,911; the experts' buckets in DDP and the executor's "
    "tied-embedding sum (a step after backward no more) 3,984, each block's memory read from "
    "outside (observe/memory.py's held_by) 3,940, fully_shard's checkpoint helpers beside "
    "ZeRO's (that file now hplab/sharded_state.py) 3,916; the closing note says what is left",
)
def test_the_parallel_room_within_its_budget():
    total = sum(lines(p) for p in PARALLEL.glob("*.py"))
    assert total <= PARALLEL_LINES, f"hplab/parallel/ holds {total} lines"


def test_no_function_too_long():
    long = {}
    for path in LIBRARY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                if size > FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = size
    assert long == {}


def _names(node) -> set[str]:
    return {ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)}


def test_no_packed_lines():
    """The packing idioms a line budget once rewarded, which ruff has no rule for: `a, b = x, y`
    where the values read none of the targets (two statements on one line; a swap or an update
    `q, k = rope(q), rope(k)` is one statement), and `for x in y if cond else ()` (an `if`)."""
    packed = []
    for path in LIBRARY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                targets = [t for t in node.targets if isinstance(t, ast.Tuple)]
                if targets and not set().union(*map(_names, targets)) & _names(node.value):
                    packed.append(where)
            iters = [node.iter] if isinstance(node, ast.For | ast.comprehension) else []
            if any(isinstance(i, ast.IfExp) and not getattr(i.orelse, "elts", 1) for i in iters):
                packed.append(where)
    assert packed == []


def test_named_lambdas_are_not_silenced():
    """E731 (a lambda given a name: use a def) is checked, nowhere silenced."""
    assert "E731" not in (REPO / "pyproject.toml").read_text()
    silenced = [
        str(p.relative_to(REPO))
        for folder in ("hplab", "tests", "bench", "examples", "labs")
        for p in (REPO / folder).rglob("*.py")
        if "noqa: " + "E731" in p.read_text()  # (spelt in two: this file is one of them)
    ]
    assert silenced == []


def test_the_library_never_imports_the_course():
    """The course (checkers, plots, notebook helpers) builds on the library, never the reverse;
    the shims only re-export a course module under the name learners have always used."""
    for path in library_files():
        course = {m for m in imported_modules(path) if m.startswith("hplab.course")}
        if course and path.parent == LIBRARY and path.name in SHIMS:
            assert lines(path) <= 15, f"{path.name} should only re-export {course}"
        else:
            assert not course, f"{path.relative_to(REPO)} imports {course}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategies_do_not_import_each_other(name):
    """Their composition lives in one place, parallel/compose.py (which imports them all)."""
    same = {name} | ({"schedule.py"} if name == "pp.py" else set())  # one strategy
    others = {f"hplab.parallel.{s[:-3]}" for s in STRATEGIES if s not in same}
    others.add("hplab.parallel.compose")
    imported = imported_modules(PARALLEL / name)
    assert not imported & others, f"{name} imports another strategy: {imported & others}"


def test_data_flows_one_way():
    """train.py → parallel → collectives / mesh: the subject never imports the run's command
    line, its observers or its launcher (they attach from outside)."""
    outside = (
        "hplab.train",
        "hplab.cli",
        "hplab.preflight",
        "hplab.observe",
        "hplab.runtime.launch",
    )
    for path in PARALLEL.glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(outside)}
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_command_line_page_lists_every_refusal_with_its_reason():
    """docs/command-line.md's table of what does not compose yet is hplab.refusals.REFUSALS,
    word for word."""
    from hplab.refusals import REFUSALS

    page = (REPO / "docs" / "command-line.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    for _, fields, why in REFUSALS:
        flags = ", ".join(f"`--{name.replace('_', '-')}`" for name in fields)
        assert f"| {flags} | {why} |" in rows, f"docs/command-line.md lacks the refusal: {why}"
