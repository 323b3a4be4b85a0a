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

A group of one rank has nothing to exchange: calls on it return at once, uncounted. Every
collective is bounded by the group's timeout: a `CommTimeout` naming the operation, not a hang.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, astuple, dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from hplab.plan.formulas import bus_factor  # the factors above, in one home
from hplab.runtime import link

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


class Pending:
    """The handle of an asynchronous collective: call `wait()` before using its result.
    `share`: its part of a work it shares with others (a batch NCCL ran as one). `wire`: the
    bytes it puts on an emulated link (`hplab.runtime.link`), which `wait()` then waits out."""

    def __init__(self, work, comm: Communicator, op: str, share=1.0, wire=None, ticket=None):
        self.work, self.comm, self.op, self.share = work, comm, op, share
        on_gpu, transfer = comm.device.type == "cuda", ticket and wire is not None
        self.link = link.Transfer(work, wire, ticket, op, on_gpu) if transfer else None
        self.work = self.link.work if self.link else work

    def wait(self) -> None:
        if self.work is None:
            return
        start = time.perf_counter()
        self.comm._guard(self.op, self._wait_through, f"wait {self.op} {self.comm.name}")
        seconds = self.comm.work_seconds(self.work, time.perf_counter() - start)
        self.comm.ledger.add_time(self.op, self.comm.name, seconds * self.share)
        self.work = None

    def _wait_through(self) -> None:
        """Wait for the work, then for the link (one range in a timeline: the rank waits)."""
        self.work.wait()
        if self.link:
            self.link.wait()

    def is_completed(self) -> bool:
        done = self.work is None or self.work.is_completed()
        return done and (not self.link or self.link.is_through())


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
        self.group, self.name, self.ledger = group, name, ledger
        self.device = torch.device(device)
        self.ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        OPEN_COMMUNICATORS.add(self)

    def release(self) -> None:
        """Let go of the process group (at shutdown), so that it can be freed."""
        self.group = None

    def _guard(self, op: str, call, label: str = ""):
        """Run `call` inside a profiler range named `label` (a timeline shows it); a timeout or
        a lost peer becomes a CommTimeout naming the operation and the group."""
        with record_function(label or f"{op} {self.name}"), explained(op, self.name, self.ranks):
            return call()

    def _stamp(self, op: str, peer: int | None) -> tuple:
        """Note this launch on the emulated link's board: a collective's among the group, a
        message's between its sender and its receiver."""
        if peer is None:
            return link.QUEUE.board.stamp(f"{self.name}{self.ranks}", self.size, self.rank)
        src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
        channel = f"{self.name}{self.ranks}:{src}>{dst}"
        return link.QUEUE.board.stamp(channel, 2, int(op != "send"))

    def _run(self, op: str, nbytes: int, call, async_op: bool, peer: int | None = None):
        """Launch a collective and count it. On a GPU every call is launched asynchronously and
        a synchronous one waited for at once: its time is then the GPU's (`work_seconds`)."""
        if self.size == 1:
            return Pending(None, self, op) if async_op else None
        on_gpu, emulated = self.device.type == "cuda", link.QUEUE is not None
        start = time.perf_counter()
        label = f"{op} {self.name} {nbytes:,} B"  # its range in a timeline
        ticket = None

        def launch():  # the link's stamp inside the launch's range: in a trace, a transfer
            nonlocal ticket  # never starts before the launch it belongs to
            ticket = self._stamp(op, peer) if emulated else None
            return call(async_op or on_gpu or emulated)

        work = self._guard(op, launch, label)
        launched = 0.0 if on_gpu else time.perf_counter() - start  # GPU: counted at the wait
        self.ledger.record(op, self.name, nbytes, self.size, launched)
        wire = None if op == "send" else nbytes * bus_factor(op, self.size)  # (a recv waits)
        pending = Pending(work, self, op, wire=wire, ticket=ticket)
        if async_op:
            return pending
        if on_gpu or emulated:
            pending.wait()
        return None

    def work_seconds(self, work, waited_s: float) -> float:
        """The ledger's time of a finished call. On the CPU, how long the caller was blocked
        in it (gloo does the work then). On a GPU the host only queues work: the collective's
        own time on the device instead, which NCCL measures with CUDA events
        (TORCH_NCCL_ENABLE_TIMING, set by `dist.init_distributed`), else the wait's."""
        if self.device.type != "cuda":
            return waited_s
        try:
            return work._get_duration() / 1e3  # (milliseconds)
        except (RuntimeError, AttributeError):  # timing not enabled for this group
            return waited_s

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
            return [Pending(None, self, kind) for kind, _, _ in ops]
        p2p = [
            dist.P2POp(
                dist.isend if kind == "send" else dist.irecv, t, self.ranks[peer], self.group
            )
            for kind, t, peer in ops
        ]
        start = time.perf_counter()
        label = " + ".join(f"{kind} {self.name} {t.nbytes:,} B" for kind, t, _ in ops)
        tickets = [None] * len(ops)

        def launch():  # the link's stamps inside the launch's range, as in _run
            tickets[:] = [self._stamp(k, peer) if link.QUEUE else None for k, _, peer in ops]
            return dist.batch_isend_irecv(p2p)

        works = self._guard("send_and_recv", launch, label)
        launched = 0.0 if self.device.type == "cuda" else time.perf_counter() - start
        for kind, t, _ in ops:
            self.ledger.record(kind, self.name, t.nbytes, self.size, launched / len(ops))
        if len(works) != len(ops):  # NCCL ran the batch as one work: each op waits for it
            return [Pending(works[0], self, kind, 1 / len(ops)) for kind, _, _ in ops]
        return [
            Pending(work, self, kind, wire=t.nbytes if kind == "recv" else None, ticket=ticket)
            for work, (kind, t, _), ticket in zip(works, ops, tickets, strict=True)
        ]

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
            self._guard("barrier", lambda: dist.barrier(group=self.group))

    def all_reduce_scalar(self, value: float, op=dist.ReduceOp.SUM) -> float:
        """Reduce one Python number across the group. Not recorded: it serves the kit's own
        bookkeeping (the loss shown on the progress bar), not the algorithm being taught."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.size > 1:
            self._guard(
                "all_reduce",
                lambda: dist.all_reduce(t, op=op, group=self.group),
                f"all_reduce_scalar {self.name}",
            )
        return float(t.item())


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with autograd, along dim 0: `send_rows[j]` rows of `x` go to group-rank
    j and `recv_rows[j]` come from it (None: n equal parts); backward sends the gradient rows
    back, the same exchange reversed. Ulysses (cp.py) and expert dispatch (moe.py) use it."""

    @staticmethod
    def forward(ctx, x, comm, recv_rows: list[int] | None = None, send_rows=None):
        ctx.comm, ctx.rows = comm, (recv_rows, send_rows)
        out = x.new_empty((sum(recv_rows) if recv_rows else x.shape[0], *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv_rows, send_rows)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_rows, send_rows = ctx.rows
        return AllToAll.apply(grad, ctx.comm, send_rows, recv_rows), None, None, None


def copy_markers(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give `target` — a tensor standing for `source`, such as its shard or fp32 master — the
    markers other parts read on `source` (`tp_*`, `hplab_*`, `sequence_parallel_partial`)."""
    for name, value in vars(source).items():
        if name.startswith(("tp_", "hplab_", "sequence_parallel")):
            setattr(target, name, value)


def bucket_params(params: list[torch.Tensor], bucket_mb: float) -> list[list[torch.Tensor]]:
    """DDP's and ZeRO's messages: buckets of at most `bucket_mb` MiB (a larger parameter alone; 0:
    one each; `math.inf`: one), one dtype and device each, in reverse definition order (roughly
    the order backward produces gradients)."""
    buckets, size, kind = [], 0, None
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if size + nbytes > bucket_mb * 2**20 or (p.dtype, p.device) != kind:
            kind = (p.dtype, p.device)
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


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
