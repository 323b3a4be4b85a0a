"""The emulated link (hplab/runtime/link.py, --link, HPLAB_LINK): every collective takes α + (bus
bytes)/β and every message α + payload/β of wall time after the real transfer, counted from
the last rank's launch; a rank's transfers queue on its link; the wait sleeps. Results are bit
for bit those without a link, for every kind of traffic (all-reduce buckets, pipeline
messages, ring attention's hops, ZeRO-3's gathers). One 2-process launch measures it all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hplab.runtime import link
from hplab.runtime.launch import run_distributed

REPO = Path(__file__).resolve().parent.parent
SLOW = link.Link(bandwidth=2.5e6, latency=5e-3)  # 400 kB: 165 ms (loopback: ~1 ms)
COST_RTOL = 0.10  # the issue's "within 10% on a quiet machine"
NUMEL = 100_000  # fp32: 400 kB
CONFIG = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=4, n_head=4)
LAYOUTS = {  # every kind of traffic: buckets, pipeline messages, ring hops, ZeRO-3 gathers
    "dp2 buckets": dict(dp=2, bucket_mb=0.01),
    "pp2 1f1b": dict(pp=2, microbatches=2),
    "cp2 ring": dict(cp=2),
    "dp2 zero3": dict(dp=2, zero=3),
}


# -- parsing -----------------------------------------------------------------------------
def test_parse_reads_units():
    assert link.parse("20MB/s,200us") == link.Link(20e6, 200e-6)
    assert link.parse("1GiB/s") == link.Link(2**30, 0.0)
    assert link.parse("500kB/s, 1.5ms") == link.Link(500e3, 1.5e-3)
    assert link.parse(str(link.parse("3.5MB/s,70us"))) == link.parse("3.5MB/s,70us")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fast", "e.g. --link 20MB/s,200us"),
        ("20MB", "e.g. --link 20MB/s,200us"),
        ("0MB/s", "a bandwidth of 0MB/s is outside what a link carries; give one from 1kB/s"),
        ("nanMB/s", "e.g. --link"),
        ("1e400MB/s", "a bandwidth of 1e400MB/s is outside what a link carries"),
        ("1e-320B/s", "a bandwidth of 1e-320B/s is outside what a link carries"),
        ("20MB/s,-3us", "a latency of -3us is outside what a link takes; give one from 0 to 1s"),
        ("20MB/s,1e9s", "a latency of 1e9s is outside what a link takes"),
        ("20MB/s,1e300s", "a latency of 1e300s is outside what a link takes"),
        ("20MB/s,1 hour", "e.g. --link"),
    ],
)
def test_parse_refuses_in_one_line(text, says):
    with pytest.raises(link.LinkError, match=says) as caught:
        link.parse(text)
    assert "\n" not in str(caught.value)


def test_queue_takes_transfers_one_after_the_other():
    queue = link.Queue(link.Link(1e6, 1e-3), job="test")  # 1 MB/s, 1 ms
    queue.log = []
    assert queue.transfer(10.0, 1000, "a") == pytest.approx(10.002)  # α + 1 kB/β
    assert queue.transfer(10.0, 1000, "b") == pytest.approx(10.004)  # behind the first
    assert queue.transfer(20.0, 0, "c") == pytest.approx(20.001)  # idle: from its ready time
    assert [(w, round(s, 6), round(e, 6)) for w, s, e in queue.log] == [
        ("a", 10.0, 10.002),
        ("b", 10.002, 10.004),
        ("c", 20.0, 20.001),
    ]


class _Work:
    """A stand-in for a gloo work: done when the test says so."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


def test_a_groups_transfers_take_the_link_in_launch_order(monkeypatch):
    """gloo may finish a later collective first (a reduce-scatter runs as a slower all-reduce):
    the link still takes the group's transfers in the order they were launched, as a
    communication stream would, each from its last launch (the later one done means every rank
    launched the earlier ones too); another group's transfer waits only for the link."""
    import numpy as np

    queue = link.Queue(link.Link(1e6, 1e-3), job="test")
    monkeypatch.setattr(link, "QUEUE", queue)
    group, other = np.full((2, 4), 10.0), np.full((2, 4), 10.0)  # every launch at t = 10 s
    group[:, 1] = 10.0005
    works = [_Work() for _ in range(3)]
    first = link.Transfer(works[0], 1000, (group, 0), "first")
    second = link.Transfer(works[1], 1000, (group, 1), "second")
    elsewhere = link.Transfer(works[2], 1000, (other, 0), "elsewhere")
    works[2].future.set_result(None)  # another group's: on the link at once
    assert elsewhere.through_at == pytest.approx(10.002)
    assert not first.on_the_link.is_set()  # not done for real yet: not on the link
    works[1].future.set_result(None)  # gloo finished the second one first
    assert first.on_the_link.is_set() and second.on_the_link.is_set()
    assert first.through_at == pytest.approx(10.004)  # behind `elsewhere` on this rank's link
    assert second.through_at == pytest.approx(10.006)  # then the second, after the first
    works[0].future.set_result(None)  # its late callback changes nothing
    assert first.through_at == pytest.approx(10.004) and queue.free_at == pytest.approx(10.006)


