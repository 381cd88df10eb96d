"""Per-place decision data for the chunk task: one example per place a topic may start (each
exchange after the first), prompt = the exchange before + the exchange at it + the sentence-vector
similarity, completion = "new" / "same". Natural hand-annotated ShareGPT conversations only.

    python experiments/chunk_seg4/place_decisions/build.py OUT_DIR

writes OUT_DIR/{train,val,dev}_{places.jsonl,cases.json} (they hold ShareGPT text: never
committed) and OUT_DIR/sft/{train,valid}.jsonl for `mlxlab train data.train=OUT_DIR/sft`
(experiments/chunk_seg4/place-decisions.md)."""

import json
import random
import sys
from pathlib import Path

import numpy as np

import mlxlab  # noqa
from mlxlab.embed.model import Embedder
from mlxlab.tasks.chunk.prompt import shown
from mlxlab.tasks.chunk.segments import VectorCache, text_vectors
from mlxlab.tasks.chunk.sharegpt import annotated_cases, natural_cases
from mlxlab.tasks.chunk.shifts import exchanges, similarities

CAP = 128  # each message's first tokens that are embedded (the detector's default: 256)
VEC = {}

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
EXP = Path(__file__).resolve().parent.parent  # experiments/chunk_seg4


def cases_of(path, name):
    convs = json.loads(Path(path).read_text())["conversations"]
    pool = [{"id": c, "parts": v["parts"], "n_messages": v["messages"]} for c, v in convs.items()]
    gold = {
        c: {"chunks": [{"start": a, "end": b, "label": lab} for a, b, lab in v["chunks"]]}
        for c, v in convs.items()
    }
    return natural_cases(pool, gold, 0, name=name)


def clip(t, head, tail=0):
    t = " ".join(t.split())
    if len(t) <= head + tail + 5:
        return t
    return t[:head] + " [...] " + (t[-tail:] if tail else "")


def places(case, emb):
    msgs = shown(case["messages"])
    groups = exchanges(msgs)
    uu = [m["uuid"] for m in msgs]
    starts = {uu.index(c["start_message_uuid"]) for c in case["chunks"]}
    vec = np.stack([VEC[m["text"]] for m in msgs])
    sims = similarities(groups, vec)
    med = float(np.median(sims)) if len(sims) else 1.0
    out = []
    for j in range(1, len(groups)):
        prev, cur = groups[j - 1], groups[j]

        def block(g, ulen, ahead, atail):
            lines = []
            for i in g:
                m = msgs[i]
                if m["sender"] != "assistant":
                    lines.append("User: " + clip(m["text"], ulen))
                else:
                    lines.append("Assistant: " + clip(m["text"], ahead, atail))
            return "\n".join(lines)

        p = (
            "Two consecutive turns of a chat with an assistant.\n\n"
            f"EARLIER TURN\n{block(prev, 300, 350, 150)}\n\n"
            f"NEXT TURN\n{block(cur, 400, 300, 0)}\n\n"
            f"Sentence-vector similarity of the two turns: {sims[j - 1]:.2f} (this chat's median: {med:.2f}).\n"
            "Does the next turn start a new topic, or go on with the earlier one's? Answer new or same."
        )
        out.append(
            {
                "case": case["id"],
                "place": cur[0],
                "gold": int(cur[0] in starts),
                "sim": float(sims[j - 1]),
                "median": med,
                "prompt": p,
            }
        )
    return out


emb = Embedder("all-minilm-l6-v2")
sets = {
    "train": cases_of(EXP / "natural_train_more.json", "more")
    + cases_of(EXP / "natural_train_long.json", "long"),
    "val": annotated_cases("train"),
    "dev": annotated_cases("dev"),
}
texts = sorted(
    {m["text"] for n in ("dev", "val", "train") for c in sets[n] for m in shown(c["messages"])}
)
print("texts", len(texts), flush=True)
for n in ("dev", "val", "train"):
    t = sorted({m["text"] for c in sets[n] for m in shown(c["messages"])})
    VEC.update(
        zip(
            t,
            text_vectors(
                emb,
                t,
                CAP,
                VectorCache("all-minilm-l6-v2"),
                chunk=256,
                log=lambda x: print(x, flush=True),
            ),
            strict=False,
        )
    )
for name, cases in sets.items():
    rows = [r for c in cases for r in places(c, emb)]
    (OUT / f"{name}_places.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    json.dump(cases, open(OUT / f"{name}_cases.json", "w"))
    print(
        name,
        len(cases),
        "cases",
        len(rows),
        "places",
        sum(r["gold"] for r in rows),
        "starts",
        flush=True,
    )

rng = random.Random(0)
tr = [json.loads(line) for line in open(OUT / "train_places.jsonl")]
pos = [r for r in tr if r["gold"]]
neg = [r for r in tr if not r["gold"]]
rng.shuffle(neg)
sel = pos + neg[: len(pos)]
rng.shuffle(sel)
d = OUT / "sft"
d.mkdir(exist_ok=True)
(d / "train.jsonl").write_text(
    "".join(
        json.dumps({"prompt": r["prompt"], "completion": "new" if r["gold"] else "same"}) + "\n"
        for r in sel
    )
)
va = [json.loads(line) for line in open(OUT / "val_places.jsonl")]
(d / "valid.jsonl").write_text(
    "".join(
        json.dumps({"prompt": r["prompt"], "completion": "new" if r["gold"] else "same"}) + "\n"
        for r in va[:120]
    )
)
print("sft train", len(sel), "valid", min(120, len(va)))
