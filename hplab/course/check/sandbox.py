"""The learner's file in a process of its own, so that their code cannot reach the checker:
patch its functions, exit the checking process with a pass (os._exit(0)), or swallow its
timeout in a bare `except:`. The checker and its verdict stay in the checking process.

    module = Sandbox(path)        # runs the file there (forked from a preloaded server: fast)
    module.dispatch_order(x, 4)   # runs there; arguments and results travel pickled
    module.run(driver, x)         # driver(env, x) runs there: env.learner is the file
    module.close()

A distributed exercise gives the sandbox the rank's communicator (`Sandbox(path, comm)`): the
learner's code gets a `RemoteComm`, whose every call runs here, on the real communicator, where
the checker watches it (the ledger, the emulated link), and whose results are copied back into
the learner's tensors; an async call's `wait()` is a call too. A checker's driver may also
`env.tell(name, ...)` the checker (`module.listeners[name]`), e.g. from a gradient hook.

A learner's exception comes back as what Report says of it: NotImplementedError and SystemExit
as themselves, anything else as a LearnerError whose text names the line of their file.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import runpy
import sys
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hplab.runtime.errors import CommTimeout
from hplab.runtime.launch import FORKSERVER_PRELOAD


class LearnerError(Exception):
    """The learner's code raised, or its process ended; the text is what the report says."""


def _caught(err: BaseException, path: str) -> tuple:
    if isinstance(err, NotImplementedError | SystemExit):
        return ("raise", err)
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    where = f" at line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
    if "process group has not been initialized" in str(err):
        where += " — a checked file communicates through the comm it is given (comm.send, ...)"
    return ("learner", f"raised {type(err).__name__}: {err}{where}")


# Messages are pickled by hand (pickle, not multiprocessing's ForkingPickler): a tensor travels
# as a copy, never as memory the two processes would share.
def _send(conn, *message) -> None:
    conn.send_bytes(pickle.dumps(message))


