"""The checker's own files, kept as they were. The learner's code runs as the same user as the
checker, so it can write to hplab's files: rewrite a checker to pass everything, or add a
`report/` package beside report.py that shadows it. Nothing in this process would see that, but
the next check would import it.

So before a file is checked its Snapshot holds every file of the hplab package (and a digest of
the bytecode Python caches for each), and after its sandbox has ended `restore()` puts back
what changed, removes what appeared, drops changed bytecode, and says in one line what it found:

    files = Snapshot()
    ...                          # the check; the sandbox and all its processes end
    problem = files.restore()    # None, or "your file changed hplab/course/check/report.py ..."
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # hplab/


def _bytecode(source: Path) -> Path:
    """Where Python caches `source`'s bytecode (__pycache__, or under PYTHONPYCACHEPREFIX)."""
    return Path(importlib.util.cache_from_source(str(source)))


def _digest(path: Path) -> str | None:
    """The sha256 of a regular file; None for anything else (absent, a link, a FIFO: reading a
    FIFO would wait for ever)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _files(root: Path) -> list[Path]:
    """Everything below `root` but folders (and the bytecode caches, kept as digests)."""
    return sorted(
        p
        for p in root.rglob("*")
        if "__pycache__" not in p.parts and (p.is_symlink() or not p.is_dir())
    )


def _put_back(path: Path, content: bytes) -> None:
    """Write `content` to `path` as a new file (a symbolic link put there is replaced, not
    followed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    spare = path.with_name(f".{path.name}.{os.getpid()}.restore")
    spare.write_bytes(content)
    os.replace(spare, path)


class Snapshot:
    """hplab's files as they are now: their bytes, and a digest of each one's bytecode."""

    def __init__(self, root: Path = PACKAGE):
        self.root = root
        self.files = {p: p.read_bytes() for p in _files(root) if _digest(p)}
        self.bytecode = {p: _digest(_bytecode(p)) for p in self.files if p.suffix == ".py"}

    def restore(self) -> str | None:
        """Put every file back as it was; None if none had changed, else one line naming the
        first that had (bytecode that changed is removed quietly: Python writes it again)."""
        changed = []
        for path in _files(self.root):
            if path not in self.files:
                changed.append((path, "added"))
                path.unlink()
        for path, content in self.files.items():
            if _digest(path) != hashlib.sha256(content).hexdigest():
                changed.append((path, "changed"))
                _put_back(path, content)
        for source, digest in self.bytecode.items():
            if _digest(cached := _bytecode(source)) != digest:
                cached.unlink(missing_ok=True)
        if not changed:
            return None
        path, how = changed[0]
        more = f" (and {len(changed) - 1} more)" * (len(changed) > 1)
        return (
            f"your file {how} the checker's own {path.relative_to(self.root.parent)}{more}: "
            "a checked file must not write to hplab — put back as it was"
        )
