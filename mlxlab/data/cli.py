"""Build task datasets offline.

    python -m mlxlab data chunk out=data/chunk                   # 400/16/24 conversations
    python -m mlxlab data chunk out=data/chunk chunk.train=1000 chunk.max_topics=4 chunk.seed=1

Writes train/valid/test.jsonl in mlx-lm's chat format (what `train data.train=DIR` reads) and
build.json (the settings), atomically.
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
    out = chunk.write_jsonl(out, cfg.chunk)
    for split in ("train", "valid", "test"):
        rows = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
        n_chunks = sum(len(json.loads(r["messages"][-1]["content"])["chunks"]) for r in rows)
        chars = sum(len(r["messages"][1]["content"]) for r in rows)
        print(
            f"{split}: {len(rows)} conversations, {n_chunks} chunks, {chars // len(rows)} chars on average"
        )
    print(out)
    return out


def main(argv: list[str]) -> None:
    run_hydra("data", argv, run, positional=("task",))
