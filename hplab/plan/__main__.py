"""`python -m hplab.plan`: see `hplab.plan.cli`."""

from hplab.plan.cli import main

main()