def _receive(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _tensors_in(args) -> list[torch.Tensor]:
    """The tensors among a call's arguments, in order (send_and_recv's (kind, tensor, peer) too)."""
    found = []
    for a in args:
        if torch.is_tensor(a):
            found.append(a)
        elif isinstance(a, list | tuple):
            found += _tensors_in(a)
    return found


def _detached(args):
    """The arguments as they can travel: tensors without their autograd history."""
    if torch.is_tensor(args):
        return args.detach()
    if isinstance(args, list | tuple):
        return type(args)(_detached(a) for a in args)
    return args


# --- the sandbox's side: the learner's file, and what stands in for the checker's objects ------

_checker = None  # this sandbox's pipe to the checking process


def _ask(*request):
    """Ask the checking process (a communicator call, a tell) and wait for its answer."""
    _send(_checker, "ask", *request)
    status, value = _receive(_checker)
    if status == "error":
        raise value
    return value


def _copy_back(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for mine, value in zip(tensors, values, strict=True):
            mine.copy_(value)


class RemotePending:
    """An async call's handle: wait() waits there, then copies the results into its tensors."""

    def __init__(self, ticket: int, tensors: list[torch.Tensor]):
        self.ticket, self.tensors = ticket, tensors

    def wait(self) -> None:
        if self.ticket is not None:
            _copy_back(self.tensors, _ask("wait", self.ticket))
            self.ticket = None

    def is_completed(self) -> bool:
        return self.ticket is None or _ask("is_completed", self.ticket)


class RemoteComm:
    """The communicator a checked file gets: `size` and `rank` as the real one's; any method
    runs on the real one, in the checking process (which sees every byte), and what it writes
    comes back into this process's tensors."""

    def __init__(self, size: int, rank: int, name: str):
        self.size, self.rank, self.name = size, rank, name

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._call(method, args, kwargs)

    def _call(self, method: str, args, kwargs):
        tensors = _tensors_in(args)
        kind, value = _ask("comm", method, _detached(args), kwargs)
        if kind == "done":
            _copy_back(tensors, value)
            return None
        if kind == "pending":
            return RemotePending(value, tensors)
        if kind == "pendings":  # send_and_recv: a handle per (kind, tensor, peer)
            return [RemotePending(t, [op[1]]) for t, op in zip(value, args[0], strict=True)]
        return value


class Learner(SimpleNamespace):
    def __getattr__(self, name: str):
        raise AttributeError(f"your file defines no {name}")


def _serve(path: str, conn, comm_shape, threads: int) -> None:
    """The sandbox's side: load the file, then answer ("attr", name), ("call", name, ...) and
    ("run", driver, ...): driver(env, ...), env = (learner, comm, state, tell). It computes on
    as many threads as the checker (sums in the same order: the same rounding)."""
    global _checker
    _checker = conn
    torch.set_num_threads(threads)
    if dist.is_initialized():  # forked from a rank: its process group is not theirs to use
        dist.distributed_c10d._world.default_pg = None
    try:
        namespace = runpy.run_path(path)
        _send(conn, "ok", None)
    except BaseException as err:
        _send(conn, *_caught(err, path))
        return
    comm = RemoteComm(*comm_shape) if comm_shape else None
    env = SimpleNamespace(
        learner=Learner(**namespace), comm=comm, state={}, tell=lambda *a: _ask("tell", *a)
    )
    while True:
        try:
            kind, name, args, kwargs = _receive(conn)
        except (EOFError, OSError):  # the checker has gone: so does its sandbox, quietly
            return
        try:
            if kind == "attr":
                value = namespace.get(name, AttributeError)
                _send(conn, *(("callable", None) if callable(value) else ("ok", value)))
            elif kind == "run":
                _send(conn, "ok", name(env, *args, **kwargs))
            else:
                _send(conn, "ok", namespace[name](*args, **kwargs))
        except BaseException as err:
            with contextlib.suppress(OSError):  # (the checker may have gone meanwhile)
                _send(conn, *_caught(err, path))


# --- the checker's side -----------------------------------------------------------------------


class Sandbox:
    def __init__(self, path: str, comm=None, fork: bool = False):
        # A rank of a distributed check forks its sandbox (it has imported everything, and its
        # torch runs on one thread, so no thread pool is cut in two), and so does a process
        # that says it can (`fork`: `python -m hplab.check`, one thread); others ask a
        # forkserver, started once with torch and hplab imported (~3 s, then ~0.05 s a file).
        fork = (fork or comm is not None) and sys.platform == "linux"
        fork = fork and torch.get_num_threads() == 1
        server = multiprocessing.get_context("fork" if fork else "forkserver")
        if not fork:
            server.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._conn, theirs = server.Pipe()
        self.comm, self.listeners, self._pending, self._tickets = comm, {}, {}, 0
        shape = comm and (comm.size, comm.rank, comm.name)
        self._process = server.Process(
            target=_serve, args=(path, theirs, shape, torch.get_num_threads()), daemon=True
        )
        self._process.start()
        theirs.close()
        self._answer("loading it")

    def _answer(self, doing: str):
        """The sandbox's answer to what was asked, serving its own requests meanwhile."""
        while True:
            try:
                while not self._conn.poll(0.05):
                    if not self._process.is_alive():
                        raise EOFError
                status, *value = _receive(self._conn)
            except (EOFError, OSError):  # (its end of the pipe closed with it)
                raise LearnerError(
                    f"your file ended its process while {doing} (os._exit? a crash?): a "
                    "checked file must return"
                ) from None
            if status != "ask":
                break
            self._serve_request(*value)
        if status == "raise":
            raise value[0]
        if status == "learner":
            raise LearnerError(value[0])
        return value[0]

    def _serve_request(self, kind: str, *request) -> None:
        """A communicator call, a wait, or a tell, made for the learner's code; its error (other
        than a timeout, which is the check's) is raised there, at the learner's line."""
        try:
            if kind == "comm":
                answer = self._communicate(*request)
            elif kind == "wait":
                work, tensors = self._pending.pop(request[0])
                work.wait()
                answer = tensors
            elif kind == "is_completed":
                answer = self._pending[request[0]][0].is_completed()
            else:
                answer = self.listeners[request[0]](*request[1:])
        except CommTimeout:
            raise
        except Exception as err:
            try:
                _send(self._conn, "error", err)
            except Exception:  # (an exception that does not pickle)
                _send(self._conn, "error", RuntimeError(f"{type(err).__name__}: {err}"))
            return
        _send(self._conn, "ok", answer)

    def _communicate(self, method: str, args, kwargs) -> tuple:
        if method.startswith("_") or not callable(call := getattr(self.comm, method, None)):
            raise AttributeError(f"the communicator has no method {method}()")
        out = call(*args, **kwargs)
        if out is None:
            return ("done", _tensors_in(args))
        if isinstance(out, list):  # send_and_recv
            tickets = [self._keep(work, [op[1]]) for work, op in zip(out, args[0], strict=True)]
            return ("pendings", tickets)
        if hasattr(out, "wait"):
            return ("pending", self._keep(out, _tensors_in(args)))
        return ("value", out)

    def _keep(self, work, tensors: list[torch.Tensor]) -> int:
        ticket = self._tickets = self._tickets + 1
        self._pending[ticket] = (work, tensors)
        return ticket

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._call("attr", name, (), {}, f"looking up {name}") is AttributeError:
            raise AttributeError(f"your file defines no {name}")
        return lambda *args, **kwargs: self._call("call", name, args, kwargs)

    def run(self, driver, *args, **kwargs):
        """`driver(env, *args, **kwargs)` in the sandbox (a checker's module-level function)."""
        return self._call("run", driver, args, kwargs)

    def _call(self, kind: str, name, args, kwargs, doing: str = ""):
        try:
            _send(self._conn, kind, name, args, kwargs)
        except OSError:  # a broken pipe: _answer says why
            pass
        return self._answer(doing or f"running {getattr(name, '__name__', name)}()")

    def close(self) -> None:
        self._process.kill()
        self._process.join()
        self._conn.close()
