"""The learner's file in a process of its own, so that their code cannot reach the checker:
patch its functions, exit the checking process with a pass (os._exit(0)), or swallow its
timeout in a bare `except:`. The checker and its verdict stay in the checking process.

    module = Sandbox(path)        # runs the file there (forked from a preloaded server: fast)
    module.dispatch_order(x, 4)   # runs there; arguments go pickled, results come back as
                                  # plain data (plain.py: JSON), never pickled
    module.run(driver, x)         # driver(env, x) runs there: env.learner is the file
    module.close()

A distributed exercise gives the sandbox the rank's communicator (`Sandbox(path, comm)`): the
learner's code gets a `RemoteComm`, whose every call runs here, on the real communicator, where
the checker watches it (the ledger, the emulated link), and whose results are copied back into
the learner's tensors; an async call's `wait()` is a call too. A checker's driver may also
`env.tell(name, ...)` the checker (`module.listeners[name]`), e.g. from a gradient hook.

A learner's exception comes back as what Report says of it: NotImplementedError and SystemExit
as themselves (rebuilt here from their text), anything else as a LearnerError whose text names
the line of their file.

The sandbox cannot outlive its check: it has a process group of its own, on Linux it dies with
the checking process (PR_SET_PDEATHSIG) and adopts its descendants' orphans (a subreaper), and
`close()` stops and kills every process below it, a grandchild that called setsid() included.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hplab.course.check import plain
from hplab.runtime.errors import CommTimeout
from hplab.runtime.launch import FORKSERVER_PRELOAD


class LearnerError(Exception):
    """The learner's code raised, or its process ended; the text is what the report says."""


class ForbiddenHelper(Exception):
    """(In the sandbox.) The learner's code called a helper its lab forbids (see `forbidden`)."""


@contextlib.contextmanager
def forbidden(owner, name: str, called: str, why: str):
    """(In the sandbox.) While the block runs, `owner.name` (a method, e.g. ModelConfig's
    num_params) raises ForbiddenHelper: a lab that forbids a helper sees the call when it
    happens, however the learner's code reaches it. Only the sandbox's copy of `owner` changes."""
    original = owner.__dict__[name]

    def refuse(*args, **kwargs):
        raise ForbiddenHelper(f"you called {called}: {why}")

    setattr(owner, name, refuse)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _caught(err: BaseException, path: str) -> tuple:
    """What the sandbox says of the learner's exception, as plain data."""
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int | str | None) else repr(err.code)
        return ("raise", "SystemExit", code)
    if isinstance(err, NotImplementedError):
        return ("raise", "NotImplementedError", str(err))
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    where = f" at line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
    if isinstance(err, ForbiddenHelper):
        return ("learner", f"{err} (line {frames[-1].lineno})" if frames else str(err))
    if "process group has not been initialized" in str(err):
        where += " — a checked file communicates through the comm it is given (comm.send, ...)"
    return ("learner", f"raised {type(err).__name__}: {err}{where}")


# The checker's messages to the sandbox are pickled by hand (pickle, not multiprocessing's
# ForkingPickler: a tensor travels as a copy, never as memory the two processes would share):
# a driver, a model, a config. The sandbox's to the checker are plain data (plain.py), so that
# nothing the learner made runs code in the checking process when it arrives.
def _send(conn, *message) -> None:
    """The checker's side: a message to the sandbox."""
    conn.send_bytes(pickle.dumps(message))


def _receive(conn) -> tuple:
    """The sandbox's side: the checker's message."""
    return pickle.loads(conn.recv_bytes())


def _send_plain(conn, *message) -> None:
    """The sandbox's side: a message to the checker (plain.NotPlain if it has no plain form)."""
    conn.send_bytes(plain.encode(message))


def _reply(conn, value, what: str) -> None:
    """The sandbox's answer `value`, or, when it is not plain data, a line saying so."""
    try:
        data = plain.encode(("ok", value))
    except plain.NotPlain as err:
        data = plain.encode(
            (
                "learner",
                f"{what} {err}: not plain data — a checked function returns numbers, strings,"
                " lists, tuples, dicts or tensors",
            )
        )
    conn.send_bytes(data)


