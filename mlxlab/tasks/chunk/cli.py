"""The chunk task's verbs: `data chunk` builds its dataset, `eval chunk` scores a model on it.

    python -m mlxlab data chunk out=data/chunk                     # 300/8/24 conversations
    python -m mlxlab data chunk out=data/chunk train=1000 'topic_weights=[1,1]' seed=1

    python -m mlxlab eval chunk                                     # base gemma3-270m, test split
    python -m mlxlab eval chunk adapter=outputs/chunk_seg4/<run>    # a run dir means its final adapter
    python -m mlxlab eval chunk data=data/chunk split=valid cases=8 batch_size=1 out=valid.jsonl
    python -m mlxlab eval chunk constrained=true    # also decoded under the answer's grammar
    python -m mlxlab eval chunk data=my_chats.json adapter=RUN   # your own exported chats
    python -m mlxlab eval chunk adapter=RUN decisions=true   # teacher-forced: which decisions fail
    python -m mlxlab eval chunk adapter=RUN shifts=all-minilm-l6-v2   # boundaries from sentence vectors

`data=` is a dataset directory (its `<split>.cases.json`) or a JSON file of cases, `[{id, name,
uuid?, messages: [{uuid, sender, text}], chunks?}]`: without gold `chunks` only `ref` and
`strict` are scored. Every conversation is read in windows of a few messages (`window_messages`,
at most `max_prompt_tokens` each) and their answers merged (windows.py). Greedy decoding;
per-case results (output, scores, repairs) go to `out` as JSONL and the summary table to stdout
(with `constrained=true` a second row, "<model>, constrained", from a second decode of the split
under the answer's grammar: its chunks follow the messages in order; a window where the grammar
refused the model's own top token is merged as unread, and the log says in how many it did; its
cases go next to `out`, named `<stem>.constrained.jsonl`; with `shifts=MODEL` one more row,
"<model>, shift boundaries", decoded under the grammar whose chunks start where the topic-shift
detector of shifts.py says, the model writing only the labels, into `<stem>.shifts.jsonl`, and a
line with the detector's own boundary F1). With an adapter from a chunk-task run, and unless set:
the dataset that run trained on, windows as long as its training prompts and of as many
messages, and the run's own max_tokens, so its table is reproduced. Without either, the chunk
dataset built with its defaults.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from mlxlab.errors import UserError
from mlxlab.fsutil import output_file
from mlxlab.tasks.chunk import dataset
from mlxlab.tasks.chunk.config import (
    WINDOW_MESSAGES,
    ChunkBuildConfig,
    ChunkEvalConfig,
    EvalSettings,
    check_window_messages,
)

log = logging.getLogger(__name__)


def evaluate(cfg: ChunkEvalConfig) -> dict:
    """`eval chunk`: the summary, printed as a table (per-case rows to `out`)."""
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load
    from mlxlab.tasks.chunk.evaluate import evaluate_model
    from mlxlab.tasks.chunk.metrics import PASSES, table
    from mlxlab.tasks.chunk.report import detector_note, overruled_note

    run_dir = task_run(lora_io.resolve_dir(cfg.adapter)) if cfg.adapter else None
    data = Path(cfg.data).expanduser() if cfg.data else None
    if data is None and run_dir is not None:
        data = run_data(run_dir)  # the adapter's own dataset: its test topics are unseen
        if data is not None:
            log.info(f"data={data}: the adapter's task run's dataset")
    if data is None:
        data = dataset.write_dataset(Path(tempfile.mkdtemp(prefix="mlxlab-chunk-")) / "data")
    if cfg.decisions:
        return decisions(cfg, data)
    cfg.max_tokens = max_tokens_for(cfg, run_dir)
    records = dataset.read_split(data, cfg)  # read (and fail on bad data) before the model loads
    out = output_file(cfg.out, f"eval_chunk_{cfg.split}.jsonl")  # and a bad out= too
    model, tokenizer = load(cfg.model, cfg.dtype)
    name = cfg.model
    if cfg.adapter:
        lora_io.load(model, cfg.adapter)
        name += f" + {lora_io.resolve_dir(cfg.adapter)}"
    if run_dir is not None and not cfg.max_prompt_tokens:
        trained = trained_window(run_dir, tokenizer)
        if trained:
            cfg.max_prompt_tokens = trained
            log.info(f"max_prompt_tokens={trained}: the windows the adapter was trained on")
    if not cfg.window_messages:
        trained_data = run_data(run_dir) if run_dir is not None else None
        inherited = (run_eval_setting(run_dir, "window_messages") if run_dir else 0) or (
            dataset.built_window_messages(trained_data) if trained_data is not None else 0
        )
        cfg.window_messages = inherited or WINDOW_MESSAGES
        if inherited:
            log.info(f"window_messages={inherited}: the adapter's training windows")
            check_window_messages(
                inherited,
                cfg.window_overlap,
                source="window_messages is the adapter's run's: set window_messages, or lower "
                "window_overlap",
            )
    summary = evaluate_model(
        model, tokenizer, records, cfg, out, "chunk", dataset.training_labels(data)
    )
    print(table({name: summary}))
    log.info(
        f"per-case results: {out} ({summary['seconds']:.0f} s; "
        f"peak memory {summary['peak_mem_gb']:.2f} GB)"
    )
    for key, tag in PASSES.items():
        if key in summary:
            c = summary[key]
            log.info(
                f"{tag} per-case results: {c['results']} ({c['seconds']:.0f} s)" + overruled_note(c)
            )
    if detector_note(summary):
        print(detector_note(summary))
    return summary


def decisions(cfg: ChunkEvalConfig, data: Path) -> dict:
    """`decisions=true`: teacher-forced decision accuracy on `<data>/<split>.jsonl`."""
    from mlxlab.fsutil import atomic_write_text
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load
    from mlxlab.tasks.chunk import probes

    path = data / f"{cfg.split}.jsonl"
    if not path.is_file():
        raise UserError(
            f"decisions=true reads a dataset directory's {cfg.split}.jsonl (the windows as "
            f"training writes them; python -m mlxlab data chunk): no {path}"
        )
    examples = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
            text = ex["messages"][1]["content"]
            probes.boundary_places(text, json.loads(text)["chunks"])  # the data's own layout
            if not isinstance(ex["messages"][0]["content"], str):
                raise TypeError
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise UserError(
                f"{path}:{n}: not a chunk-task example (a chat record whose answer is laid out "
                "as the chunk data writes it)"
            ) from None
        examples.append(ex)
    if not examples:
        raise UserError(f"{path}: no examples")
    examples = examples[: cfg.cases or None]
    out = output_file(cfg.out, f"decisions_chunk_{cfg.split}.json")
    model, tokenizer = load(cfg.model, cfg.dtype)
    if cfg.adapter:
        lora_io.load(model, cfg.adapter)
    result = probes.decision_accuracy(model, tokenizer, examples)
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    print(probes.decisions_table(result))
    log.info(f"counts: {out}")
    return result


def task_run(adapter_dir: Path) -> Path | None:
    """The chunk-task run directory an adapter came from (its final adapter or one of its
    checkpoints; the run's config.yaml names a task), or None."""
    import yaml

    for run in (adapter_dir, adapter_dir.parent, adapter_dir.parent.parent):
        path = run / "config.yaml"
        if path.is_file():
            try:
                saved = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError:
                return None
            task = saved.get("task") if isinstance(saved, dict) else None
            return run if isinstance(task, dict) and task.get("name") else None
    return None


def run_data(run_dir: Path) -> Path | None:
    """The dataset directory a task run trained on: its data.train (a directory, or a file's
    directory), else `<run>/data`; None when neither holds a train.jsonl."""
    import yaml

    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        train = ((saved.get("data") or {}).get("train")) if isinstance(saved, dict) else None
    except (OSError, yaml.YAMLError, AttributeError):
        train = None
    for cand in ([Path(train).expanduser()] if train else []) + [run_dir / "data"]:
        cand = dataset.dataset_dir(cand)
        if (cand / "train.jsonl").is_file():
            return cand
    return None


def max_tokens_for(cfg: ChunkEvalConfig, run_dir: Path | None) -> int:
    """cfg.max_tokens, or when it is 0: the adapter's task run's task.eval.max_tokens (so
    `eval chunk adapter=RUN` decodes as the run did), else EvalSettings' default."""
    if cfg.max_tokens:
        return cfg.max_tokens
    trained = run_eval_setting(run_dir, "max_tokens") if run_dir is not None else 0
    if trained:
        log.info(f"max_tokens={trained}: the adapter's run evaluated with it")
    return trained or EvalSettings.max_tokens


def run_eval_setting(run_dir: Path, key: str) -> int:
    """A chunk-task run's task.eval.<key> from its config.yaml (an int), 0 when it has none."""
    import yaml

    try:
        task = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("task") or {}
        return max(0, int(((task.get("eval") or {}).get(key)) or 0))
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
        return 0


def trained_window(run_dir: Path, tokenizer) -> int:
    """The window budget an adapter's chunk-task run used: its task.eval.max_prompt_tokens, else
    the longest prompt of its training examples (`training_window`), else 0 (auto): an adapter
    trained on windows reads a long conversation in windows of that length."""
    set_to = run_eval_setting(run_dir, "max_prompt_tokens")
    data = run_data(run_dir)
    return set_to or (dataset.training_window(data, tokenizer) if data is not None else 0)


def source_count(split: str, part) -> str:
    """One split of a source as `data chunk` prints it ("train 400 (from 800 chats)")."""
    if not isinstance(part, dict):
        return f"{split} {part}"
    chats = part.get("source_chats")
    return f"{split} {part['conversations']}" + (f" (from {chats} chats)" if chats else "")


def build(cfg: ChunkBuildConfig) -> Path:
    """`data chunk`: write the dataset into `out`; print its counts and histograms."""
    out = Path(cfg.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not cfg.force:
        raise UserError(f"{out} exists and is not empty; force=true replaces it")
    out = dataset.write_dataset(out, cfg.data(), log=log.info)
    built = json.loads((out / "build.json").read_text())
    for name, parts in built.get("sources", {}).items():
        print(f"source {name}: " + ", ".join(source_count(k, v) for k, v in parts.items()))
    for split, st in built["stats"].items():
        n = sum(1 for line in (out / f"{split}.jsonl").read_text().splitlines() if line.strip())
        print(
            f"{split}: {st['cases']} conversations ({n} training examples), median "
            f"{st['median_length']} / longest {st['max_length']} chars, "
            f"{st['single_chunk_share']:.0%} single-chunk"
        )
    print()
    print(dataset.stats_markdown(built["stats"]))
    print(out)
    return out
