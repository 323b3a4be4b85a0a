"""The NCCL/CUDA path, correct by design and tested on the CPU (issue: real multi-GPU runs).

These machines have no GPU with a second one beside it, so each fix is tested on its logic:
the backend and device every rank chooses (under a patched GPU count), a model of NCCL's
point-to-point order against the pipeline's messages, a checking communicator on another
device (PyTorch's lazy tensors: a second device with real data, on the CPU) for offloaded
gradients, NCCL's own error texts for timeouts, scripted clocks for the device's time, a
synthetic GPU trace, and the device a run's MFU is measured on. `bench/gpu_check.py` runs the
real thing wherever one GPU is.
"""

from __future__ import annotations

import ast
import json
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from hplab.parallel import collectives, cp, schedule
from hplab.parallel.collectives import Call
from hplab.runtime import clock
from hplab.runtime.errors import CommTimeout, explained, explained_call
from hplab.runtime.group import RUN_LAYERS, choose_backend

ROOT = Path(__file__).resolve().parent.parent

# --- 1. one backend and device per job ----------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "local_rank", "local_world", "gpus", "existing", "backend", "device"),
    [
        (None, 0, 4, 0, None, "gloo", "cpu"),  # no GPU
        (None, 3, 4, 4, None, "nccl", "cuda:3"),  # a GPU each: the local rank's
        (None, 1, 2, 8, None, "nccl", "cuda:1"),  # more GPUs than processes
        (None, 0, 4, 2, None, "gloo", "cpu"),  # too few GPUs: the CPU for all, not a mix
        (None, 3, 4, 2, None, "gloo", "cpu"),
        ("gloo", 0, 2, 2, None, "gloo", "cpu"),  # --backend gloo on a GPU machine
        (None, 1, 2, 2, "gloo", "gloo", "cpu"),  # a gloo group already: its tensors on the CPU
        (None, 0, 1, 1, "nccl", "nccl", "cuda:0"),
    ],
)
def test_one_backend_and_device_per_job(
    asked, local_rank, local_world, gpus, existing, backend, device
):
    got = choose_backend(asked, local_rank, local_world, gpus, existing)
    assert (got[0], str(got[1])) == (backend, device)


def test_every_rank_of_a_machine_chooses_alike_and_says_why_once():
    """Four processes, two GPUs: the old choice gave ranks 0-1 NCCL and ranks 2-3 gloo (a hang
    at the first collective); now all run gloo, and the note says why."""
    choices = [choose_backend(None, r, 4, 2, None) for r in range(4)]
    assert {backend for backend, _, _ in choices} == {"gloo"}
    assert "4 processes on this machine but 2 GPU(s)" in choices[0][2]
    assert choose_backend(None, 0, 4, 0, None)[2] is None  # no GPU: nothing to explain
    with pytest.raises(RuntimeError, match="NCCL needs a GPU per process"):
        choose_backend("nccl", 0, 4, 2, None)


def test_nccl_waits_block_and_time_the_device(monkeypatch):
    """On NCCL, init_distributed asks for blocking waits (a frozen peer: a timeout, one line)
    and NCCL's own timing of each collective (the ledger's time)."""
    import torch.distributed as dist

    from hplab.runtime import group as hdist

    calls, environ = [], {"LOCAL_WORLD_SIZE": "1"}  # (this process's own is left alone)
    monkeypatch.setattr(hdist.os, "environ", environ)
    monkeypatch.setattr(hdist, "DEVICE", hdist.DEVICE)  # (put back after the test)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: calls.append(backend))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert str(hdist.init_distributed()) == "cuda:0" and calls == ["nccl"]
    assert environ["TORCH_NCCL_BLOCKING_WAIT"] == environ["TORCH_NCCL_ENABLE_TIMING"] == "1"


