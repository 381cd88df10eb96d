"""Running the command line in a subprocess, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python -m mlxlab ARGS` in a subprocess, capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mlxlab", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )
