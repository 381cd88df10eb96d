"""Starting the ranks of a ring-backend run on loopback, as `mlx.launch` does, one Popen each.

`mlx.launch` exits 0 whatever its ranks do and kills the others as soon as one fails; the tests
start the ranks themselves (MLX_RANK + MLX_HOSTFILE, the environment mlx.launch gives each) so
they see every rank's exit code and output, and can kill or stop one rank alone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import REPO


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def hostfile(tmp: Path, n: int) -> Path:
    """A ring hostfile for `n` ranks on 127.0.0.1 (mlx.launch's format: one list per rank)."""
    path = tmp / f"hosts_{n}_{os.getpid()}.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def start_ranks(
    args: list[str], n: int, tmp: Path, env: dict | None = None, module: str = "mlxlab"
) -> list[subprocess.Popen]:
    """`python -m <module> ARGS` as ranks 0..n-1 of one ring world; stdout/stderr piped."""
    hosts = hostfile(tmp, n)
    procs = []
    for rank in range(n):
        full = {**os.environ, **(env or {}), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=full,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of every rank; kills all on timeout."""
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
