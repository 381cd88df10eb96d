"""Regenerate the bundled quickstart dataset (mlxlab/data/quickstart/{train,valid}.jsonl).

    python scripts/make_quickstart_data.py

Chat examples from real text that ships with Python: "What does `module.function` do?" answered
with the first sentence of the function's docstring. Modules are split between train and valid,
so validation measures the learned answer style on functions never seen in training.
Deterministic for a given Python version; the committed files are the reference.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

TRAIN_MODULES = [
    "json",
    "os.path",
    "textwrap",
    "string",
    "random",
    "statistics",
    "shutil",
    "heapq",
    "bisect",
    "itertools",
    "functools",
    "math",
    "operator",
    "copy",
    "base64",
    "binascii",
    "zlib",
    "glob",
    "fnmatch",
    "calendar",
    "html",
    "urllib.parse",
    "difflib",
    "pprint",
    "struct",
    "secrets",
    "uuid",
    "gzip",
]
VALID_MODULES = ["re", "time", "hashlib", "colorsys", "keyword", "locale", "shlex"]
SYSTEM = "You are a concise Python reference. Answer in one sentence."
OUT = Path(__file__).resolve().parents[1] / "mlxlab" / "data" / "quickstart"


def first_sentence(doc: str) -> str | None:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else None
    if not sentence or len(sentence) < 20 or len(sentence) > 200 or "(" in sentence[:1]:
        return None
    return sentence


def examples(modules: list[str]) -> list[dict]:
    rows = []
    for name in modules:
        mod = importlib.import_module(name)
        for fname, obj in sorted(vars(mod).items()):
            if fname.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            if getattr(obj, "__module__", name) not in (name, mod.__name__, None):
                continue
            sentence = first_sentence(inspect.getdoc(obj) or "")
            if sentence:
                rows.append(
                    {
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"What does `{name}.{fname}` do?"},
                            {"role": "assistant", "content": f"`{name}.{fname}`: {sentence}"},
                        ]
                    }
                )
    return rows


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for split, modules in (("train", TRAIN_MODULES), ("valid", VALID_MODULES)):
        rows = examples(modules)
        with (OUT / f"{split}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{split}: {len(rows)} examples")


if __name__ == "__main__":
    main()
