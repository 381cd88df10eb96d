"""Writes that never leave a half-written file or directory where a good one was, and that two
processes building the same directory do not break; a file's SHA-256, read in blocks."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mlxlab.errors import UserError

try:
    import fcntl
except ImportError:  # not POSIX: no lock between processes
    fcntl = None

_locks: dict[str, threading.RLock] = {}
_depth: dict[str, int] = {}
_locks_guard = threading.Lock()
log = logging.getLogger(__name__)


def writable_dir(path: Path) -> Path:
    """Create `path` if needed and check it can be written; a UserError says why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create directory {path}: {e.strerror or e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"directory {path} is not writable")
    return path


def fresh_output(out: str | os.PathLike, force: bool = False, kind: str = "directory") -> Path:
    """Where a command will write a new `kind` ("directory" or "file"), checked before any work:
    something already there (a directory with files in it, a file) is replaced only with
    `force`, and never the working directory or a directory above it."""
    path = Path(out).expanduser().absolute()
    here = Path.cwd().resolve()
    if path.resolve() == here or path.resolve() in here.parents:
        raise UserError(f"out={out} is the working directory or holds it; name a new {kind}")
    if not path.exists() and not path.is_symlink():
        return path
    if kind == "file" and path.is_dir():
        raise UserError(f"out={out} is a directory; name a file")
    if path.is_dir() and not any(path.iterdir()):
        return path
    if not force:
        what = "a directory that is not empty" if path.is_dir() else "an existing file"
        raise UserError(f"out={out} is {what}; force=true replaces it")
    return path


def output_file(out: str | os.PathLike | None, default_name: str) -> Path:
    """The file a command will write its result to, checked before any work is done.

    `out` names the file; without it, `default_name` in the working directory. An existing
    directory (or a path that ends in a separator) means `default_name` inside it. The file's
    directory is created if needed and must be writable; a UserError says why not, so a long
    run cannot end by failing to write what it computed.
    """
    raw = os.fspath(out) if out else ""
    path = Path(raw or default_name).expanduser().absolute()
    if raw.endswith(("/", os.sep)) or path.is_dir():
        path = path / default_name
    if path.is_dir():
        raise UserError(f"out={raw}: {path} is a directory")
    writable_dir(path.parent)  # the file itself is replaced by a rename: its directory counts
    try:  # where permissions say yes but the filesystem says no (/proc, a read-only mount)
        tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-probe-").close()
    except OSError as e:
        raise UserError(f"out={raw}: cannot write in {path.parent}: {e.strerror or e}") from e
    return path


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` to a temp file beside `path`, flush it to disk, then rename it over `path`."""
    path = Path(path)
    # The temp name keeps the real name as its end, so writers that add extensions leave it be.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=f"-{path.name}")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def _lock_file(key: str):
    """An open file to `flock` for `key`, in this user's own directory under the temp dir (not
    beside the output: users' directories stay clean); None where there is none to trust (no
    `fcntl`, a temp dir that cannot be written, a lock directory another user owns or a link):
    then builders in one process still take turns, and other processes are not waited for."""
    if fcntl is None:
        return None
    uid = os.getuid()
    locks = Path(tempfile.gettempdir()) / f"mlxlab-locks-{uid}"
    try:
        locks.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(locks)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            raise OSError(f"{locks} is not this user's own directory")
        return open(locks / hashlib.sha256(key.encode()).hexdigest()[:32], "a")
    except OSError as e:
        log.warning("mlxlab: no lock between processes for building %s (%s)", key, e)
        return None


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold the right to build `out`: one thread of one process at a time (an advisory lock on
    a file named by the path's hash, released when the process dies; `_lock_file`). Re-entrant
    in a thread, so a caller that checks `out` under the lock can build it with `atomic_dir`,
    which takes it too."""
    out = Path(out).absolute()
    key = str(out)
    with _locks_guard:
        lock = _locks.setdefault(key, threading.RLock())
    with lock:
        if _depth.get(key, 0):
            _depth[key] += 1
            try:
                yield
            finally:
                _depth[key] -= 1
            return
        f = _lock_file(key)
        try:
            if f is not None:
                fcntl.flock(f, fcntl.LOCK_EX)
            _depth[key] = 1
            yield
        finally:
            _depth[key] = 0
            if f is not None:
                f.close()  # (closing releases the lock)


def atomic_dir(out: Path, write: Callable[[Path], object]) -> Path:
    """Build a directory with `write(tmp)` in a temp sibling, then move it into place.

    An existing `out` is swapped out only after the new one is complete; stale temp siblings
    from an interrupted earlier run are removed first. Under `build_lock`: a second process
    building the same directory waits instead of removing the first one's temp as stale.
    """
    out = Path(out).absolute()
    parent = writable_dir(out.parent)
    with build_lock(out):
        # this name's own temps only (mkdtemp's 8 characters): `.tmp-gemma3-270m-*` would
        # also match the temps of `gemma3-270m-q4g64`, another build in the same directory
        own = re.compile(rf"\.tmp-{re.escape(out.name)}-(old-)?[a-z0-9_]{{8}}")
        for stale in parent.glob(f".tmp-{out.name}-*"):
            if own.fullmatch(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-{out.name}-"))
        tmp.chmod(0o755)
        try:
            write(tmp)
            if out.exists():
                old = Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-{out.name}-old-"))
                os.replace(out, old / "x")
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of the file at `path`, read 4 MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
