"""Score per-place decisions: P(new) from a decision adapter (or none), threshold chosen on val,
boundary F1 per case on val and dev; the detector's rule on the same places.

    python experiments/chunk_seg4/place_decisions/score.py OUT_DIR ADAPTER|- [OUT.json] [val,dev]
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

# isort: off
import mlxlab  # noqa: F401 (before mlx.core: mlxlab loads the fast CPU BLAS)
import mlx.core as mx

# isort: on
from places import detector, f1s  # (this folder: the script's own)

from mlxlab.config import DEFAULT_MODEL
from mlxlab.lora import io as lora_io
from mlxlab.models.zoo import load
from mlxlab.train.losses import hidden_states, lm_head

D = Path(sys.argv[1])
adapter = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
out = Path(sys.argv[3]) if len(sys.argv) > 3 else None
sets = sys.argv[4].split(",") if len(sys.argv) > 4 else ["val", "dev"]
model, tok = load(DEFAULT_MODEL)
if adapter:
    lora_io.load(model, adapter)
model.eval()


def first_id(word, prompt_ids):
    full = tok.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": word}],
        return_dict=False,
    )
    pre = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, return_dict=False
    )
    return full[len(pre)]


NEW, SAME = first_id("new", None), first_id("same", None)
print("token ids", NEW, SAME, tok.decode([NEW]), tok.decode([SAME]), flush=True)


def p_new(rows):
    res = []
    t0 = time.time()
    for k, r in enumerate(rows):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        h = hidden_states(model, mx.array([ids]))[0]
        lg = lm_head(model, h[-1:])[0]
        a, b = lg[NEW].item(), lg[SAME].item()
        res.append(1 / (1 + np.exp(b - a)))
        if k % 100 == 0:
            print(f"  {k}/{len(rows)} {time.time() - t0:.0f}s", flush=True)
    return res


def auc(scores, gold):
    pos = [s for s, g in zip(scores, gold, strict=False) if g]
    neg = [s for s, g in zip(scores, gold, strict=False) if not g]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return round(wins / (len(pos) * len(neg)), 3)


def places_pr(rows, decide):
    tp = sum(1 for r in rows if decide(r) and r["gold"])
    fp = sum(1 for r in rows if decide(r) and not r["gold"])
    fn = sum(1 for r in rows if not decide(r) and r["gold"])
    return {"precision": round(tp / max(1, tp + fp), 3), "recall": round(tp / max(1, tp + fn), 3)}


res = {}
for name in sets:
    cases = json.load(open(D / f"{name}_cases.json"))
    rows = [json.loads(line) for line in open(D / f"{name}_places.jsonl")]
    if adapter or "--base" in sys.argv:
        ps = p_new(rows)
        for r, p in zip(rows, ps, strict=False):
            r["p"] = p
    res[name] = rows
    print(
        name,
        "detector",
        f1s(cases, rows, detector),
        places_pr(rows, detector),
        "one chunk",
        f1s(cases, rows, lambda r: False),
        flush=True,
    )
    print(
        name,
        "AUC of -similarity",
        auc([-r["sim"] for r in rows], [r["gold"] for r in rows]),
        "AUC of median-similarity",
        auc([r["median"] - r["sim"] for r in rows], [r["gold"] for r in rows]),
        flush=True,
    )
    if "p" in rows[0]:
        print(
            name,
            "AUC of P(new)",
            auc([r["p"] for r in rows], [r["gold"] for r in rows]),
            flush=True,
        )
if "p" in res[sets[0]][0]:
    val_cases = json.load(open(D / f"{sets[0]}_cases.json"))
    grid = [round(x, 2) for x in np.arange(0.05, 0.96, 0.05)]
    scores = {t: f1s(val_cases, res[sets[0]], lambda r, t=t: r["p"] > t) for t in grid}
    best = max(grid, key=lambda t: scores[t]["f1"])
    print(
        sets[0], "by threshold", {t: (s["f1"], s["multi"], s["chunks"]) for t, s in scores.items()}
    )
    print("chosen on", sets[0], "t =", best, scores[best])
    for name in sets[1:]:
        cases = json.load(open(D / f"{name}_cases.json"))
        print(
            name,
            f"adapter at t={best:.2f}",
            f1s(cases, res[name], lambda r: r["p"] > best),
            places_pr(res[name], lambda r: r["p"] > best),
        )
        print(name, "adapter at 0.5", f1s(cases, res[name], lambda r: r["p"] > 0.5))
    if out:
        json.dump(
            {
                k: [
                    {kk: r[kk] for kk in ("case", "place", "gold", "sim", "median", "p")} for r in v
                ]
                for k, v in res.items()
            },
            open(out, "w"),
        )
