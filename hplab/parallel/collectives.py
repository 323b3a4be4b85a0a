"""The collectives every strategy calls, and the ledger that counts what they moved.

Seven operations carry all of distributed training:

    all_reduce      every rank ends with the sum of everyone's tensor        (DDP gradients)
    reduce_scatter  every rank ends with the sum of one 1/n slice             (ZeRO gradients)
    all_gather      every rank ends with everyone's slices, concatenated      (ZeRO params)
    broadcast       every rank ends with one rank's tensor                    (initial weights)
    send / recv     one rank hands a tensor to another                        (pipeline stages)
    all_to_all      every rank sends slice j of its tensor to rank j          (expert dispatch)

A `Communicator` runs them inside one process group (a mesh family: dp, tp, pp or world) and
records each call in a `CommLedger`: calls, payload bytes (the tensor; all-gather's gathered
*output*, reduce-scatter's full *input*) and "bus bytes", what each rank's link carries in a
ring algorithm (the nccl-tests convention). For n ranks and a payload of S bytes:

    all_reduce      2(n-1)/n · S     (a reduce-scatter, then an all-gather)
    all_gather      (n-1)/n · S
    reduce_scatter  (n-1)/n · S
    all_to_all      (n-1)/n · S      (S: what this rank sends; its own slice stays home)
    broadcast, send, recv   S

A group of one rank has nothing to exchange: calls on it return at once, uncounted.

That is all a Communicator does. What a run adds around every call is a *layer* in `LAYERS`,
set up once by `hplab.runtime.group.init_distributed`: a timeout or a lost peer said in one line
(`hplab.runtime.errors`), the call's range in a profiler's timeline (`hplab.observe.ranges`), the
emulated wire (`hplab.runtime.link`), the GPU's own clock (`hplab.runtime.clock`). A
Communicator in a plain script, without them, runs the same collectives.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, astuple, dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hplab.plan.formulas import bus_factor  # the factors above, in one home


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    bus_bytes: float = 0.0
    time_s: float = 0.0  # CPU: the caller blocked in the call or its wait(); GPU: its own time


class CommLedger:
    """Per operation (and per mesh family), the calls, payload bytes and bus bytes of one rank."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.by_group: dict[str, dict[str, OpStats]] = defaultdict(lambda: defaultdict(OpStats))

    def record(self, op: str, group: str, nbytes: int, group_size: int, seconds: float) -> None:
        stats = self.by_group[group][op]
        stats.calls += 1
        stats.bytes += nbytes
        stats.bus_bytes += nbytes * bus_factor(op, group_size)
        stats.time_s += seconds

    @contextlib.contextmanager
    def unrecorded(self):
        """Collectives that are not training (checkpoint gathers, evaluation) stay out of it."""
        training_traffic = self.by_group
        self.reset()
        try:
            yield
        finally:
            self.by_group = training_traffic

    def add_time(self, op: str, group: str, seconds: float) -> None:
        self.by_group[group][op].time_s += seconds

    def totals(self) -> dict[str, OpStats]:
        """Per operation, summed over the families."""
        out: dict[str, OpStats] = defaultdict(OpStats)
        for ops in self.by_group.values():
            for op, s in ops.items():
                out[op] = OpStats(*(a + b for a, b in zip(astuple(out[op]), astuple(s))))
        return dict(out)

    def as_dict(self) -> dict[str, dict]:
        """`{op: {calls, bytes, bus_bytes, time_s}}`, the metrics file's `comm` entry."""
        return {op: asdict(s) for op, s in sorted(self.totals().items())}

    def by_group_dict(self) -> dict[str, dict[str, dict]]:
        return {
            g: {op: asdict(s) for op, s in sorted(ops.items())}
            for g, ops in sorted(self.by_group.items())
            if ops
        }


@dataclass(eq=False)
class Call:
    """One collective on its way through the layers: what they read, and what they may set."""

    comm: Communicator
    op: str  # "all_reduce", ..., "send_and_recv" (a batch of `parts`)
    nbytes: int = 0  # its payload, as the ledger counts it
    peer: int | None = None  # send, recv: the other end (a position in comm.ranks)
    parts: list[Call] = field(default_factory=list)  # send_and_recv: a Call per message
    bookkeeping: str = ""  # the kit's own call ("barrier"), by its name: not training traffic
    stage: str = "launch"  # or "wait"
    launch_async: bool = False  # set by a layer that needs the work's handle: a blocking call
    # is then launched asynchronously, and waited for at once
    work: object = None  # torch.distributed's handle of the launched call (a layer may wrap it)
    seconds: float | None = None  # the ledger's time of this stage, where a layer knows better
    # than the host's clock (on a GPU: the device's own time)

    def elapsed(self, start: float) -> float:
        """The ledger's time of this stage, begun at `start` (time.perf_counter)."""
        return time.perf_counter() - start if self.seconds is None else self.seconds