def test_preflight_counts_the_processes_of_this_machine(monkeypatch):
    """--backend nccl on one of several machines: this machine's LOCAL_WORLD_SIZE is compared
    with its GPUs, not the job's world size; the memory estimate is per GPU."""
    from hplab import preflight
    from hplab.cli import parse_args

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=8e10)
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = parse_args(["--backend", "nccl", "--dp", "8"])
    run = preflight.model_of(args)[1]
    layout = preflight.layout_of(args)
    preflight.check_machine(args, run, layout, world_size=8)  # 2 GPUs for 2 local processes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="4 processes on this machine, 2 GPU"):
        preflight.check_machine(args, run, layout, world_size=8)


# --- 2. point-to-point in NCCL's order --------------------------------------------------------


def nccl_waits(plans: list[list[schedule.Action]], one_way: bool) -> list[str]:
    """A model of NCCL's point-to-point calls, run on every rank's action list. A host posts its
    actions in order and stops at a computation whose received input has not arrived (a
    blocking wait); sends never stop it. A communicator runs one rank's calls one after the
    other, in the order they were posted, and a send and a receive meet when each is the next
    of its rank on that communicator. `one_way`: one communicator per direction between two
    ranks (pp.message_links); else one per pair. Returns where each rank waits for ever."""
    p = len(plans)
    v = 1 + max(a.chunk for plan in plans for a in plan) // p
    queues: dict[tuple, list] = {}  # (rank, communicator) -> its calls not yet met, in order
    sent, pos, arrived = Counter(), [0] * p, set()

    def channel(a, r):
        pair = (r, a.peer) if a.kind.startswith("send") else (a.peer, r)
        return pair if one_way else tuple(sorted(pair))

    while True:
        moved = False
        for r in range(p):  # hosts post until a computation waits for a message
            while pos[r] < len(plans[r]):
                a = plans[r][pos[r]]
                need = schedule.input_message(a, p * v) if a.kind in schedule.COMPUTE else None
                if need is not None and need not in arrived:
                    break
                if a.kind not in schedule.COMPUTE:
                    ch = channel(a, r)
                    key = (*ch, a.kind[:4], sent[r, ch, a.kind[:4]])  # the k-th on the channel
                    sent[r, ch, a.kind[:4]] += 1
                    queues.setdefault((r, ch), []).append((key, a))
                pos[r], moved = pos[r] + 1, True
        for (r, ch), calls in queues.items():  # a call meets its partner at both heads
            partner = ch[1] if r == ch[0] else ch[0]
            other = queues.get((partner, ch), [])
            if calls and other:
                (k1, a), (k2, _) = calls[0], other[0]
                if k1[2] != k2[2] and k1[3] == k2[3] and k1[:2] == k2[:2]:
                    for q in (calls, other):
                        key, action = q.pop(0)
                        if action.kind.startswith("recv"):
                            arrived.add(schedule.message_key(action))
                    moved = True
        if not moved:
            stuck = [r for r in range(p) if pos[r] < len(plans[r])]
            stuck += [r for (r, _), calls in queues.items() if calls]
            return [f"rank {r} at {plans[r][pos[r]] if pos[r] < len(plans[r]) else 'end'}"
                    for r in sorted(set(stuck))]  # fmt: skip


SCHEDULES = [
    (name, p, m, v)
    for p in (2, 3, 4)
    for m in (1, 2, p, 2 * p, 2 * p + 1)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3))
    if name != "interleaved" or m % p == 0
]


def test_one_communicator_for_both_directions_deadlocks_on_nccl():
    """What the model shows of the old design: 1F1B on two ranks sends an activation down and a
    gradient up at once; on one communicator each send queues behind the other's receive."""
    assert nccl_waits(schedule.build_schedule("1f1b", 2, 4), one_way=False)
    assert nccl_waits(schedule.build_schedule("interleaved", 2, 4, 2), one_way=False)


@pytest.mark.parametrize(("name", "p", "m", "v"), SCHEDULES)
def test_one_communicator_each_way_never_deadlocks_on_nccl(name, p, m, v):
    assert nccl_waits(schedule.build_schedule(name, p, m, v), one_way=True) == []


