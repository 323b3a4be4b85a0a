"""A collective that cannot complete, said in one line that names it.

When a peer freezes, crashes or calls collectives in another order, gloo and NCCL raise a
RuntimeError in their own words: a C++ file and line, a sequence number, a port. `explained`
turns those into a `CommTimeout` that names the operation and the group, e.g. "all_reduce in
the dp group (ranks [0, 1]) timed out: a peer probably crashed or called collectives in a
different order". It is a layer of the collectives (`explained_call`, installed by
`hplab.runtime.group.init_distributed`), and wraps by hand the few calls the library makes on
torch.distributed itself (the group's forming, a checkpoint's gather, the metrics' gather).
"""

from __future__ import annotations

import contextlib

#: What gloo and NCCL say when a peer has gone ("connectFullMesh failed" while the group forms;
#: NCCL: once its communicator was aborted).
LOST_PEER = ("connect", "remote process exited", "network error", "communicator was aborted")
WHY_IT_FAILED = {  # what an error's text holds → what it means
    ("timed out", "timeout", "timing out"): "timed out: a peer probably crashed or called "
    "collectives in a different order",
    LOST_PEER: "lost its connection: a peer process ended",
}


class CommTimeout(RuntimeError):
    """A collective that cannot complete: it timed out (a peer froze or crashed, or ranks
    disagree on the order of collectives), or a peer process ended."""


@contextlib.contextmanager
def explained(op: str, group: str = "world", ranks: list[int] | None = None):
    """Inside, a timeout or a lost peer (gloo's or NCCL's own words: a C++ file and line)
    becomes a CommTimeout that names the operation and the group."""
    try:
        yield
    except RuntimeError as err:
        text = str(err).lower()
        why = next((w for k, w in WHY_IT_FAILED.items() if any(s in text for s in k)), None)
        if why:
            where = f"{group} group (ranks {ranks})" if ranks else f"{group} group"
            raise CommTimeout(f"{op} in the {where} {why}") from None
        raise


def explained_call(call):
    """The layer (hplab.parallel.collectives.LAYERS): each launch and wait of a Communicator's
    call inside `explained`, named by its operation and its group."""
    return explained(call.op, call.comm.name, call.comm.ranks)
