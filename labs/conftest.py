"""pytest configuration for the notebooks: `python -m pytest --nbval-lax labs/`.

nbval re-executes every notebook top to bottom. With `--nbval-lax` only cells marked
`# NBVAL_CHECK_OUTPUT` must reproduce their saved output exactly: those print deterministic
things (equivalence results, byte counts from the ledgers, formulas). Cells that print timings
or draw measured plots are executed (they must not fail) but their output is not compared.
"""

collect_ignore_glob = [".ipynb_checkpoints/*", "exercises/*", "solutions/*"]

CELL_TIMEOUT_S = 600  # a lab cell takes under a minute; a stuck one should fail, not stall CI


def pytest_configure(config):
    """Cap nbval's per-cell timeout (its default is 2000 s) unless one was given explicitly;
    start a notebook's kernel once more if it dies before answering (below)."""
    if getattr(config.option, "nbval_cell_timeout", None) == 2000:
        config.option.nbval_cell_timeout = CELL_TIMEOUT_S
    from nbval import kernel

    kernel.start_new_kernel = _with_one_retry(kernel.start_new_kernel)


def _with_one_retry(start_new_kernel):
    """Once in a CI run a kernel died before it answered ("Kernel died before replying to
    kernel_info"; its stderr goes to /dev/null). Most likely a port: a kernel picks five free
    TCP ports, closes them and binds them again as it starts, while the multi-process tests
    beside it pick free ports the same way. A second start is what a user would do; a kernel
    that cannot start at all still fails, twice."""

    def start(*args, **kwargs):
        try:
            return start_new_kernel(*args, **kwargs)
        except RuntimeError:
            return start_new_kernel(*args, **kwargs)

    return start