class Recording:
    """A communicator stand-in that records what is posted, and how (one rank of two)."""

    def __init__(self, rank=0, size=2, device="cpu"):
        self.rank, self.size, self.device, self.calls = rank, size, torch.device(device), []

    def send_and_recv(self, ops):
        self.calls.append(("together", [(kind, peer) for kind, _, peer in ops]))
        return [types.SimpleNamespace(wait=lambda: None) for _ in ops]

    def send(self, *args, **kwargs):
        self.calls.append(("send alone",))

    def recv(self, *args, **kwargs):
        self.calls.append(("recv alone",))

    def all_reduce(self, tensor):
        assert tensor.device == self.device, f"a {tensor.device} tensor on a {self.device} group"
        self.calls.append(("all_reduce", tensor.device.type))
        tensor.mul_(2)  # (two ranks holding the same numbers)


def test_the_ring_posts_each_hop_together():
    """Ring attention: every rank sends while it receives, so both go together."""
    comm = Recording(rank=1, size=4)
    cp._pass_on(torch.ones(3), comm)
    assert comm.calls == [("together", [("send", 2), ("recv", 0)])]


def test_the_pipeline_keeps_one_communicator_each_way():
    """pp.message_links names a communicator for each direction a schedule's messages travel,
    and the executor sends on (me, peer) and receives on (peer, me)."""
    from hplab.parallel import pp

    mesh = types.SimpleNamespace(groups={"pp": [[0, 1]]}, rank=0, ledger=None, device="cpu")
    created = []
    pp_new_group, pp_communicator = pp.new_group, pp.Communicator
    try:
        pp.new_group = lambda ranks: created.append(ranks) or f"group {len(created)}"
        pp.Communicator = lambda group, name, ledger, ranks, device: (group, tuple(ranks))
        links = pp.message_links(mesh, schedule.build_schedule("1f1b", 2, 4))
    finally:
        pp.new_group, pp.Communicator = pp_new_group, pp_communicator
    assert links == {(0, 1): ("group 1", (0, 1)), (1, 0): ("group 2", (1, 0))}


# --- 3. a timeout or a lost peer on NCCL: hplab's one line ------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
         "OpType=ALLREDUCE) ran for 120012 milliseconds before timing out.", "timed out"),
        ("NCCL error in: ProcessGroupNCCL.cpp:1935, remote process exited or there was a "
         "network error, NCCL version 2.21.5", "lost its connection"),
        ("NCCL communicator was aborted on rank 0.", "lost its connection"),
        ("Connection closed by peer [127.0.0.1]:29500", "lost its connection"),  # gloo
        ("Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] "
         "no error", "lost its connection"),  # gloo, while the group forms
    ],
)  # fmt: skip
def test_nccl_errors_become_one_line(text, says, monkeypatch):
    """A Communicator's call, through the layers a run puts around it."""
    comm = types.SimpleNamespace(name="dp", ranks=[0, 1], device=torch.device("cpu"))
    monkeypatch.setattr(collectives, "LAYERS", RUN_LAYERS)

    def fail():
        raise RuntimeError(text)

    with pytest.raises(CommTimeout, match=f"^all_reduce in the dp group .ranks .0, 1.. {says}"):
        with collectives.through_layers(Call(comm, "all_reduce"), "launch"):
            fail()


def test_a_raw_collective_outside_a_communicator_is_explained_too():
    """Every torch.distributed collective the library calls itself, outside collectives.py's
    Communicator (a checkpoint's gather, the metrics' gather), and the group's forming, sit
    inside `explained`: a rank that loses its peer there says one line, not gloo's C++ file and
    line. The Communicator's own calls are explained by the outermost of a run's layers."""
    assert RUN_LAYERS[0] is explained_call
    text = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    with pytest.raises(CommTimeout, match="^the checkpoint's gather in the world group lost its"):
        with explained("the checkpoint's gather"):
            raise RuntimeError(text)
    raw_calls = {
        f"dist.{name}"
        for name in (
            "barrier",
            "gather_object",
            "all_gather_object",
            "broadcast_object_list",
            "all_reduce",
            "broadcast",
            "all_gather",
            "reduce_scatter",
            "send",
            "recv",
            "init_process_group",
        )
    }
    raw = []
    for path in sorted((ROOT / "hplab").rglob("*.py")):
        if path.name == "collectives.py" or "course" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        inside = {
            id(n)
            for w in ast.walk(tree)
            if isinstance(w, ast.With)
            and any("explained" in ast.unparse(i.context_expr) for i in w.items)
            for n in ast.walk(w)
        }
        raw += [
            f"{path.name}:{n.lineno}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and ast.unparse(n.func) in raw_calls and id(n) not in inside
        ]
    assert raw == []


