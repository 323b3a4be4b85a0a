"""pytest configuration for the notebooks: `python -m pytest --nbval-lax labs/`.

nbval re-executes every notebook top to bottom. With `--nbval-lax` only cells marked
`# NBVAL_CHECK_OUTPUT` must reproduce their saved output exactly: those print deterministic
things (equivalence results, byte counts from the ledgers, formulas). Cells that print timings
or draw measured plots are executed (they must not fail) but their output is not compared.
"""

collect_ignore_glob = [".ipynb_checkpoints/*", "exercises/*", "solutions/*"]

CELL_TIMEOUT_S = 600  # a lab cell takes under a minute; a stuck one should fail, not stall CI


def pytest_configure(config):
    """Cap nbval's per-cell timeout (its default is 2000 s) unless one was given explicitly."""
    if getattr(config.option, "nbval_cell_timeout", None) == 2000:
        config.option.nbval_cell_timeout = CELL_TIMEOUT_S
