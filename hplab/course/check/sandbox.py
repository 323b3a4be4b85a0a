"""The learner's file in a process of its own: what it defines is called from the checker
through a pipe, so the learner's code cannot reach the checker — patch its functions, exit the
checking process with a pass (os._exit(0)), or swallow its timeout in a bare `except:`.

    module = Sandbox(path)        # runs the file there (forked from a preloaded server: fast)
    module.dispatch_order(x, 4)   # runs there; arguments and results travel pickled
    module.close()

A learner's exception comes back as what Report says of it: NotImplementedError and SystemExit
as themselves, anything else as a LearnerError whose text names the line of their file.
"""

from __future__ import annotations

import multiprocessing
import runpy
import traceback

from hplab.launch import FORKSERVER_PRELOAD


class LearnerError(Exception):
    """The learner's code raised, or its process ended; the text is what the report says."""


def _caught(err: BaseException, path: str) -> tuple:
    if isinstance(err, NotImplementedError | SystemExit):
        return ("raise", err)
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    where = f" at line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
    return ("learner", f"raised {type(err).__name__}: {err}{where}")


def _serve(path: str, conn) -> None:
    """The sandbox's side: load the file, then answer ("attr", name) and ("call", ...)."""
    try:
        namespace = runpy.run_path(path)
        conn.send(("ok", None))
    except BaseException as err:
        conn.send(_caught(err, path))
        return
    while True:
        kind, name, args, kwargs = conn.recv()
        try:
            if kind == "attr":
                value = namespace.get(name, AttributeError)
                conn.send(("callable", None) if callable(value) else ("ok", value))
            else:
                conn.send(("ok", namespace[name](*args, **kwargs)))
        except BaseException as err:
            conn.send(_caught(err, path))


class Sandbox:
    def __init__(self, path: str):
        server = multiprocessing.get_context("forkserver")
        server.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._conn, theirs = server.Pipe()
        self._process = server.Process(target=_serve, args=(path, theirs), daemon=True)
        self._process.start()
        theirs.close()
        self._answer("loading it")

    def _answer(self, doing: str):
        try:
            while not self._conn.poll(0.05):
                if not self._process.is_alive():
                    raise EOFError
            status, value = self._conn.recv()
        except (EOFError, OSError):  # (its end of the pipe closed with it)
            raise LearnerError(
                f"your file ended its process while {doing} (os._exit? a crash?): a checked "
                "file must return"
            ) from None
        if status == "raise":
            raise value
        if status == "learner":
            raise LearnerError(value)
        return value

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        self._send("attr", name, (), {})
        if self._answer(f"looking up {name}") is AttributeError:
            raise AttributeError(f"your file defines no {name}")
        return lambda *args, **kwargs: self._call(name, args, kwargs)

    def _send(self, *message) -> None:
        try:
            self._conn.send(message)
        except OSError:  # a broken pipe: _answer says why
            pass

    def _call(self, name: str, args, kwargs):
        self._send("call", name, args, kwargs)
        return self._answer(f"running {name}()")

    def close(self) -> None:
        self._process.kill()
        self._process.join()
        self._conn.close()
