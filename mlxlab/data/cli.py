"""Build task datasets offline.

    python -m mlxlab data chunk out=data/chunk                   # 300/8/24 conversations
    python -m mlxlab data chunk out=data/chunk chunk.train=1000 'chunk.topic_weights=[1,1]' chunk.seed=1

Writes, atomically: <split>.cases.json (whole conversations with their gold chunks, what `eval
chunk` reads), <split>.jsonl in mlx-lm's chat format (what `train data.train=DIR` reads; a
conversation longer than chunk.window_chars, or of more than chunk.window_messages messages, as
overlapping windows) and build.json (the
settings and the histograms it prints: gold chunks, messages and length per conversation).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxlab.cli import run_hydra
from mlxlab.config import DataBuildConfig
from mlxlab.errors import UserError


def run(cfg: DataBuildConfig) -> Path:
    from mlxlab.data import chunk

    out = Path(cfg.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not cfg.force:
        raise UserError(f"{out} exists and is not empty; force=true replaces it")
    out = chunk.write_dataset(out, cfg.chunk)
    built = json.loads((out / "build.json").read_text())
    for split, st in built["stats"].items():
        n = sum(1 for line in (out / f"{split}.jsonl").read_text().splitlines() if line.strip())
        print(
            f"{split}: {st['cases']} conversations ({n} training examples), median "
            f"{st['median_length']} / longest {st['max_length']} chars, "
            f"{st['single_chunk_share']:.0%} single-chunk"
        )
    print()
    print(chunk.stats_markdown(built["stats"]))
    print(out)
    return out


def main(argv: list[str]) -> None:
    run_hydra("data", argv, run, positional=("task",))
