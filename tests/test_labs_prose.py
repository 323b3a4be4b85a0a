"""The labs are as short as README promises: each lab's prose (its markdown cells) stays at or
under 1,000 words, so a lab is the idea, the runs, the plots and the exercise; details live in
docstrings, docs/ or the appendix. Words are counted as whitespace-separated tokens, code
spans and formulas included (what a reader has to read).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

LABS = sorted((Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]_*.ipynb"))
MAX_WORDS = 1000


def prose_words(path: Path) -> int:
    notebook = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    return len(re.findall(r"\S+", text))


def test_every_numbered_lab_is_counted():
    assert [p.name[:2] for p in LABS] == [f"{n:02d}" for n in range(len(LABS))]
    assert len(LABS) >= 10


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_a_lab_has_at_most_1000_words_of_prose(path):
    words = prose_words(path)
    assert words <= MAX_WORDS, f"{path.name}: {words} words of prose, more than {MAX_WORDS}"


def test_the_count_counts_words(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Two words\n\nthree more `code`"),
        nbformat.v4.new_code_cell("not prose at all"),
    ]
    nbformat.write(notebook, tmp_path / "00_x.ipynb")
    assert prose_words(tmp_path / "00_x.ipynb") == 6
