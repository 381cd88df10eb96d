"""Regenerate the bundled GRPO prompts (mlxlab/data/grpo_json/{train,valid}.jsonl).

    python scripts/make_grpo_json_data.py

The task of `+exp=grpo_json`: answer 'Write a JSON object with the key "K".' with a JSON object
that has exactly that key and a non-empty string as its value, on one line. Each prompt is raw
text (a base model has no chat turns to speak of) with two worked examples before the request;
the rollouts stop at the first newline (grpo.stop), and the reward is the built-in `json`
against the record's schema (key required, string value, no other key). Keys are split between
train and valid, so validation measures the learned format on keys never trained on.
Deterministic; the committed files are the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

SHOTS = [("name", "Ada"), ("city", "Paris")]

TRAIN_KEYS = [
    "color", "animal", "country", "fruit", "planet", "sport", "language", "metal", "flower",
    "river", "mountain", "instrument", "vegetable", "bird", "tree", "ocean", "movie", "book",
    "song", "drink", "food", "game", "car", "brand", "company", "school", "street", "island",
    "desert", "insect", "fish", "gem", "spice", "dessert", "dance", "shape", "fabric", "tool",
    "weapon", "vehicle", "job", "hobby", "subject", "holiday", "season", "weather", "emotion",
    "mineral",
]  # fmt: skip
VALID_KEYS = [
    "author", "painter", "composer", "capital", "continent", "currency", "element", "galaxy",
    "herb", "lake", "mammal", "reptile",
]  # fmt: skip


def prompt(key: str) -> str:
    shots = "".join(
        f'Write a JSON object with the key "{k}".\n{json.dumps({k: v})}\n\n' for k, v in SHOTS
    )
    return shots + f'Write a JSON object with the key "{key}".\n'


def schema(key: str) -> dict:
    return {
        "type": "object",
        "properties": {key: {"type": "string", "minLength": 1}},
        "required": [key],
        "additionalProperties": False,
    }


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "mlxlab" / "data" / "grpo_json"
    out.mkdir(parents=True, exist_ok=True)
    for split, keys in (("train", TRAIN_KEYS), ("valid", VALID_KEYS)):
        assert not set(keys) & {k for k, _ in SHOTS}
        lines = [
            json.dumps({"prompt": prompt(k), "raw": True, "key": k, "schema": schema(k)})
            for k in keys
        ]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{out / split}.jsonl: {len(lines)} prompts")


if __name__ == "__main__":
    main()
