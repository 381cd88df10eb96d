"""Numerics and memory harnesses from the command line.

    python -m mlxlab diag parity model=gemma3-270m dtype=bfloat16      # vs mlx-lm's own code
    python -m mlxlab diag leak model=tiny-gemma3 mode=segmented        # active memory over steps
    python -m mlxlab diag memory lengths=[512,1024] modes=[full,seg4,mlx_lm_gc]
    python -m mlxlab diag decode model=gemma3-270m length=256          # a decode step by op group
    python -m mlxlab diag profile model=gemma3-270m length=1152        # a training step by phase

Each prints a table, writes <out>_<action>.json (`out` a directory: <out>/<action>.json; and a PNG
for leak, memory and profile), and exits non-zero when a gate fails.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mlxlab.cli import run_hydra
from mlxlab.diag.config import DiagConfig


def _report_path(out: str, action: str) -> Path:
    """<out>_<action>.json (`out` a directory, or ending in a separator: <out>/<action>.json),
    checked before the run."""
    from mlxlab.fsutil import output_file

    folder = out.endswith(("/", os.sep)) or Path(out).expanduser().is_dir()
    return output_file(out if folder else f"{out}_{action}.json", f"{action}.json")


def _write(report: dict, out: str, action: str) -> Path:
    from mlxlab.fsutil import atomic_write_text

    path = _report_path(out, action)
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    return path


def run(cfg: DiagConfig) -> None:
    _report_path(cfg.out, cfg.action)  # a report that cannot be written fails before the work
    if cfg.action == "parity":
        from mlxlab.diag import parity

        report = parity.run(cfg)
        print(f"report: {_write(report, cfg.out, 'parity')}")
        ok = report["passed"]
    elif cfg.action == "leak":
        from mlxlab.diag import leak

        report = leak.run(cfg)
        path = _write(report, cfg.out, "leak")
        png = leak.plot(report, path.with_suffix(".png"))
        print(f"report: {path}" + (f", {png}" if png else ""))
        ok = report["passed"]
    elif cfg.action == "profile":
        from mlxlab.diag import profile

        report = profile.run(cfg)
        print(profile.table(report))
        path = _write(report, cfg.out, "profile")
        png = profile.plot(report, path.with_suffix(".png"))
        print(f"report: {path}" + (f", {png}" if png else ""))
        ok = True
    elif cfg.action == "decode":
        from mlxlab.diag import decode

        report = decode.run(cfg)
        print(decode.table(report))
        print(f"report: {_write(report, cfg.out, 'decode')}")
        ok = True
    else:
        from mlxlab.diag import memory

        report = memory.sweep(
            cfg.model, cfg.lengths, cfg.modes, dtype=cfg.dtype, lora_type=cfg.lora_type
        )
        print(memory.table(report))
        path = _write(report, cfg.out, "memory")
        png = memory.plot(report, path.with_suffix(".png"))
        print(f"report: {path}" + (f", {png}" if png else ""))
        ok = not any("error" in r for rows in report["results"].values() for r in rows.values())
    if not ok:
        sys.exit(1)


def main(argv: list[str]) -> None:
    run_hydra("diag", argv, run, positional=("action",))
