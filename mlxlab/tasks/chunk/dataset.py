"""The chunk task's dataset on disk: built once, read by training, evaluation and the report.

A dataset directory holds <split>.cases.json (whole conversations with their gold chunks, what
`eval chunk` reads), <split>.jsonl (chat examples, what `train` reads: each conversation in the
windows of windows.py `training_windows`, the gold clipped to each) and build.json (the
settings, the sources, the histograms).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxlab.errors import UserError
from mlxlab.tasks.chunk.config import ChunkDataConfig
from mlxlab.tasks.chunk.histogram import histogram
from mlxlab.tasks.chunk.prompt import answer, prompt, read_cases, shown
from mlxlab.tasks.chunk.scoring import norm_label
from mlxlab.tasks.chunk.windows import training_windows


def dataset_dir(train) -> Path:
    """The dataset directory a `data.train` names: itself when it is a directory, else the
    directory of the training file."""
    train = Path(train)
    return train if train.is_dir() else train.parent


def chat(case: dict, messages: list[dict] | None = None, chunks: list[dict] | None = None):
    """A chat-format training example: the prompt (for a window: its messages) and the gold
    answer (`chunks`, default the case's)."""
    gold = case["chunks"] if chunks is None else chunks
    return {
        "messages": [
            {"role": "user", "content": prompt(case, messages)},
            {"role": "assistant", "content": answer(gold)},
        ]
    }


def training_examples(case: dict, cfg: ChunkDataConfig) -> list[dict]:
    """The chat examples of one case (`training_windows`: evaluation reads the same windows,
    but fills them, `filled_windows`)."""
    return [chat(case, msgs, gold) for msgs, gold in training_windows(case, cfg)]


BINS = {
    "messages": (4, 10, 20, 40, 76, 10**9),
    "chunks": (1, 2, 3, 4, 6, 100),
    "length": (0, 1000, 2000, 4000, 8000, 16000, 32000, 10**9),
}


def stats(cases: list[dict], length=None, unit: str = "chars") -> dict:
    """Histograms of a split: messages, gold chunks and length (`length(case)`, default the
    prompt's characters) per conversation, with medians."""
    length = length or (lambda c: len(prompt(c)))
    lens = sorted(length(c) for c in cases)
    msgs = sorted(len(shown(c["messages"])) for c in cases)
    return {
        "cases": len(cases),
        "unit": unit,
        "median_length": lens[len(lens) // 2] if lens else 0,
        "max_length": lens[-1] if lens else 0,
        "median_messages": msgs[len(msgs) // 2] if msgs else 0,
        "single_chunk_share": sum(len(c["chunks"]) == 1 for c in cases) / max(len(cases), 1),
        "messages": histogram(msgs, BINS["messages"]),
        "chunks": histogram([len(c["chunks"]) for c in cases], BINS["chunks"]),
        "length": histogram(lens, BINS["length"]),
    }


def stats_markdown(per_split: dict[str, dict]) -> str:
    """The histograms as markdown tables, one column per split."""
    splits = list(per_split)
    unit = next(iter(per_split.values()))["unit"] if per_split else "chars"
    lines = []
    for key, title_ in (
        ("chunks", "gold chunks per conversation"),
        ("messages", "messages per conversation"),
        ("length", f"prompt length ({unit})"),
    ):
        lines += [f"| {title_} | " + " | ".join(splits) + " |", "|---" * (len(splits) + 1) + "|"]
        names = [name for name, _ in per_split[splits[0]][key]]
        for j, name in enumerate(names):
            lines.append(
                f"| {name} | " + " | ".join(str(per_split[s][key][j][1]) for s in splits) + " |"
            )
        lines.append("")
    lines.append(
        "| | "
        + " | ".join(splits)
        + " |\n|---"
        + "|---" * len(splits)
        + "|\n| median length | "
        + " | ".join(str(per_split[s]["median_length"]) for s in splits)
        + " |\n| longest | "
        + " | ".join(str(per_split[s]["max_length"]) for s in splits)
        + " |\n| single-chunk share | "
        + " | ".join(f"{per_split[s]['single_chunk_share']:.2f}" for s in splits)
        + " |"
    )
    return "\n".join(lines)


def sources(cfg: ChunkDataConfig, log=None) -> tuple[dict[str, list[dict]], dict]:
    """({split: cases}, what was built from what): documentation chats, joined ShareGPT chats,
    the natural training chats, and with `dev` the dev and export-like splits."""
    import time

    from mlxlab.tasks.chunk import docs_chats

    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    card: dict = {"sources": {}}
    counts = {"train": cfg.train, "valid": cfg.valid, "test": cfg.test}
    if any(counts.values()):
        docs = docs_chats.build(cfg)
        for split in splits:
            splits[split] += docs[split][: counts[split]]
        card["sources"]["docs"] = {k: len(v[: counts[k]]) for k, v in docs.items()}
        card["python"], card["numpy"] = platform_versions()
        card["topics"] = docs_chats.topics_digest()
    joined = {"train": cfg.sharegpt, "valid": cfg.sharegpt_valid, "test": cfg.sharegpt_test}
    if any(joined.values()):
        from mlxlab.embed.model import Embedder
        from mlxlab.tasks.chunk import joins, segments, sharegpt

        t0 = time.perf_counter()
        convs = sharegpt.load_conversations()
        embedder = Embedder(segments.EMBED_MODEL)
        card["sources"]["sharegpt"] = {}
        for split, n in joined.items():
            if n:
                budget = joins.sources_for(split, n)
                cases = joins.build(
                    split, n, cfg.seed, sources=budget, embedder=embedder, convs=convs, log=log
                )
                splits[split] += cases
                card["sources"]["sharegpt"][split] = {
                    "conversations": len(cases),
                    "source_chats": budget,
                    "segments": dict(segments.SEGMENT_STATS),
                }
        card["sharegpt"] = {
            "file": str(sharegpt.data_path().name),
            **sharegpt.LOAD_STATS.get(str(sharegpt.data_path()), {}),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    if cfg.natural:
        from mlxlab.tasks.chunk import sharegpt

        natural = sharegpt.annotated_cases("train", cfg.seed)
        splits["train"] += natural
        card["sources"]["natural"] = {"train": len(natural)}
    if cfg.dev:
        from mlxlab.tasks.chunk import sharegpt
        from mlxlab.tasks.chunk.prompt import read_cases

        splits["dev"] = sharegpt.annotated_cases("dev", cfg.seed)
        splits["export"] = read_cases(sharegpt.ANNOTATIONS / "export_like.json")
        card["sources"]["dev"] = {"dev": len(splits["dev"]), "export": len(splits["export"])}
    return splits, card


def platform_versions() -> tuple[str, str | None]:
    import platform

    from mlxlab.tasks.chunk import docs_chats

    return platform.python_version(), docs_chats.numpy_version()


def write_dataset(out_dir, cfg: ChunkDataConfig | None = None, log=None) -> Path:
    """Write, atomically, under `out_dir`: <split>.cases.json (whole conversations with gold, what
    `eval chunk` reads), <split>.jsonl (chat format, what `train` reads: each conversation in
    windows) and build.json (the settings, the sources and what came of them, the histograms)."""
    from dataclasses import asdict

    from mlxlab.fsutil import atomic_dir

    cfg = cfg or ChunkDataConfig()

    def write(tmp: Path) -> None:
        data, card = sources(cfg, log)
        per_split = {}
        for split, cases in data.items():
            (tmp / f"{split}.cases.json").write_text(json.dumps(cases, indent=1) + "\n")
            with (tmp / f"{split}.jsonl").open("w") as f:
                for case in cases:
                    for ex in training_examples(case, cfg):
                        f.write(json.dumps(ex) + "\n")
            per_split[split] = stats(cases)
        (tmp / "build.json").write_text(
            json.dumps({"task": "chunk", **asdict(cfg), **card, "stats": per_split}, indent=1)
            + "\n"
        )

    return atomic_dir(Path(out_dir), write)


def build_settings(data) -> dict:
    """A chunk dataset directory's build.json settings; {} without a readable one."""
    try:
        build = json.loads((Path(data) / "build.json").read_text())
    except (OSError, ValueError, TypeError):
        return {}
    return build if isinstance(build, dict) else {}


def built_window_messages(data) -> int:
    """A chunk dataset directory's `window_messages` (its build.json; 0 without one): the most
    messages its training examples hold, so the most an adapter trained on it reads at once."""
    try:
        return max(0, int(build_settings(data).get("window_messages") or 0))
    except (ValueError, TypeError):
        return 0


def read_split(data, settings) -> list[dict]:
    """The cases to evaluate: `data` a JSON file of cases (prompt.py `read_cases`), or
    a dataset directory and its `<settings.split>.cases.json`; the first `settings.cases` when
    set."""

    path = Path(data)
    if path.is_dir():
        path = path / f"{settings.split}.cases.json"
        if not path.is_file():
            raise UserError(
                f"no {path.name} in {data} (build the dataset: python -m mlxlab data chunk "
                "out=DIR; or pass data=FILE.json, a JSON list of cases)"
            )
    elif not path.is_file():
        raise UserError(f"data={data}: no such file or directory")
    cases = read_cases(path)
    return cases[: settings.cases] if settings.cases else cases


def training_labels(data) -> set[str] | None:
    """The gold labels of a dataset directory's train split (normalised), for the memorized-label
    share; None when `data` is not a dataset directory with one."""

    path = Path(data) / "train.cases.json"
    if not path.is_file():
        return None
    return {norm_label(c["label"]) for case in read_cases(path) for c in case.get("chunks") or []}


def training_window(data, tokenizer) -> int:
    """The longest prompt (in tokens, with the template's generation prompt) among a dataset
    directory's training examples (chat examples, or preference pairs or GRPO prompt records
    with a `messages` prompt): the window budget that reads a long conversation as the adapter
    trained on it; 0 when `data` has no train.jsonl."""
    path = Path(data) / "train.jsonl"
    if not path.is_file():
        return 0
    longest = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line) if line.strip() else {}
            messages = record["messages"]
            if "chosen" not in record and messages[-1].get("role") == "assistant":
                messages = messages[:-1]  # a chat example: the prompt is all but the answer
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            messages = None
        if not isinstance(messages, list) or not messages:
            continue  # no chat prompt
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        longest = max(longest, len(ids))
    return longest
