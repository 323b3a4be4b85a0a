"""Starting and watching processes: the launcher's side of distributed training.

Every "device" in hplab is one operating-system process. `torchrun` (or `train.py --nproc N`,
which does the same job itself after checking the flags) starts N of them, gives each its
place through environment variables (`dist.torchrun_env`: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), watches them, and stops them all when one fails or on Ctrl-C.

    launch(nproc, argv, run_rank)   train.py --nproc N: N ranks, forked from this process
                                    (fresh interpreters on a GPU machine), watched to the end
    run_distributed(fn, n, *args)   tests and checkers: fn on n processes, results by rank
    torchrun_command(n, script)     the torchrun command line, for notebooks and tests
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback

import torch

from hplab.dist import (
    DEFAULT_TIMEOUT_S,
    PRELOAD,
    free_port,
    init_distributed,
    shutdown,
    torchrun_env,
)


def _child(fn, rank, world_size, port, args, results, backend, timeout_s):
    os.environ.update(torchrun_env(rank, world_size, port))
    torch.set_num_threads(1)
    try:
        init_distributed(backend, timeout_s)
        results.put((rank, True, fn(*args)))
    except BaseException:  # report every failure to the parent, then exit
        results.put((rank, False, traceback.format_exc()))
    finally:
        shutdown()


def run_distributed(
    fn, world_size: int, *args, backend: str | None = "gloo", timeout_s: float = 300.0
) -> list:
    """Run `fn(*args)` on `world_size` fresh processes joined in one process group (gloo by
    default) on a free local port; return the results by rank. `fn` must be a module-level
    function (spawned processes pickle it by name). A child's exception is re-raised here with
    its traceback; a hang becomes a TimeoutError."""
    ctx = multiprocessing.get_context("forkserver")  # forked from a process that has imported
    ctx.set_forkserver_preload(PRELOAD)  # torch & co. once
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                r,
                world_size,
                port,
                args,
                results,
                backend,
                min(timeout_s, DEFAULT_TIMEOUT_S),
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except Exception:  # queue.Empty
                raise TimeoutError(
                    f"{world_size}-process run did not finish in {timeout_s:.0f}s"
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:  # after a failure, the others are stopped quickly
            p.join(timeout=5 if len(out) == world_size else 1)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def torchrun_command(nproc: int, script: str, *script_args: str) -> list[str]:
    """The command that launches `script` on `nproc` local processes, without relying on a
    `torchrun` executable on PATH (notebooks and tests use the current interpreter)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *script_args,
    ]