def test_a_transfer_longer_than_the_collective_timeout_is_a_comm_timeout(monkeypatch):
    """Every wait is bounded, the link's too: 10 MB on a 1 kB/s link (10,000 s) under a 2 s
    collective timeout fails at once, in one line, instead of sleeping for hours."""
    from datetime import timedelta

    import numpy as np

    from hplab.runtime import group
    from hplab.runtime.errors import CommTimeout

    monkeypatch.setattr(group, "TIMEOUT", timedelta(seconds=2))
    monkeypatch.setattr(link, "QUEUE", link.Queue(link.Link(1e3, 0.0), job="test"))
    work = _Work()
    launched = np.full((2, 4), time.perf_counter())
    transfer = link.Transfer(work, 10e6, (launched, 0), "all_reduce dp 10,000,000 B")
    work.future.set_result(None)
    start = time.perf_counter()
    with pytest.raises(CommTimeout) as caught:
        transfer.wait()
    assert time.perf_counter() - start < 1
    assert str(caught.value).startswith("all_reduce dp 10,000,000 B would take 1e+04 s more")
    assert "longer than a collective may wait (2 s, HPLAB_TIMEOUT_S)" in str(caught.value)


def test_a_runs_link_files_are_removed_at_shutdown(monkeypatch):
    """Each channel's launch board is a file in /dev/shm; a forked rank ends without atexit,
    and every --link run left them there: `shutdown` removes them."""
    queue = link.Queue(link.Link(1e6, 0.0), job=f"test-{os.getpid()}")
    monkeypatch.setattr(link, "QUEUE", queue)
    queue.board.stamp("dp[0, 1]", 2, 0)
    path = queue.board.path("dp[0, 1]", 2)
    assert path.exists()
    link.release()
    assert not path.exists()


