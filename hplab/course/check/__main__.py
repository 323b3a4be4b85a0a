"""`python -m hplab.course.check NAME [FILE]`: the same command as `python -m hplab.check`."""

import sys

from hplab.course.check.runner import main

sys.exit(main())
