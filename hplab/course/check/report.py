"""What every checker shares: a file's Results (Report, one case at a time), the comparison of
tensors up to fp32 rounding (differs, first_wrong), the first problem of several (first) and
the collectives a call launched (collectives).
"""

from __future__ import annotations

import math
import traceback
from collections import namedtuple
from contextlib import contextmanager

import torch

from hplab.course.check.sandbox import LearnerError
from hplab.parallel.mesh import Mesh
from hplab.runtime.errors import CommTimeout

RTOL = 1e-5  # fp32 sums added in a different order agree to about this
ATOL = 1e-6
Result = namedtuple("Result", "name passed message")  # one check on one file, and what was seen


class CheckTimeout(BaseException):
    """A file ran past its time limit (not an Exception: a learner's `except` cannot eat it)."""


def differs(got, expected, n: int = 1) -> str | None:
    """None when tensor `got` equals `expected` up to fp32 rounding (RTOL, ATOL), else what
    differs: 'k of N elements differ; worst at [i, j]: got a, expected b' (or: n × too large)."""
    if got is None or got.shape != expected.shape:
        return "it is None" if got is None else f"shape {[*got.shape]}, not {[*expected.shape]}"
    got, expected = got.detach().double(), expected.detach().double()
    if not (bad := int((~torch.isclose(got, expected, RTOL, ATOL)).sum())):
        return None
    err = (got - expected).abs().nan_to_num(math.inf)
    index = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return (
        f"{bad} of {expected.numel()} elements differ; worst at {list(index)}: got "
        f"{float(got[index]):.6g}, expected {float(expected[index]):.6g}" + f" — it is {n}× "
        "too large: divide by n" * (n > 1 and not differs(got, n * expected))
    )


def first_wrong(named: dict, expected: list, what: str, n: int = 1) -> str | None:
    """'k of N {what}; first NAME: how it differs', or None when every tensor is right."""
    wrong = [(k, d) for (k, t), e in zip(named.items(), expected) if (d := differs(t, e, n))]
    return wrong and f"{len(wrong)} of {len(named)} {what}; first {wrong[0][0]}: {wrong[0][1]}"


def first(problems) -> str | None:
    """The first problem (a non-empty message) the iterable yields: a check stops there."""
    return next(filter(None, problems), None)


def collectives(mesh: Mesh, run, *args) -> tuple:
    """`run(*args)`'s result and the collectives it launched on this rank: {op: (calls, bytes)}."""
    mesh.ledger.reset()
    out = run(*args)
    return out, {op: (s.calls, s.bytes) for op, s in mesh.ledger.totals().items()}


class Report:
    """One file's Results. `with report.case(label):` runs a case: an exception from the learner's
    code (SystemExit too) fails it, and the next case runs. A distributed check (other ranks could
    be left waiting) only sets `report.label`: an exception ends the file's check (check_files)."""

    def __init__(self, path: str, hint: str):  # hint: what a CommTimeout usually means
        self.path = path
        self.hint = hint
        self.results = []
        self.label = "import"

    def add(self, problem: str | None, success: str, label: str | None = None) -> None:
        self.results.append(Result(label or self.label, not problem, problem or success))

    @contextmanager
    def case(self, label: str):
        self.label = label
        try:
            yield
        except (KeyboardInterrupt, CheckTimeout):
            raise
        except NotImplementedError as err:
            self.add(f"not implemented yet ({err})", "")
        except LearnerError as err:  # (from the sandbox: said there, with the line)
            self.add(str(err), "")
        except SystemExit as err:
            self.add(f"your file called sys.exit({err.code!r}): a checked file must not exit", "")
        except CommTimeout as err:  # only distributed exercises, each with a hint
            self.add(f"{err} — {self.hint}", "")
        except BaseException as err:  # self.label: the innermost case it came from
            lines = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == self.path]
            where = f" at line {lines[-1].lineno}: {lines[-1].line}" if lines else ""
            self.add(f"raised {type(err).__name__}: {err}{where}", "")

    def check(self, label: str, problems, success: str) -> None:
        """A case that fails with the first of `problems` (computed lazily, in order)."""
        with self.case(label):
            self.add(first(problems), success)