# -- measured on two processes -------------------------------------------------------------
def _timed(call, repeats: int = 5) -> float:
    """The seconds of `call()`, the two ranks starting it together: the fastest of `repeats`,
    the call the machine's other work disturbed least (the issue's "on a quiet machine"; the
    link's charge is a floor no call goes under, checked below)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def _costs(mesh) -> dict:
    """Per operation, the measured seconds of one blocking call under SLOW, and the threads
    a call started with no link (none: free when off)."""
    comm = mesh.world
    x = torch.ones(NUMEL)
    threads_before = threading.active_count()
    link.use(None)
    comm.all_reduce(x.clone())
    pending = comm.all_reduce(x.clone(), async_op=True)
    on_the_link = isinstance(pending.call.work, link.OnTheLink)
    off = {"threads": threading.active_count() - threads_before, "on_the_link": on_the_link}
    pending.wait()
    link.use(SLOW)
    out = {
        "all_reduce": _timed(lambda: comm.all_reduce(x.clone())),
        "all_gather": _timed(lambda: comm.all_gather(torch.empty(NUMEL), x[: NUMEL // 2])),
        "reduce_scatter": _timed(lambda: comm.reduce_scatter(torch.empty(NUMEL // 2), x)),
        "broadcast": _timed(lambda: comm.broadcast(x.clone(), src=0)),
        "off": off,
    }

    def message():
        if mesh.rank == 0:
            comm.send(x, 1)
        else:
            comm.recv(torch.empty(NUMEL), 0)

    out["recv"] = _timed(message)
    return out


def _queueing(mesh) -> dict:
    """Three all-reduces launched at once, waited together; one launched while the rank
    computes (sleeps) longer than the link takes; one that rank 1 launches 50 ms late."""
    import torch.distributed as dist

    comm, x = mesh.world, torch.ones(NUMEL)
    dist.barrier()
    start = time.perf_counter()
    for pending in [comm.all_reduce(x.clone(), async_op=True) for _ in range(3)]:
        pending.wait()
    three = time.perf_counter() - start
    dist.barrier()
    pending = comm.all_reduce(x.clone(), async_op=True)
    time.sleep(0.3)  # computing beside it: the link moves the bytes meanwhile
    start = time.perf_counter()
    pending.wait()
    after_compute = time.perf_counter() - start
    dist.barrier()
    if mesh.rank == 1:
        time.sleep(0.05)
    launched = time.time()  # the wall clock: one machine, one clock for both ranks
    comm.all_reduce(x.clone())
    done = time.time()
    last = torch.tensor([launched], dtype=torch.float64)
    dist.all_reduce(last, op=dist.ReduceOp.MAX)  # (torch's own: no link in between)
    late = {"after_the_last_launch": done - float(last), "after_my_launch": done - launched}
    return {"three": three, "after_compute": after_compute, "late": late}


def _train(mesh, layout: dict, with_link) -> tuple[list, dict]:
    from hplab.config import Layout
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel.compose import parallelize
    from hplab.training import TrainState, build_lr_scheduler, build_optimizer, train_step

    link.use(with_link)
    c = Layout(**layout)
    model = parallelize(build_model(GPTConfig(**CONFIG), 0), mesh, c)
    optimizer = build_optimizer(model, mesh, c)
    engine = TrainState(model, optimizer, build_lr_scheduler(optimizer), mesh, c)
    losses = []
    for step in range(2):
        tokens = torch.randint(
            0, CONFIG["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(step)
        )
        share = 4 // mesh.dp_size
        mine = tokens[mesh.dp_rank * share : (mesh.dp_rank + 1) * share]
        losses.append(train_step(engine, mine[:, :-1], mine[:, 1:]))
    link.use(None)
    state = {n: p.detach().clone() for n, p in engine.decoder.named_parameters()}
    return losses, state


def _same_training(layouts: dict) -> dict:
    from hplab.parallel.mesh import Mesh

    out = {}
    for name, layout in layouts.items():
        sizes = {k: layout.get(k, 1) for k in ("dp", "pp", "cp")}
        mesh = Mesh(pp=sizes["pp"], dp=sizes["dp"], cp=sizes["cp"])
        plain = _train(mesh, layout, None)
        emulated = _train(mesh, layout, link.Link(50e6, 100e-6))
        same = plain[0] == emulated[0] and all(
            torch.equal(plain[1][n], emulated[1][n]) for n in plain[1]
        )
        out[name] = {"same": same, "losses": [plain[0], emulated[0]]}
    return out


def _bare(mesh) -> dict:
    """The collectives with no layer at all, as a Communicator in a plain script runs them."""
    from hplab.parallel import collectives

    comm = mesh.world
    peer = 1 - mesh.rank
    layers = collectives.LAYERS[:]
    collectives.LAYERS[:] = []
    try:
        summed = torch.full((3,), mesh.rank + 1.0)
        comm.all_reduce(summed)
        waited = torch.ones(2)
        comm.all_reduce(waited, async_op=True).wait()
        got = torch.empty(2)
        mine = torch.full((2,), float(mesh.rank))
        for message in comm.send_and_recv([("send", mine, peer), ("recv", got, peer)]):
            message.wait()
    finally:
        collectives.LAYERS[:] = layers
    return {"sum": summed.tolist(), "async": waited.tolist(), "got": got.tolist()}


def _worker() -> dict:
    from hplab.parallel.mesh import Mesh

    mesh = Mesh(dp=2)
    return {
        "bare": _bare(mesh),
        "costs": _costs(mesh),
        "queueing": _queueing(mesh),
        "training": _same_training(LAYOUTS),
    }


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_worker, 2, timeout_s=240)


def expected(op: str) -> float:
    from hplab.plan.formulas import bus_factor

    return SLOW.cost(NUMEL * 4 * bus_factor(op, 2) if op != "recv" else NUMEL * 4)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_a_collective_takes_alpha_plus_bus_bytes_over_beta(measured, op):
    for rank, result in enumerate(measured):
        seconds = result["costs"][op]
        assert seconds == pytest.approx(expected(op), rel=COST_RTOL), (
            f"rank {rank}: {op} of {NUMEL * 4:,} B took {seconds * 1e3:.2f} ms, the link "
            f"{SLOW} says {expected(op) * 1e3:.2f} ms"
        )


def test_a_message_takes_alpha_plus_payload_over_beta_at_the_receiver(measured):
    assert measured[1]["costs"]["recv"] == pytest.approx(expected("recv"), rel=COST_RTOL)


def test_no_link_is_free(measured):
    for result in measured:
        assert result["costs"]["off"] == {"threads": 0, "on_the_link": False}


def test_a_communicator_without_layers_runs_the_same_collectives(measured):
    for rank, result in enumerate(measured):
        peer = 1.0 - rank
        assert result["bare"] == {"sum": [3.0] * 3, "async": [2.0] * 2, "got": [peer] * 2}


def test_transfers_queue_and_run_beside_compute(measured):
    one = expected("all_reduce")
    for rank, result in enumerate(measured):
        q = result["queueing"]
        assert q["three"] == pytest.approx(3 * one, rel=COST_RTOL), f"rank {rank}: {q}"
        assert q["after_compute"] < 0.2 * one, f"rank {rank}: the link ran beside compute"
    # counted from the last rank's launch (timed on the shared clock, not assumed from the 50 ms
    # sleep, which a loaded machine stretches): each rank then waits the link's time; rank 0,
    # which launched first, waits for rank 1 too
    for rank in (0, 1):
        late = measured[rank]["queueing"]["late"]
        assert late["after_the_last_launch"] == pytest.approx(one, rel=COST_RTOL), late
    late = measured[0]["queueing"]["late"]
    assert late["after_my_launch"] > late["after_the_last_launch"] + 0.03, late


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_results_are_bit_identical_with_a_link(measured, name):
    for result in measured:
        got = result["training"][name]
        assert got["same"], f"{name}: losses without / with a link: {got['losses']}"


# -- the command line ------------------------------------------------------------------------
def train_cli(tmp_path, *flags, env=None):
    import os

    return subprocess.run(
        [sys.executable, str(REPO / "hplab" / "train.py"), "--nproc", "2", "--steps", "2"]
        + ["--no-progress", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", *flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        timeout=180,
    )


def test_train_records_the_link(tmp_path):
    from hplab.course.timeline import read_timeline

    flags = ("--metrics", "m.json", "--trace", "tr", "--steps", "3", "--bucket-mb", "0.02")
    done = train_cli(tmp_path, *flags, env={"HPLAB_LINK": "20MB/s,200us"})
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "m.json").read_text())["config"]["link"] == "20MB/s,200us"
    # the trace shows the link's transfers as the collectives, each after its launch
    for spans in read_timeline(tmp_path / "tr"):
        comm = [s for s in spans if s["kind"] == "comm"]
        assert comm and all(s["name"].startswith("all_reduce dp") for s in comm), comm
        assert all(s["launched_s"] <= s["start_s"] + 1e-3 for s in comm)
        assert min(s["end_s"] - s["start_s"] for s in comm) >= 200e-6 * 0.9  # α at least


def test_a_bad_link_is_one_line_before_any_process(capsys, monkeypatch):
    from hplab.train import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "HPLAB_LINK"):
        monkeypatch.delenv(key, raising=False)
    assert main(["--nproc", "2", "--steps", "2", "--link", "20 miles"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hplab: error: --link '20 miles': give a bandwidth and, after a comma, a latency, "
        "e.g. --link 20MB/s,200us"
    ]
    monkeypatch.setenv("HPLAB_LINK", "0MB/s")
    assert main(["--nproc", "2", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "HPLAB_LINK" in err and "outside what a link carries" in err, err
    assert err.count("\n") == 1, err
    # a bad HPLAB_LINK beside a good --link: every rank reads it as it starts; it is to blame
    assert main(["--nproc", "2", "--steps", "2", "--link", "20MB/s"]) == 2
    err = capsys.readouterr().err
    assert "HPLAB_LINK '0MB/s'" in err and "--link '" not in err and err.count("\n") == 1, err


def test_a_job_across_machines_refuses_the_link(monkeypatch):
    from hplab.cli import parse_args
    from hplab.preflight import preflight

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 processes, 2 on this machine
    with pytest.raises(ValueError, match="one machine"):
        preflight(parse_args(["--dp", "4", "--link", "1GB/s"]), 4)


def test_on_a_gpu_the_link_takes_a_transfer_at_its_wait():
    """NCCL's future completes when the work is queued, before the other ranks need have
    launched: on a GPU the link reads the board at the wait (which blocks until done)."""

    class QueuedOnTheGpu:
        def get_future(self):
            done = torch.futures.Future()
            done.set_result(None)
            return done

    link.use(link.Link(1e6, 0.0))  # 1 kB: 1 ms
    try:
        ticket = link.QUEUE.board.stamp("gpu-test", 2, 0)
        transfer = link.Transfer(QueuedOnTheGpu(), 1000, ticket, "all_reduce", on_gpu=True)
        assert not transfer.on_the_link.is_set()
        table, slot = ticket
        table[1, slot] = time.perf_counter() + 0.05  # the other rank launches 50 ms later
        start = time.perf_counter()
        transfer.wait()
        assert time.perf_counter() - start == pytest.approx(0.051, abs=0.01)
    finally:
        link.use(None)