# --- 4. clocks of the device's work ------------------------------------------------------------


class Scripted:
    """A clock whose marks are 0, 1, 2, ... and whose seconds are milliseconds of marks."""

    def __init__(self):
        self.ticks = 0

    def mark(self):
        self.ticks += 1
        return self.ticks

    def seconds(self, start, end):
        return (end - start) / 1000


def test_the_ledger_times_nccl_collectives_on_the_gpu():
    """On a GPU the host only queues a collective: the ledger takes NCCL's own time of it (CUDA
    events); on the CPU, the time the caller was blocked."""
    work = types.SimpleNamespace(_get_duration=lambda: 2.5)  # milliseconds

    def ledger_seconds(device: str, waited_s: float) -> float:
        """The ledger's time of a wait that blocked the host `waited_s`, on `device`."""
        comm = types.SimpleNamespace(device=torch.device(device))
        call = Call(comm, "all_reduce", work=work, stage="wait")
        with clock.on_the_device(call):
            pass
        return waited_s if call.seconds is None else call.seconds

    assert ledger_seconds("cuda", waited_s=9.0) == pytest.approx(0.0025)
    assert ledger_seconds("cpu", waited_s=9.0) == 9.0


def test_the_pipeline_trace_reads_the_devices_clock():
    from hplab.observe.observers import PipelineTrace

    executor = types.SimpleNamespace(observers=[], comm=types.SimpleNamespace(device="cpu"))
    trace = PipelineTrace(executor, clock=Scripted())
    action = schedule.Action("F", 0, 0)
    with trace._action("run", None, None):  # marks 1 ... 6
        for kind in ("recv", "F"):
            with trace._action(kind, action, None):
                pass
    assert [(e["kind"], e["start_s"], e["end_s"]) for e in trace.trace()] == [
        ("recv", 0.001, 0.002), ("F", 0.003, 0.004)
    ]  # fmt: skip


def test_the_peak_is_measured_on_the_runs_own_device():
    from hplab.course import lab

    assert lab.measure_peak_flops(n=4, repeats=2, clock=Scripted()) == 2 * 4**3 / 0.001
    run = lab.Run({"device": "cuda", "config": {"precision": "bf16"}})
    if not torch.cuda.is_available():
        with pytest.raises(lab.LaunchError, match="trained on a GPU"):
            lab.peak_of(run)


# --- 5. GPU traces: NCCL's kernels are the collectives, the others the computation -------------


def test_a_gpu_trace_is_read_with_its_kernels(tmp_path):
    from hplab.course.timeline import hidden_fraction, read_timeline, waits

    def event(name, ts, dur, cat):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}

    events = [
        event("step 1", 0, 1000, "user_annotation"),
        event("all_reduce dp 4,096 B", 90, 2, "user_annotation"),
        event("ampere_sgemm_128x64_tn", 80, 40, "kernel"),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100, 50, "kernel"),
    ]
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    (spans,) = read_timeline(tmp_path)
    comm = [s for s in spans if s["kind"] == "comm"]
    assert [s["name"] for s in comm] == ["all_reduce dp 4,096 B #1"]
    assert hidden_fraction(spans) == pytest.approx(20 / 50)  # the sgemm ran 100 µs → 120 µs
    with pytest.raises(ValueError, match="GPU trace"):
        waits(tmp_path)
