"""The world of a run on several processes: `mx.distributed`, started by `mlx.launch`.

mlxlab writes no transport: MLX's backends (ring over TCP, MPI, JACCL over Thunderbolt, NCCL)
move the bytes; `mlx.launch` starts one process per rank and tells each, through its
environment, who it is and where the others are. `World.start` reads that environment (no
launcher variables: a single process, `None`, and nothing here runs), initializes the backend
and gathers every rank's host name and pid, which rank 0 prints.

Collectives can block forever: a ring collective whose peer was killed fails at once ("connection
to a peer was lost"), but one whose peer hangs (stopped, swapping, deadlocked) never returns, and
neither does the ring's start-up while a peer has not connected. Every blocking call here runs
under a watchdog thread with a deadline (`dist.timeout_s`); past it, the process prints one line
saying what it waited for and exits 1 (os._exit: the waiting C++ call cannot be interrupted).
Its peers then see the connection drop and stop too, each with its own one-line reason.

Arrays whose shapes a receiver does not know travel behind a header of their dtypes and shapes
(`encode` / `decode`); `share` sends a rank's arrays to every rank that way (the segment
pipeline's boundaries and gathered checkpoints, train/pipeline_stage.py and pipeline.py).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxlab.errors import UserError

log = logging.getLogger(__name__)

# What each launcher puts in a rank's environment (mlx/_distributed_utils/launch.py; mpirun).
LAUNCH_ENV = {
    "ring": ("MLX_HOSTFILE", "MLX_RANK"),
    "jaccl": ("MLX_JACCL_COORDINATOR",),
    "nccl": ("NCCL_HOST_IP", "MLX_WORLD_SIZE"),
    "mpi": ("OMPI_COMM_WORLD_SIZE",),  # Open MPI's mpirun (mlx.launch --backend mpi)
    "mpich": ("PMI_SIZE", "PMI_RANK"),  # MPICH-style mpirun: the mpi backend too
}
HOST_BYTES = 96  # a rank's "host (pid N)" label, padded, in the start-up gather
MESSAGE_BYTES = 1024  # an error message agreed on by every rank


class DistributedError(UserError):
    """A collective failed or a rank reported an error: one line, exit code 1, on every rank."""


def detect_backend(env=None) -> str | None:
    """The backend whose launcher variables are set (ring, jaccl, nccl, mpi), else None."""
    env = os.environ if env is None else env
    for backend, names in LAUNCH_ENV.items():
        if all(env.get(n) for n in names):
            if backend == "ring" and not env.get("MLX_HOSTFILE", "").strip():
                continue  # mlx.launch -n 1 leaves the hostfile empty: one process
            return "mpi" if backend == "mpich" else backend
    return None


class Watchdog:
    """One daemon thread; `guard(what)` arms a deadline around a blocking call. If the call is
    still running at the deadline, the process prints `what` it waited for and exits 1."""

    def __init__(self, timeout_s: float, rank: int, exit: Callable[[int], None] = os._exit):
        self.timeout_s = timeout_s
        self.rank = rank
        self._exit = exit
        self._cond = threading.Condition()
        self._armed: tuple[float, str, float] | None = None  # (deadline, what, timeout)
        self._thread = threading.Thread(target=self._run, name="mlxlab-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str, timeout_s: float | None = None):
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            self._armed = (time.monotonic() + timeout, what, timeout)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._armed is None:
                    self._cond.wait()
                    continue
                deadline, what, timeout = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._fire(what, timeout)
                return

    def _fire(self, what: str, timeout: float) -> None:
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 (exiting anyway)
            pass
        sys.stderr.write(
            f"mlxlab train: error: rank {self.rank}: no answer from the other ranks for "
            f"{timeout:.0f} s while {what}: a rank died or hangs (dist.timeout_s={timeout:g}); "
            "stopping\n"
        )
        sys.stderr.flush()
        self._exit(1)


@dataclass
class World:
    """This process's place in the run and the collectives it uses, each under the watchdog."""

    group: object
    backend: str
    rank: int
    size: int
    timeout_s: float
    watchdog: Watchdog
    hosts: list[str] = field(default_factory=list)  # "host (pid N)" of every rank
    bytes_sent: int = 0  # payload bytes this rank handed to collectives and sends

    # --- start-up ----------------------------------------------------------------------------

    @classmethod
    def start(cls, cfg, env=None) -> World | None:
        """Join the run the launcher set up (DistConfig `cfg`); None for a process started alone
        (then nothing is initialized). A world of one (`mlx.launch -n 1`) is None too."""
        backend = detect_backend(env) if cfg.backend == "any" else cfg.backend
        if backend is None:
            return None
        rank_hint = int((os.environ if env is None else env).get("MLX_RANK", "0") or 0)
        watchdog = Watchdog(cfg.timeout_s, rank_hint)
        with watchdog.guard(f"connecting to the other ranks ({backend} backend)"):
            try:
                group = mx.distributed.init(strict=True, backend=backend)
            except RuntimeError as e:
                raise DistributedError(
                    f"cannot start the {backend} backend: {_first_line(e)}"
                ) from None
        if group.size() == 1:
            return None
        watchdog.rank = group.rank()
        world = cls(group, backend, group.rank(), group.size(), cfg.timeout_s, watchdog)
        label = f"{socket.gethostname()} (pid {os.getpid()})".encode()[:HOST_BYTES]
        gathered = world.all_gather(
            mx.array(list(label.ljust(HOST_BYTES, b"\0")), mx.uint8), "gathering the ranks' hosts"
        )
        rows = bytes(gathered.tolist())
        world.hosts = [
            rows[r * HOST_BYTES : (r + 1) * HOST_BYTES].rstrip(b"\0").decode(errors="replace")
            for r in range(world.size)
        ]
        return world

    @property
    def writer(self) -> bool:
        """Rank 0 alone writes the run directory."""
        return self.rank == 0

    def describe(self) -> str:
        ranks = ", ".join(f"rank {r} on {h}" for r, h in enumerate(self.hosts))
        return f"world: {self.backend} backend, {self.size} processes: {ranks}"

    # --- collectives -------------------------------------------------------------------------

    @contextmanager
    def _call(self, what: str):
        with self.watchdog.guard(what):
            try:
                yield
            except RuntimeError as e:
                raise DistributedError(
                    f"rank {self.rank}: {what} failed: {_first_line(e)} (another rank stopped; "
                    "its output says why)"
                ) from None

    def all_sum(self, x: mx.array, what: str = "summing across ranks") -> mx.array:
        with self._call(what):
            out = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
            mx.eval(out)
        self.bytes_sent += x.nbytes
        return out

    def all_gather(self, x: mx.array, what: str = "gathering across ranks") -> mx.array:
        """Every rank's `x` (same shape everywhere) stacked along axis 0: bytes move unchanged."""
        with self._call(what):
            out = mx.distributed.all_gather(x, group=self.group, stream=mx.cpu)
            mx.eval(out)
        self.bytes_sent += x.nbytes
        return out

    def send(self, x: mx.array, dst: int, what: str) -> None:
        with self._call(what):
            mx.eval(mx.distributed.send(x, dst, group=self.group, stream=mx.cpu))
        self.bytes_sent += x.nbytes

    def recv(self, shape, dtype, src: int, what: str) -> mx.array:
        with self._call(what):
            out = mx.distributed.recv(shape, dtype, src, group=self.group, stream=mx.cpu)
            mx.eval(out)
        return out

    def sum_values(self, values: list[float], what: str = "summing counts") -> list[float]:
        """Python numbers summed over the ranks (float64)."""
        out = self.all_sum(mx.array(values, mx.float64), what)
        return out.tolist()

    def gather_values(self, values: list[float], what: str = "gathering per-rank figures"):
        """[rank][i]: every rank's list of numbers (float64, the same length on every rank)."""
        out = self.all_gather(mx.array([values], mx.float64), what)
        return out.tolist()

    def broadcast_arrays(self, arrays: list[mx.array], what: str, root: int = 0) -> list[mx.array]:
        """Rank `root`'s arrays, bit for bit, on every rank (each rank passes arrays of the same
        shapes and dtypes; only root's values matter). One gather per dtype."""
        if not arrays:
            return []
        out: list = [None] * len(arrays)
        by_dtype: dict = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = mx.concatenate([arrays[i].reshape(-1) for i in idx])
            got = self.all_gather(flat[None], what)[root]
            offset = 0
            for i in idx:
                n = arrays[i].size
                out[i] = got[offset : offset + n].reshape(arrays[i].shape)
                offset += n
        mx.eval(out)
        return out

    def broadcast_tree(self, tree, what: str, root: int = 0):
        flat = tree_flatten(tree)
        values = self.broadcast_arrays([v for _, v in flat], what, root)
        return tree_unflatten([(k, v) for (k, _), v in zip(flat, values, strict=True)])

    def sum_tree(self, tree, what: str = "summing gradients"):
        """Every array of `tree` summed over the ranks: one all_sum per dtype (as mlx's
        average_gradients groups them), without its division."""
        flat = tree_flatten(tree)
        if not flat:
            return tree
        values: list = [None] * len(flat)
        by_dtype: dict = {}
        for i, (_, a) in enumerate(flat):
            by_dtype.setdefault(a.dtype, []).append(i)
        for idx in by_dtype.values():
            big = self.all_sum(mx.concatenate([flat[i][1].reshape(-1) for i in idx]), what)
            offset = 0
            for i in idx:
                a = flat[i][1]
                values[i] = big[offset : offset + a.size].reshape(a.shape)
                offset += a.size
        return tree_unflatten([(k, v) for (k, _), v in zip(flat, values, strict=True)])

    def agree(self, fn: Callable[[], object], what: str, root: int = 0):
        """Run `fn` on rank `root` only (a check of the run directory, a restore); every rank
        then gets its result's success or its UserError message, and raises that error too.
        Returns fn's result on root, None elsewhere."""
        message, result = b"", None
        if self.rank == root:
            try:
                result = fn()
            except UserError as e:
                message = (str(e) or type(e).__name__).encode()[:MESSAGE_BYTES] or b"error"
        buf = mx.array(list(message.ljust(MESSAGE_BYTES, b"\0")), mx.uint8)
        got = bytes(self.broadcast_arrays([buf], what, root)[0].tolist()).rstrip(b"\0")
        if got:
            text = got.decode(errors="replace")
            raise DistributedError(text if self.rank == root else f"rank {root}: {text}")
        return result

    def share_floats(self, values: list[float] | None, n: int, what: str, root: int = 0):
        """Rank `root`'s list of `n` floats (or its None) on every rank, bit for bit."""
        with mx.stream(mx.cpu):  # float64: a Mac's GPU refuses it
            flag = mx.array([0 if values is None else 1], mx.float64)
            data = mx.array(values if values is not None else [0.0] * n, mx.float64)
            flag, data = self.broadcast_arrays([flag, data], what, root)
            return data.tolist() if flag.item() else None

    def merge_floats(self, values: list[float | None], what: str) -> list[float | None]:
        """Each rank computed some entries of a list (None elsewhere): every rank gets every
        entry, from the lowest rank that has it, bit for bit."""
        with mx.stream(mx.cpu):  # float64: a Mac's GPU refuses it
            has = mx.array([[v is not None for v in values]], mx.uint8)
            data = mx.array([[0.0 if v is None else v for v in values]], mx.float64)
            every_has = self.all_gather(has, what).tolist()
            every = self.all_gather(data, what).tolist()
        out: list[float | None] = []
        for i in range(len(values)):
            r = next((r for r in range(self.size) if every_has[r][i]), None)
            out.append(None if r is None else every[r][i])
        return out

    def barrier(self, what: str) -> None:
        self.all_sum(mx.array(1, mx.int32), what)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- array headers (shapes travel ahead of arrays) --------------------------------------------

