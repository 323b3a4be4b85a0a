"""The house style: ruff formats and lints every Python file (pyproject.toml holds the rules).

A line budget without a formatter rewards packing lines; with one, `ruff format` decides where
lines break and the budgets count what a reader reads."""

from __future__ import annotations

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
