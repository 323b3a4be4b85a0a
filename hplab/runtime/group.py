"""Start-up: joining the process group, and this rank's device.

Every "device" in hplab is one operating-system process. `torchrun` starts N of them and tells
each, through environment variables, its global `RANK`, the `WORLD_SIZE` and its `LOCAL_RANK`
on this machine. Each process then joins one process group over a backend:

* **NCCL** when every local rank has its own GPU — the real thing;
* **gloo** on CPU otherwise — the same collectives, over TCP on this machine.

How the N ranks are arranged in a grid, and which groups they form, is the mesh's
(`hplab.parallel.mesh`)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import math
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hplab.observe import ranges
from hplab.parallel import collectives
from hplab.parallel.collectives import OPEN_COMMUNICATORS
from hplab.runtime import balance, clock, link
from hplab.runtime.errors import explained, explained_call


def _timeout_from_env() -> tuple[float, str | None]:
    """HPLAB_TIMEOUT_S, the seconds a collective may wait (default 120), and what is wrong
    with it if it is not a number of seconds above 0 (said by init_distributed and train.py's
    checks, in one line; until then the default stands)."""
    text = os.environ.get("HPLAB_TIMEOUT_S", "").strip() or "120"
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if 0 < seconds <= 86400:  # (NaN, inf, 0 and negatives are not)
        return seconds, None
    return 120.0, (
        f"HPLAB_TIMEOUT_S={text}: give the seconds a collective may wait for its peers, a "
        "number above 0 and at most 86400 (e.g. 120)"
    )


DEFAULT_TIMEOUT_S, TIMEOUT_PROBLEM = _timeout_from_env()
TIMEOUT = timedelta(seconds=DEFAULT_TIMEOUT_S)  # of every group: set by init_distributed
DEVICE = torch.device("cpu")  # this rank's device: set by init_distributed


# --- start-up ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for worker `rank` of `world_size` on this machine."""
    return dict(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def choose_backend(
    asked: str | None, local_rank: int, local_world_size: int, gpus: int, existing: str | None
) -> tuple[str, torch.device, str | None]:
    """(backend, device, note): one backend and one kind of device for the whole job, decided
    alike on every rank from what it sees of its own machine. NCCL when each of the machine's
    `local_world_size` ranks has its own GPU (device: the GPU numbered like the local rank);
    otherwise gloo on the CPU, with a note saying why when there are GPUs, just too few. A group
    that exists already keeps its backend; `asked` ("gloo" or "nccl") overrides the choice."""
    backend = existing or asked or ("nccl" if 0 < local_world_size <= gpus else "gloo")
    if backend == "nccl" and gpus < local_world_size:
        raise RuntimeError(
            f"NCCL needs a GPU per process on each machine: {local_world_size} processes here, "
            f"{gpus} GPU(s): use --backend gloo"
        )
    note = None
    if backend == "gloo" and not (existing or asked) and gpus:
        note = (
            f"{local_world_size} processes on this machine but {gpus} GPU(s): every rank runs "
            "on the CPU with gloo (NCCL needs one GPU per process)"
        )
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return backend, device, note


#: What a run wraps around every collective, outermost first: a timeout or a lost peer said in
#: one line (around everything inside, the link's waits too); the call's range in a profiler's
#: timeline (the link's stamp inside it); the emulated wire; the GPU's own clock.
RUN_LAYERS = [explained_call, ranges.labelled, link.emulated, clock.on_the_device]


def use_env_link() -> None:
    """HPLAB_LINK's network for every rank, or none. A machine's balance is measured on the
    model, which a plain loop measures itself (`hplab.runtime.balance.at_balance`)."""
    text = os.environ.get("HPLAB_LINK") or None
    if balance.parse_machine(text, "HPLAB_LINK"):
        raise link.LinkError(
            f"HPLAB_LINK={text!r} names a machine, whose balance is measured on the model: "
            "hplab/train.py measures it; in a loop of your own call "
            "hplab.runtime.balance.at_balance after init_distributed"
        )
    link.use(text, "HPLAB_LINK")


def init_distributed(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, env_link: bool = True
):
    """Join the process group described by torchrun's environment; return this rank's device
    (`choose_backend`). Without torchrun it forms a group of one. On NCCL, a `wait()` blocks
    until the work is done or the group's timeout has passed (TORCH_NCCL_BLOCKING_WAIT), so a
    frozen or lost peer ends the job with one line, as on gloo, and NCCL records each
    collective's own time on the GPU (TORCH_NCCL_ENABLE_TIMING) for the ledger. Every
    Communicator's calls then go through `RUN_LAYERS`, on HPLAB_LINK's network if `env_link`
    (train.py gives its own, --link's)."""
    existing = dist.get_backend() if dist.is_initialized() else None
    if TIMEOUT_PROBLEM:
        raise ValueError(TIMEOUT_PROBLEM)
    if existing is None:
        if "LOCAL_RANK" in os.environ:  # a worker of torchrun or of `train.py --nproc`
            die_with_launcher()
        for key, value in torchrun_env(0, 1, free_port()).items():  # a group of one
            os.environ.setdefault(key, value)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()  # (0 without CUDA)
    backend, device, note = choose_backend(backend, local_rank, local_world, gpus, existing)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    global DEVICE
    DEVICE = device
    collectives.LAYERS[:] = RUN_LAYERS
    if env_link:
        use_env_link()
    if existing is None:
        if note and local_rank == 0:
            print(f"hplab: {note}", file=sys.stderr)
        if backend == "nccl":
            for key in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_TIMING"):
                os.environ.setdefault(key, "1")
        global TIMEOUT
        TIMEOUT = timedelta(seconds=timeout_s)
        import_before_the_group_exists()
        with explained("init_process_group"):  # (a peer that died while the group formed)
            dist.init_process_group(backend, timeout=TIMEOUT, **attempt_store())
        atexit.unregister(shutdown)  # once, however often we start
        atexit.register(shutdown)
    return device


def attempt_store() -> dict:
    """Under torchrun after a restart: the store its agent keeps (MASTER_ADDR:MASTER_PORT)
    outlives the workers, with the previous attempt's keys in it, so a restarted rank could
    read a dead peer's address ("Connection refused", pytorch/pytorch#167288). Each attempt's
    process group then keeps its keys under a prefix of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    address = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    agents = dist.TCPStore(address, port, is_master=False, timeout=TIMEOUT)
    store = dist.PrefixStore(f"hplab-attempt-{attempt}", agents)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    return dict(store=store, rank=rank, world_size=world)


def current_device() -> torch.device:
    """The device `init_distributed` chose for this rank (the CPU before it ran)."""
    return DEVICE


def new_group(ranks: list[int], local: bool = False):
    """`dist.new_group` with the world's timeout (torch's default for a new group: 30 min).
    `local`: only `ranks` call it (torch's `use_local_synchronization`), not every rank."""
    return dist.new_group(ranks, timeout=TIMEOUT, use_local_synchronization=local)


def group_options():
    """The options of a group a DeviceMesh creates (its `backend_override`): the world's
    timeout, which it would otherwise leave at torch's default for a new group (30 min). On
    another backend than gloo or NCCL (a test's "fake" one), torch's own defaults."""
    backend = dist.get_backend()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        return (None, None)  # (no backend named, no options)
    options._timeout = TIMEOUT
    return options


def die_with_launcher() -> None:
    """A worker started by a launcher (torchrun, `train.py --nproc`) must not outlive it: ask
    Linux to kill this process when its parent dies (PR_SET_PDEATHSIG). A parent that died
    before we asked has left us to init (pid 1)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


# What every rank imports, imported once by a launcher that forks its ranks (~3 s of CPU each):
# torch._dynamo, which an optimizer's first step imports, and the torch modules that take
# `group=dist.group.WORLD` as a default argument (imported after the group exists, they would
# hold it for good).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "hplab.parallel.compose",
    "torch.distributed.checkpoint.optimizer",
    "torch.distributed.nn.functional",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "torch.distributed.optim.zero_redundancy_optimizer",
]


def import_before_the_group_exists() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


def shutdown() -> None:
    """Destroy the process groups (every Communicator lets go of its own) while Python is still
    alive: a gloo thread drops a collective's tensors just *after* `wait()` returns, taking the
    GIL, and aborts a finalizing process ("terminate called without an active exception").
    Freeing a group joins its threads while holding the GIL: first sleep (without the GIL), so a
    thread still dropping the last collective's tensors can finish, or the two wait forever."""
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()
    for comm in list(OPEN_COMMUNICATORS):
        comm.release()
    link.release()  # (its board's files, shared with the other ranks: all are done with them)
    gc.collect()
