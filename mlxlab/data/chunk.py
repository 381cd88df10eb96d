"""The chunk task's data: conversations stitched from real text with known topic boundaries.

Source: the Python language reference topics that ship with CPython (`pydoc_data.topics`, the
text `help("assert")` shows). Each topic has a title ('The "assert" statement') and paragraphs.
A conversation takes a few topics, several consecutive paragraphs of each, and turns every
paragraph into a message from a named sender with a uuid; the gold answer has one chunk per
topic, labelled from its title. Topics are split between train/valid/test, so no topic seen in
training appears in evaluation. Everything is deterministic for a seed.
"""

from __future__ import annotations

import json
import random
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from mlxlab.config import ChunkDataConfig
from mlxlab.errors import UserError

SYSTEM = (
    "You segment conversations into topical chunks. Answer with JSON only: "
    '{"chunks":[{"start_message_uuid":"...","end_message_uuid":"...","label":"..."}]}.'
)
INSTRUCTIONS = (
    "Split the conversation below into contiguous chunks, one per topic, covering every "
    "message in order. Give each chunk a short, specific label (2-12 words)."
)
SENDERS = ["alice", "bob", "carol", "dave", "erin", "frank"]


@dataclass
class Topic:
    key: str
    label: str
    paragraphs: list[str]


def load_topics() -> list[Topic]:
    """The reference topics with at least three usable paragraphs, in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = topics[key].strip()
        title, _, body = text.partition("\n")
        label = " ".join(title.replace('"', "").split())
        paragraphs = []
        for p in re.split(r"\n\s*\n", body):
            p = p.strip()
            if not p or set(p) <= set("*=-"):
                continue
            p = " ".join(p.split()) if not p.startswith("   ") else p
            paragraphs.append(p)
        if len(paragraphs) >= 3 and 2 <= len(label.split()) <= 12:
            out.append(Topic(key, label, paragraphs))
    return out


def split_topics(topics: list[Topic], seed: int, fractions=(0.7, 0.15)) -> dict[str, list[Topic]]:
    order = topics[:]
    random.Random(seed).shuffle(order)
    n_train = int(len(order) * fractions[0])
    n_valid = int(len(order) * fractions[1])
    return {
        "train": order[:n_train],
        "valid": order[n_train : n_train + n_valid],
        "test": order[n_train + n_valid :],
    }


def make_conversation(topics: list[Topic], rng: random.Random, cfg: ChunkDataConfig) -> dict:
    """One example: messages, the rendered conversation, and the gold chunks."""
    chosen = rng.sample(topics, rng.randint(cfg.min_topics, min(cfg.max_topics, len(topics))))
    messages, chunks = [], []
    for topic in chosen:
        n = rng.randint(
            min(cfg.min_messages, len(topic.paragraphs)),
            min(cfg.max_messages, len(topic.paragraphs)),
        )
        start = rng.randint(0, len(topic.paragraphs) - n)
        ids = []
        for text in topic.paragraphs[start : start + n]:
            mid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            messages.append(
                {
                    "sender": rng.choice(SENDERS),
                    "uuid": mid,
                    "text": text[: cfg.max_paragraph_chars],
                }
            )
            ids.append(mid)
        chunks.append(
            {"start_message_uuid": ids[0], "end_message_uuid": ids[-1], "label": topic.label}
        )
    return {"messages": messages, "chunks": chunks}


def render(messages: list[dict]) -> str:
    return "\n---\n".join(f"[{m['sender']}] (uuid: {m['uuid']})\n{m['text']}" for m in messages)


def to_chat(example: dict) -> dict:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{INSTRUCTIONS}\n\n{render(example['messages'])}"},
            {"role": "assistant", "content": json.dumps({"chunks": example["chunks"]})},
        ]
    }


def build(cfg: ChunkDataConfig | None = None) -> dict[str, list[dict]]:
    """{split: [example, ...]}; every rendered conversation stays under `cfg.max_chars`."""
    cfg = cfg or ChunkDataConfig()
    parts = split_topics(load_topics(), cfg.seed)
    out = {}
    for split in ("train", "valid", "test"):
        rng = random.Random(f"{cfg.seed}-{split}")
        rows, tries = [], 0
        while len(rows) < getattr(cfg, split):
            ex = make_conversation(parts[split], rng, cfg)
            tries += 1
            if len(render(ex["messages"])) <= cfg.max_chars:
                rows.append(ex)
            elif tries > 100 * getattr(cfg, split) + 1000:
                raise UserError(
                    f"max_chars={cfg.max_chars} is too small: almost no {split} "
                    "conversation fits; raise it or lower max_topics/max_messages"
                )
        out[split] = rows
    return out


def write_jsonl(out_dir, cfg: ChunkDataConfig | None = None) -> Path:
    """Write train/valid/test.jsonl (chat format, what `train` reads) and build.json under `out_dir`."""
    from dataclasses import asdict

    from mlxlab.fsutil import atomic_dir

    cfg = cfg or ChunkDataConfig()

    def write(tmp: Path) -> None:
        for split, rows in build(cfg).items():
            with (tmp / f"{split}.jsonl").open("w") as f:
                for row in rows:
                    f.write(json.dumps(to_chat(row)) + "\n")
        (tmp / "build.json").write_text(
            json.dumps({"task": "chunk", **asdict(cfg)}, indent=1) + "\n"
        )

    return atomic_dir(Path(out_dir), write)


def case_from_chat(record: dict) -> tuple[list[dict], list[str], list[dict]]:
    """(prompt messages, message uuids in order, gold chunks) of one chat-format example."""
    messages = record["messages"]
    uuids = re.findall(r"\(uuid: ([0-9a-f-]+)\)", messages[1]["content"])
    gold = json.loads(messages[-1]["content"])["chunks"]
    return messages[:-1], uuids, gold