DTYPES = [
    mx.bool_,
    mx.uint8,
    mx.uint16,
    mx.uint32,
    mx.uint64,
    mx.int8,
    mx.int16,
    mx.int32,
    mx.int64,
    mx.float16,
    mx.float32,
    mx.float64,
    mx.bfloat16,
]
HEADER = 6  # per array: dtype code, ndim, up to 4 dims


def encode(arrays: list[mx.array]) -> mx.array:
    rows = []
    for a in arrays:
        if a.ndim > HEADER - 2:
            raise ValueError(f"cannot send a {a.ndim}-d array")
        dims = list(a.shape) + [0] * (HEADER - 2 - a.ndim)
        rows += [DTYPES.index(a.dtype), a.ndim, *dims]
    return mx.array(rows, mx.int64)


def decode(header: mx.array) -> list[tuple[tuple, object]]:
    values = header.tolist()
    out = []
    for i in range(0, len(values), HEADER):
        code, ndim, *dims = values[i : i + HEADER]
        out.append((tuple(dims[:ndim]), DTYPES[code]))
    return out


def share(world: World, arrays: list[mx.array] | None, count: int, root: int, what: str):
    """Rank `root`'s `count` arrays, bit for bit, on every rank (the others pass None): their
    shapes first, then the arrays."""
    header = encode(arrays) if world.rank == root else mx.zeros((count * HEADER,), mx.int64)
    shapes = decode(world.broadcast_arrays([header], what, root)[0])
    if world.rank != root:
        arrays = [mx.zeros(shape, dtype) for shape, dtype in shapes]
    return world.broadcast_arrays(arrays, what, root)
