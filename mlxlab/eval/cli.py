"""Evaluate a model, with or without an adapter, on a task's split.

    python -m mlxlab eval chunk                                     # base gemma3-270m, test split
    python -m mlxlab eval chunk adapter=outputs/chunk_seg4/<run>    # a run dir means its final adapter
    python -m mlxlab eval chunk data=data/chunk split=valid cases=8 batch_size=1 out=valid.jsonl

Greedy decoding; per-case results (output, scores, repairs) go to `out` as JSONL and the
summary table to stdout. Without `data=`, the chunk dataset is built with its defaults (the same
one `train +exp=chunk_seg4` trains and tests on).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from mlxlab.config import EvalConfig, EvalSettings, run_hydra


def evaluate_model(model, tokenizer, records: list[dict], settings: EvalSettings, out: Path, label: str) -> dict:
    """Run the chunk evaluation on `records` (ev.read_split), write per-case JSONL to `out`;
    return the summary (+ seconds)."""
    import json

    from mlxlab.eval import chunk as ev
    from mlxlab.fsutil import atomic_write_text

    t0 = time.perf_counter()

    def progress(done, total):
        print(f"\r[{label}] {done}/{total} cases", end="\n" if done == total else "", file=sys.stderr)

    rows = ev.evaluate(model, tokenizer, records, settings.max_tokens, settings.batch_size, progress)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    return {**ev.summarize(rows), "seconds": round(time.perf_counter() - t0, 1), "results": str(out)}


def run(cfg: EvalConfig) -> dict:
    from mlxlab.data import chunk
    from mlxlab.eval import chunk as ev
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load

    data_dir = Path(cfg.data).expanduser() if cfg.data else None
    if data_dir is None:
        data_dir = chunk.write_jsonl(Path(tempfile.mkdtemp(prefix="mlxlab-chunk-")) / "data")
    records = ev.read_split(data_dir, cfg)  # read (and fail on a missing split) before loading the model
    model, tokenizer = load(cfg.model, cfg.dtype)
    name = cfg.model
    if cfg.adapter:
        lora_io.load(model, cfg.adapter)
        name += f" + {lora_io.resolve_dir(cfg.adapter)}"
    out = Path(cfg.out or f"eval_{cfg.task}_{cfg.split}.jsonl").expanduser().absolute()
    summary = evaluate_model(model, tokenizer, records, cfg, out, cfg.task)
    print(ev.table({name: summary}))
    print(f"per-case results: {out} ({summary['seconds']:.0f} s)", file=sys.stderr)
    return summary


def main(argv: list[str]) -> None:
    run_hydra("eval", argv, run, positional=("task",))
