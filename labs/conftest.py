"""pytest configuration for the notebooks: `python -m pytest --nbval-lax labs/`.

nbval re-executes every notebook top to bottom. With `--nbval-lax` only cells marked
`# NBVAL_CHECK_OUTPUT` must reproduce their saved output exactly: those print deterministic
things (equivalence results, byte counts from the ledgers, formulas). Cells that print timings
or draw measured plots are executed (they must not fail) but their output is not compared.
"""

collect_ignore_glob = [".ipynb_checkpoints/*", "exercises/*", "solutions/*"]
