"""Diagnostics go through `logging`: each module has `log = logging.getLogger(__name__)`.

Library imports configure nothing. A command calls `setup()` once (mlxlab/cli.py's `run_hydra`
does): one handler on the "mlxlab" logger that writes the bare message to stderr, level INFO
(and no propagation to the root logger from then on).
A command's actual output (generated text, tables, paths) is printed to stdout instead.
"""

from __future__ import annotations

import logging
import sys

ROOT = "mlxlab"


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest and notebooks swap it)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup(level: int = logging.INFO) -> logging.Logger:
    """Install the command-line handler on the "mlxlab" logger (once; later calls only set the level)."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # a root handler some library installs must not print it twice
    logger.setLevel(level)
    return logger
