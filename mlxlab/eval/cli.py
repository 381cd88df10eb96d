"""Evaluate a model, with or without an adapter, on a task's split.

    python -m mlxlab eval chunk                                     # base gemma3-270m, test split
    python -m mlxlab eval chunk adapter=outputs/chunk_seg4/<run>    # a run dir means its final adapter
    python -m mlxlab eval chunk data=data/chunk split=valid cases=8 batch_size=1 out=valid.jsonl
    python -m mlxlab eval chunk constrained=true    # also decoded under the answer's JSON schema
    python -m mlxlab eval chunk data=my_chats.json adapter=RUN   # your own exported chats

`data=` is a dataset directory (its `<split>.cases.json`) or a JSON file of cases, `[{id, name,
uuid?, messages: [{uuid, sender, text}], chunks?}]`: without gold `chunks` only `ref` and
`strict` are scored. A conversation longer than `max_prompt_tokens` is read in overlapping windows
of messages and their answers merged (mlxlab/eval/chunk.py). Greedy decoding; per-case results (output, scores, repairs) go to `out` as JSONL and the
summary table to stdout (with `constrained=true` a second row, "<model>, constrained", from a
second decode of the split under the answer's JSON schema; its cases go next to `out`, named
`<stem>.constrained.jsonl`). Without `data=`, the chunk dataset is built with its defaults (the same
one `train +exp=chunk_seg4` trains and tests on).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from mlxlab.cli import run_hydra
from mlxlab.config import EvalConfig

log = logging.getLogger(__name__)


def run(cfg: EvalConfig) -> dict:
    from mlxlab.data import chunk
    from mlxlab.eval import chunk as ev
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load

    data = Path(cfg.data).expanduser() if cfg.data else None
    if data is None:
        data = chunk.write_dataset(Path(tempfile.mkdtemp(prefix="mlxlab-chunk-")) / "data")
    records = ev.read_split(data, cfg)  # read (and fail on bad data) before loading the model
    model, tokenizer = load(cfg.model, cfg.dtype)
    name = cfg.model
    if cfg.adapter:
        lora_io.load(model, cfg.adapter)
        name += f" + {lora_io.resolve_dir(cfg.adapter)}"
    if cfg.adapter and not cfg.max_prompt_tokens:
        trained = trained_window(lora_io.resolve_dir(cfg.adapter))
        if trained:
            cfg.max_prompt_tokens = trained
            log.info(f"max_prompt_tokens={trained}: the windows the adapter's task run used")
    out = Path(cfg.out or f"eval_{cfg.task}_{cfg.split}.jsonl").expanduser().absolute()
    summary = ev.evaluate_model(
        model, tokenizer, records, cfg, out, cfg.task, ev.training_labels(data)
    )
    print(ev.table({name: summary}))
    log.info(f"per-case results: {out} ({summary['seconds']:.0f} s)")
    if "constrained" in summary:
        c = summary["constrained"]
        log.info(f"constrained per-case results: {c['results']} ({c['seconds']:.0f} s)")
    return summary


def trained_window(adapter_dir: Path) -> int:
    """task.eval.max_prompt_tokens of the chunk-task run an adapter came from (its run
    directory's config.yaml, next to `adapter/`), or 0: an adapter trained on windows reads long
    conversations in windows of the same length by default."""
    import yaml

    for path in (adapter_dir / "config.yaml", adapter_dir.parent / "config.yaml"):
        if path.is_file():
            try:
                task = (yaml.safe_load(path.read_text()) or {}).get("task") or {}
                return int(((task.get("eval") or {}).get("max_prompt_tokens")) or 0)
            except (yaml.YAMLError, AttributeError, TypeError, ValueError):
                return 0
    return 0


def main(argv: list[str]) -> None:
    run_hydra("eval", argv, run, positional=("task",))
