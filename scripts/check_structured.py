"""Structured output on the real model: how often the answer validates, with and without the
grammar constraint (the cases of tests/helpers/schemas.py, what tests/test_structured_real.py
asserts).

    python scripts/check_structured.py [--model gemma3-270m] [--max-tokens 256] [--schemas N] [--serial] [--json FILE]

Each schema x prompt is decoded greedily, once under `mlxlab.grammar.constrain(json_schema(schema))`
and once without, as the test does: the first prompt of each schema with mlx-lm's
`generate_step`, the others together on mlx-lm's `BatchGenerator` with a constraint per row
(`--serial`: all with `generate_step`, ~2x slower). An answer is valid when the
whole text (a code fence allowed) is one JSON value that validates (jsonschema, formats
checked). An unconstrained decode stops as soon as its text can no longer be valid; a case's
prompts share the prefill of their common prefix (`schemas.decode_case`). Prints one line per
prompt and both rates.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--schemas", type=int, default=0, help="the first N schemas only; 0: all")
    ap.add_argument("--serial", action="store_true", help="every prompt through generate_step")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import mlxlab  # noqa: F401  (BLAS before MLX)
    from mlxlab.models.zoo import load
    from tests.helpers import schemas

    model, tokenizer = load(args.model)
    cases = schemas.CASES[: args.schemas] if args.schemas else schemas.CASES
    t0 = time.perf_counter()
    rows = []
    first = None if args.serial else 1  # prompts per schema through generate_step
    for case in cases:
        for row in schemas.decode_case(
            model, tokenizer, case, max_tokens=args.max_tokens, prompts=case.prompts[:first]
        ):
            rows.append({"schema": case, "decoder": "generate_step", **row})
    if not args.serial:
        rest = [(c, p) for c in cases for p in c.prompts[1:]]
        sides = {
            s: schemas.decode_batch(model, tokenizer, rest, s == "constrained", args.max_tokens)
            for s in schemas.SIDES
        }
        for i, (case, prompt) in enumerate(rest):
            rows.append(
                {
                    "schema": case,
                    "decoder": "BatchGenerator",
                    "prompt": prompt,
                    **{s: sides[s][i] for s in schemas.SIDES},
                }
            )
    for row in rows:
        case = row["schema"]
        for side in schemas.SIDES:
            row[side]["valid"] = schemas.valid(row[side]["text"], case.schema)
            row[side]["problem"] = schemas.problem(row[side]["text"], case.schema)
        row["schema"] = case.name
        c, u = row["constrained"], row["unconstrained"]
        print(
            f"{case.name:<12} {row['decoder']:<14} constrained {'valid' if c['valid'] else 'INVALID':<7} "
            f"({c['finish']}, {c['tokens']:3d} tok)  unconstrained "
            f"{'valid' if u['valid'] else 'invalid':<7} ({u['finish']}, {u['tokens']:3d} tok)  "
            f"{c['text'][:60]!r}"
        )
    rates = {side: sum(r[side]["valid"] for r in rows) for side in ("constrained", "unconstrained")}
    n = len(rows)
    print(
        f"\n{len({r['schema'] for r in rows})} schemas, {n} prompts, greedy, max_tokens {args.max_tokens}, "
        f"{time.perf_counter() - t0:.0f} s"
    )
    for side, ok in rates.items():
        print(f"{side:<14} {ok:3d}/{n} valid ({100 * ok / n:5.1f}%)")
    ended = sum(r["constrained"]["finish"] == "eos" for r in rows)
    print(f"constrained answers ended at end-of-sequence: {ended}/{n}")
    if args.json:
        args.json.write_text(json.dumps({"rates": rates, "n": n, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
