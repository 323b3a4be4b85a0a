"""`python -m hplab.check NAME [FILE]`: the exercise checker, now in `hplab.course.check`."""

import sys

from hplab.course.check import (  # noqa: F401 (the names learners and tests import from here)
    EXERCISES,
    EXERCISES_DIR,
    FILE_LIMIT_S,
    SOLUTIONS_DIR,
    main,
    run_check,
)

if __name__ == "__main__":
    sys.exit(main())