def _receive_plain(conn) -> tuple:
    """The checker's side: the sandbox's message (loading JSON runs none of the learner's code)."""
    return plain.decode(conn.recv_bytes())


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
    _send_plain(_checker, "ask", *request)
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
        self.ticket = ticket
        self.tensors = tensors

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
        self.size = size
        self.rank = rank
        self.name = name

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._call(method, args, kwargs)

    def _call(self, method: str, args, kwargs):
        tensors = _tensors_in(args)
        try:
            kind, value = _ask("comm", method, _detached(args), kwargs)
        except plain.NotPlain as err:
            raise plain.NotPlain(
                f"comm.{method}() was given {err}: a communicator takes tensors and numbers"
            ) from None
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


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies
PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphans below this process are re-parented to it


def _watch_parent(parent: int) -> None:
    """(Where prctl is not there.) End this process once its parent has gone."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def _stay_inside(parent: int) -> None:
    """(In the sandbox, before the learner's code.) A process group of its own; on Linux, a
    SIGKILL when the checker dies, even in an endless loop (PR_SET_PDEATHSIG), and the orphans
    of its descendants re-parented to it, not to init (PR_SET_CHILD_SUBREAPER): a grandchild
    that called setsid() and whose parent exited is still below it, where close() finds it."""
    os.setpgid(0, 0)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the checker died before prctl could tie this process to it
        os._exit(1)


def _serve(path: str, conn, comm_shape, threads: int) -> None:
    """The sandbox's side: load the file, then answer ("attr", name), ("call", name, ...) and
    ("run", driver, ...): driver(env, ...), env = (learner, comm, state, tell). It computes on
    as many threads as the checker (sums in the same order: the same rounding)."""
    global _checker
    _stay_inside(os.getppid())
    _checker = conn
    torch.set_num_threads(threads)
    if dist.is_initialized():  # forked from a rank: its process group is not theirs to use
        dist.distributed_c10d._world.default_pg = None
    try:
        namespace = runpy.run_path(path)
        _send_plain(conn, "ok", None)
    except BaseException as err:
        _send_plain(conn, *_caught(err, path))
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
                if value is AttributeError:
                    _send_plain(conn, "ok", ["missing"])
                elif callable(value):
                    _send_plain(conn, "ok", ["callable"])
                else:
                    _reply(conn, ["value", value], f"your {name} is")
            elif kind == "run":
                _reply(conn, name(env, *args, **kwargs), "your code returned")
            else:
                _reply(conn, namespace[name](*args, **kwargs), f"your {name}() returned")
        except BaseException as err:
            with contextlib.suppress(OSError):  # (the checker may have gone meanwhile)
                _send_plain(conn, *_caught(err, path))


# --- the checker's side -----------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    """Every process's children, read from /proc/<pid>/stat (Linux; elsewhere: none known)."""
    children = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()  # after "pid (name)"
            except OSError:  # (it ended meanwhile)
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _below(root: int) -> set[int]:
    """`root` and every process below it."""
    found = set()
    todo = [root]
    children = _children()
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _ended(pid: int) -> bool:
    """Whether `pid` has ended (gone, or a zombie): a SIGKILLed process ends a moment later."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):  # (it has ended already)
        os.kill(pid, sig)


def end_process_tree(root: int) -> None:
    """Kill `root` and everything below it. First SIGSTOP, scan after scan until no new process
    shows up (a stopped process cannot fork, and an orphan comes to the stopped subreaper
    root); then SIGKILL them all. Last, root's process group: all that is known off Linux."""
    stopped = set()
    while new := _below(root) - stopped:
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(root, signal.SIGKILL)
    deadline = time.monotonic() + 5.0  # (on a loaded machine, dying takes its turn too)
    while not all(map(_ended, stopped - {root})) and time.monotonic() < deadline:
        time.sleep(0.01)


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
        self.comm = comm
        self.listeners = {}
        self._pending = {}
        self._tickets = 0
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
                status, *value = _receive_plain(self._conn)
            except (EOFError, OSError):  # (its end of the pipe closed with it)
                raise LearnerError(
                    f"your file ended its process while {doing} (os._exit? a crash?): a "
                    "checked file must return"
                ) from None
            if status != "ask":
                break
            self._serve_request(*value)
        if status == "raise":  # rebuilt here from plain data: the learner's class stays there
            kind, detail = value
            raise SystemExit(detail) if kind == "SystemExit" else NotImplementedError(detail)
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
        found = self._call("attr", name, (), {}, f"looking up {name}")
        if found[0] == "missing":
            raise AttributeError(f"your file defines no {name}")
        if found[0] == "value":
            return found[1]
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
        """End the sandbox and every process its code started, then reap it."""
        if self._process.exitcode is None:  # (once it has ended, its number is not its own)
            end_process_tree(self._process.pid)
        self._process.kill()
        self._process.join()
        self._conn.close()
