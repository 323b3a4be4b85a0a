"""Check a lab exercise: `python -m hplab.check NAME [FILE]`.

Each lab ends with an exercise in `labs/exercises/`. This command loads your file, runs it the
way hplab runs its own code — on several real processes when the idea is distributed — compares
it with the reference (measured bytes, sums computed independently, the gradient one process
computes on the whole batch) and says precisely what differs:

    python -m hplab.check memory              # lab 00: count training memory by hand
    python -m hplab.check buckets my_copy.py  # lab 02, your own copy of the exercise
    python -m hplab.check --help              # every exercise, and its lab

Exit code 0 when every check passes, 1 when one fails, 2 for a wrong command line; a file that
raises, exits or runs too long fails with one line. Solutions: `labs/solutions/` (try first).

The checkers, one module per lab (`lab00_memory.py` ... `lab11_goodput.py`, named as the
exercises are), share `report.py` (Results, tensor comparisons) and, for labs 02 and 03,
`reference.py` (a tiny GPT trained by one process); `runner.py` runs them, each file in a
`sandbox.py` process whose results cross as plain data (`plain.py`, never pickle) and which
cannot keep a change to hplab's own files (`guard.py`).
`python -m hplab.course.check NAME [FILE]` is the same command.
"""

from hplab.course.check.report import (
    ATOL,
    RTOL,
    CheckTimeout,
    Report,
    Result,
    collectives,
    differs,
    first,
    first_wrong,
)
from hplab.course.check.runner import (
    EXERCISES,
    EXERCISES_DIR,
    FILE_LIMIT_S,
    SOLUTIONS_DIR,
    Exercise,
    check_files,
    main,
    run_check,
)

__all__ = [
    "ATOL",
    "EXERCISES",
    "EXERCISES_DIR",
    "FILE_LIMIT_S",
    "RTOL",
    "SOLUTIONS_DIR",
    "CheckTimeout",
    "Exercise",
    "Report",
    "Result",
    "check_files",
    "collectives",
    "differs",
    "first",
    "first_wrong",
    "main",
    "run_check",
]
