"""Lab 01 exercise: a ring all-reduce built from send and recv.

Implement `ring_all_reduce`, then run it on 4 real processes against the expected sums:

    python -m hplab.check ring_allreduce                 # checks this file
    python -m hplab.check ring_allreduce path/to/yours.py

The algorithm (lab 01 draws it): the n ranks stand in a ring; each sends to its right
neighbour (r + 1) % n and receives from its left neighbour (r - 1) % n. Cut the tensor into n
chunks (`flat.tensor_split(n)` always gives n of them, some possibly empty).

1. Reduce-scatter, n - 1 steps. At step s, rank r sends chunk (r - s) % n to the right,
   receives chunk (r - s - 1) % n from the left and adds it into its own copy of that chunk.
   Afterwards rank r holds the complete sum of chunk (r + 1) % n.
2. All-gather, n - 1 steps. At step s, rank r sends chunk (r + 1 - s) % n to the right,
   receives chunk (r - s) % n from the left and overwrites its copy with it.

Each rank sends 2(n - 1) chunks of S/n bytes: 2(n-1)/n · S in all, whatever n is. The checker
counts your bytes in the CommLedger, refuses anything else than send/recv, and watches every
message: it must go to the next rank and carry what that step of a ring carries.

Deadlock: if every rank first calls a blocking send, all of them may wait for a receiver that
never comes. An asynchronous send first is not enough either: NCCL runs a rank's sends and
receives in the order they were posted and may hold a send until its receive is posted, so
with every rank sending first, every send waits. Post each step's send and receive together:

    for pending in comm.send_and_recv([("send", chunk, right), ("recv", buffer, left)]):
        pending.wait()

`comm` is a `hplab.parallel.collectives.Communicator`: `comm.size`, `comm.rank`,
`comm.send_and_recv(ops)` (and `comm.send(tensor, dst, async_op)`, `comm.recv(tensor, src,
async_op)`); peers are ranks within the group.
"""

import torch


def ring_all_reduce(tensor: torch.Tensor, comm) -> torch.Tensor:
    """Sum `tensor` over all ranks of `comm`, in place, with only comm.send and comm.recv.
    Returns `tensor`."""
    n, r = comm.size, comm.rank
    if n == 1:
        return tensor
    right, left = (r + 1) % n, (r - 1) % n
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)
    # 1. reduce-scatter: n - 1 steps of send one chunk, receive and add another
    # 2. all-gather: n - 1 steps of send one chunk, receive and overwrite another
    # A tensor smaller than n has empty chunks: don't send or receive those (send only if
    # the chunk you send is non-empty, receive only if the one you receive is).
    raise NotImplementedError("the two phases of the ring: reduce-scatter, then all-gather")