#: What a run wraps around every launch and every wait: context-manager factories
#: `layer(call)`, outermost first (set by hplab.runtime.group; empty: the bare collectives).
LAYERS: list = []


@contextlib.contextmanager
def through_layers(call: Call, stage: str):
    """Inside every layer of `LAYERS`, for the `stage` ("launch" or "wait") of `call`."""
    call.stage = stage
    call.seconds = None
    with contextlib.ExitStack() as stack:
        for layer in LAYERS:
            stack.enter_context(layer(call))
        yield call


class Pending:
    """The handle of an asynchronous collective: call `wait()` before using its result.
    `share`: its part of a work it shares with others (a batch NCCL ran as one)."""

    def __init__(self, call: Call | None, share: float = 1.0):
        self.call = call
        self.share = share

    def wait(self) -> None:
        if self.call is None:
            return
        call = self.call
        start = time.perf_counter()
        with through_layers(call, "wait"):
            call.work.wait()
        call.comm.ledger.add_time(call.op, call.comm.name, call.elapsed(start) * self.share)
        self.call = None

    def is_completed(self) -> bool:
        return self.call is None or self.call.work.is_completed()


OPEN_COMMUNICATORS: weakref.WeakSet[Communicator] = weakref.WeakSet()


class Communicator:
    """Collectives within one process group, recorded in a ledger. `ranks` are the group's global
    ranks in order; `send`/`recv` peers and the `broadcast` source are positions in that list."""

    def __init__(
        self,
        group,
        name: str,
        ledger: CommLedger,
        ranks: list[int] | None = None,
        device: torch.device | str = "cpu",
    ):
        self.group = group
        self.name = name
        self.ledger = ledger
        self.device = torch.device(device)
        self.ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        OPEN_COMMUNICATORS.add(self)

    def release(self) -> None:
        """Let go of the process group (at shutdown), so that it can be freed."""
        self.group = None

    def _run(self, op: str, nbytes: int, launch, async_op: bool, peer: int | None = None):
        """Launch one collective (`launch(async_op)`, the torch.distributed call) and count it
        in the ledger; return its Pending (`async_op`), or None once it is done."""
        if self.size == 1:
            return Pending(None) if async_op else None
        call = Call(self, op, nbytes, peer, launch_async=async_op)
        start = time.perf_counter()
        with through_layers(call, "launch"):
            call.work = launch(call.launch_async)
        self.ledger.record(op, self.name, nbytes, self.size, call.elapsed(start))
        if async_op:
            return Pending(call)
        if call.launch_async:  # a layer wanted the handle: wait here, as the blocking call would
            Pending(call).wait()
        return None

    # -- the seven operations --
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In place: `tensor` becomes the element-wise reduction (sum) over the group."""
        return self._run(
            "all_reduce",
            tensor.nbytes,
            lambda a: dist.all_reduce(tensor, op=op, group=self.group, async_op=a),
            async_op,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op=dist.ReduceOp.SUM,
        async_op: bool = False,
    ):
        """`input` (n equal slices, flat or along dim 0) is reduced over the group; this rank
        keeps slice number `self.rank` in `output`."""
        if input.numel() != output.numel() * self.size:
            raise ValueError(
                f"reduce_scatter: input of {input.numel()} elements is not "
                f"{self.size} × output of {output.numel()}"
            )
        if self.size == 1:
            output.copy_(input.view_as(output))
        return self._run(
            "reduce_scatter",
            input.nbytes,
            lambda a: dist.reduce_scatter_single(
                output, input, op=op, group=self.group, async_op=a
            ),
            async_op,
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """`output` (n × `input`) receives every rank's `input`, in rank order."""
        if output.numel() != input.numel() * self.size:
            raise ValueError(
                f"all_gather: output of {output.numel()} elements is not "
                f"{self.size} × input of {input.numel()}"
            )
        if self.size == 1:
            output.copy_(input.view_as(output))
        return self._run(
            "all_gather",
            output.nbytes,
            lambda a: dist.all_gather_single(output, input, group=self.group, async_op=a),
            async_op,
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """In place: every rank's `tensor` becomes group-rank `src`'s."""
        return self._run(
            "broadcast",
            tensor.nbytes,
            lambda a: dist.broadcast(tensor, src=self.ranks[src], group=self.group, async_op=a),
            async_op,
        )

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False):
        """Hand `tensor` to group-rank `dst` (which must call `recv` with this rank as src)."""
        return self._run(
            "send",
            tensor.nbytes,
            lambda a: (dist.isend if a else dist.send)(
                tensor, dst=self.ranks[dst], group=self.group
            ),
            async_op,
            peer=dst,
        )

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        """Fill `tensor` with what group-rank `src` sends."""
        return self._run(
            "recv",
            tensor.nbytes,
            lambda a: (dist.irecv if a else dist.recv)(
                tensor, src=self.ranks[src], group=self.group
            ),
            async_op,
            peer=src,
        )

    def send_and_recv(self, ops: list[tuple[str, torch.Tensor, int]]) -> list[Pending]:
        """Post sends and receives together, `ops` = [("send" | "recv", tensor, group-rank peer)],
        as one batch (`dist.batch_isend_irecv`); returns a Pending per op. NCCL may hold a send
        until its receive is posted, and runs one rank's point-to-point calls in the order they
        were posted: two ranks that each send to the other before receiving would wait forever.
        Posted together, they cannot (NCCL starts the batch as one group)."""
        if self.size == 1 or not ops:
            return [Pending(None) for _ in ops]
        p2p = [
            dist.P2POp(
                dist.isend if kind == "send" else dist.irecv, t, self.ranks[peer], self.group
            )
            for kind, t, peer in ops
        ]
        parts = [Call(self, kind, t.nbytes, peer) for kind, t, peer in ops]
        batch = Call(self, "send_and_recv", parts=parts)
        start = time.perf_counter()
        with through_layers(batch, "launch"):
            works = dist.batch_isend_irecv(p2p)
            if len(works) == len(parts):  # gloo: a work per message
                for part, work in zip(parts, works, strict=True):
                    part.work = work
        launched = batch.elapsed(start)
        for part in parts:
            self.ledger.record(part.op, self.name, part.nbytes, self.size, launched / len(ops))
        if len(works) != len(ops):  # NCCL ran the batch as one work: each op waits for it
            return [Pending(Call(self, part.op, work=works[0]), 1 / len(ops)) for part in parts]
        return [Pending(part) for part in parts]

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        async_op: bool = False,
    ):
        """Rows `input_split_sizes[j]` of `input` (along dim 0, in order) go to group-rank j;
        `output` receives rank j's rows for this rank in slice j, sized `output_split_sizes[j]`.
        No sizes: n equal slices. Payload: `input`, what this rank sends."""
        if self.size == 1:
            output.copy_(input.view_as(output))
        return self._run(
            "all_to_all",
            input.nbytes,
            lambda a: dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=self.group, async_op=a
            ),
            async_op,
        )

    # -- helpers that move no payload worth counting --
    def barrier(self) -> None:
        if self.size > 1:
            with through_layers(Call(self, "barrier", bookkeeping="barrier"), "launch"):
                dist.barrier(group=self.group)

    def all_reduce_scalar(self, value: float, op=dist.ReduceOp.SUM) -> float:
        """Reduce one Python number across the group. Not recorded: it serves the kit's own
        bookkeeping (the loss shown on the progress bar), not the algorithm being taught."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.size > 1:
            call = Call(self, "all_reduce", t.nbytes, bookkeeping="all_reduce_scalar")
            with through_layers(call, "launch"):
                dist.all_reduce(t, op=op, group=self.group)
        return float(t.item())


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with autograd, along dim 0: `send_rows[j]` rows of `x` go to group-rank
    j and `recv_rows[j]` come from it (None: n equal parts); backward sends the gradient rows
    back, the same exchange reversed. Ulysses (cp.py) and expert dispatch (moe.py) use it."""

    @staticmethod
    def forward(ctx, x, comm, recv_rows: list[int] | None = None, send_rows=None):
        ctx.comm = comm
        ctx.rows = (recv_rows, send_rows)
        out = x.new_empty((sum(recv_rows) if recv_rows else x.shape[0], *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv_rows, send_rows)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_rows, send_rows = ctx.rows
        return AllToAll.apply(grad, ctx.comm, send_rows, recv_rows), None, None, None


DEFAULT_LEDGER = CommLedger()  # where collectives of groups given without a Mesh are counted


def communicator(group=None, name: str = "dp") -> Communicator:
    """The `Communicator` a building block runs its collectives on, from what its caller gave:
    an hplab Communicator (used as is, e.g. `mesh.dp`), a DeviceMesh of one dimension (e.g.
    `device_mesh["dp"]`: its group), a torch ProcessGroup, or None for the whole world. All
    but the first are recorded in `DEFAULT_LEDGER` under `name`."""
    if isinstance(group, Communicator):
        return group
    if isinstance(group, DeviceMesh):
        group = group.get_group()  # (a mesh of several dimensions says to name one)
    group = dist.group.WORLD if group is None else group
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return Communicator(group, name, DEFAULT_LEDGER, dist.get_process_group_ranks(group), device)
