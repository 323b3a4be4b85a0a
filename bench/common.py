"""What the benchmarks share: the models they compare on, and CPU memory readings."""

import os

MODELS = {  # name: overrides of the tiny preset; "tiny x10" has ~10x its parameters
    "tiny": {},
    "tiny x10": {"n_embd": 192, "n_layer": 7, "n_head": 6},
}


def rss_bytes() -> int:
    """The process's resident set right now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
