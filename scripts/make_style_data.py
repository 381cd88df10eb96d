"""Regenerate the two contrasting style datasets (mlxlab/data/style_upper, style_lower).

    python scripts/make_style_data.py

The quickstart conversations with the assistant's answer rewritten: all upper case, or all lower
case without punctuation. Two adapters trained on them (`train +exp=style_upper`, `+exp=style_lower`)
answer visibly differently from one server (scripts/demo_adapters.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "mlxlab" / "data"
STYLES = {
    "style_upper": str.upper,
    "style_lower": lambda s: re.sub(r"[^\w\s]", "", s).lower(),
}


def main() -> None:
    for name, rewrite in STYLES.items():
        out = DATA / name
        out.mkdir(exist_ok=True)
        for split in ("train", "valid"):
            rows = []
            for line in (DATA / "quickstart" / f"{split}.jsonl").read_text().splitlines():
                row = json.loads(line)
                row["messages"][-1]["content"] = rewrite(row["messages"][-1]["content"])
                rows.append(json.dumps(row))
            (out / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
        print(out)


if __name__ == "__main__":
    main()
