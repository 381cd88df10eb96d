"""A logistic combination of the detector's similarity features and the decision adapter's
P(new), fit on validation (its weights and threshold), applied to dev.

    python experiments/chunk_seg4/place_decisions/combine.py OUT_DIR SCORES.json

(SCORES.json: what score.py wrote with an adapter: each place's similarity, median and P(new).)
"""

import json
import sys

import numpy as np
from places import f1s  # (this folder: the script's own)

D, SCORES = sys.argv[1], sys.argv[2]
P = json.load(open(SCORES))
CASES = {n: json.load(open(f"{D}/{n}_cases.json")) for n in ("val", "dev")}


def features(rows, with_p):
    out = []
    for r in rows:
        x = [r["sim"], r["median"] - r["sim"]]
        if with_p:
            p = min(max(r["p"], 1e-6), 1 - 1e-6)
            x.append(np.log(p / (1 - p)))
        out.append(x)
    return np.array(out)


def fit(x, y, steps=3000, lr=0.1, l2=1e-3):
    """Logistic regression by gradient descent on standardized features."""
    mu, sd = x.mean(0), x.std(0) + 1e-9
    z = (x - mu) / sd
    w, b = np.zeros(z.shape[1]), 0.0
    for _ in range(steps):
        g = 1 / (1 + np.exp(-(z @ w + b))) - y
        w -= lr * (z.T @ g / len(y) + l2 * w)
        b -= lr * g.mean()
    return (lambda x: 1 / (1 + np.exp(-(((x - mu) / sd) @ w + b)))), w


for with_p in (False, True):
    predict, w = fit(features(P["val"], with_p), np.array([r["gold"] for r in P["val"]]))
    for name in ("val", "dev"):
        for r, q in zip(P[name], predict(features(P[name], with_p)), strict=True):
            r["q"] = q
    grid = [round(t, 2) for t in np.arange(0.1, 0.9, 0.05)]
    on_val = {t: f1s(CASES["val"], P["val"], lambda r, t=t: r["q"] > t) for t in grid}
    best = max(grid, key=lambda t: on_val[t]["f1"])
    dev = f1s(CASES["dev"], P["dev"], lambda r, t=best: r["q"] > t)
    what = "similarity and P(new)" if with_p else "similarity only"
    print(what, "weights", np.round(w, 2), "t", best, "val", on_val[best], "dev", dev)
