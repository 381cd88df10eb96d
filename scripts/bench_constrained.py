"""Grammar-constrained decoding speed: the same prompt decoded with and without a JSON-schema
constraint (mlxlab/grammar.py), on one model in one process.

    python scripts/bench_constrained.py [--model gemma3-270m] [--rounds 3] [--max-tokens 256]
                                        [--batch 8] [--batch-rounds 1] [--json FILE]

- single stream: mlx-lm's `generate_step`, greedy, the constraint as its logits processor; the
  constrained run stops at end-of-sequence (the grammar allows nothing else once the JSON is
  complete), the unconstrained run decodes the same number of tokens (end-of-sequence ignored).
  Decode tok/s = (tokens - 1) / (last token - first token); rounds alternate, medians compared
  (target: constrained >= 0.9x unconstrained);
- compile: `grammar.json_schema(schema)` (schema -> checked llguidance grammar; first call, and
  the same schema again, whose check grammar.py caches), the tokenizer's
  llguidance vocabulary (built once per tokenizer) and `grammar.constrain` (a matcher);
- per token: the constraint's matcher work, consuming the sampled token and computing the mask
  (llguidance, on the CPU) and unpacking it to one bool per vocabulary entry;
- batched lane (`--batch` rows, 0 skips): one step's matcher work for that many rows in states
  along the answer (each consumes a token and computes its mask), one row after another as
  mlx-lm's `GenerationBatch` runs per-row processors, and with llguidance's `consume_token_par` +
  `LLExecutor` for all rows at once; and `BatchGenerator` decode tok/s over all rows, each row
  with its own constraint vs none (`--batch-rounds` runs each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "date": {"type": "string", "format": "date"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 40},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 40},
                        "city": {"type": "string", "maxLength": 30},
                        "country": {"enum": ["US", "DE", "FR", "GB", "JP"]},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "unit_price": {
                        "type": "number",
                        "minimum": 0,
                        "maximum": 10000,
                        "multipleOf": 0.01,
                    },
                },
                "required": ["description", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 80},
    },
    "required": ["invoice_id", "date", "customer", "items", "paid"],
    "additionalProperties": False,
}

TEXT = (
    "Invoice INV-0042, dated 2024-03-15, for Maria Lopez (maria@example.com), 12 Harbour Road, "
    "Dover, United Kingdom. She bought 3 ceramic mugs at 8.50 each, 1 teapot at 24.00 and 2 packs "
    "of green tea at 6.25 each. Paid by card. Deliver after 5 pm."
)
MESSAGES = [
    {
        "role": "system",
        "content": "Extract the invoice as JSON matching this schema:\n" + json.dumps(SCHEMA),
    },
    {"role": "user", "content": TEXT},
]


def timed_constraint(grammar, tokenizer, n_vocab: int, log: dict):
    """A fresh constraint whose matcher calls are timed into `log` (seconds per call)."""
    from mlxlab.grammar import constrain

    c = constrain(grammar, tokenizer, n_vocab)
    advance, allowed = c.advance, c.allowed

    def timed_advance(tokens):
        t0 = time.perf_counter()
        advance(tokens)
        log["consume"].append(time.perf_counter() - t0)

    def timed_allowed():
        t0 = time.perf_counter()
        out = allowed()
        log["mask"].append(time.perf_counter() - t0)
        return out

    c.advance, c.allowed = timed_advance, timed_allowed
    return c


def single(model, prompt, eos: set[int], n: int, processor=None) -> tuple[list[int], float]:
    """(tokens, decode tok/s) of one greedy `generate_step` run; with a processor it stops at
    end-of-sequence, else it decodes exactly n tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, stamps = [], []
    procs = [processor] if processor else None
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=procs):
        stamps.append(time.perf_counter())
        if processor is not None and tok in eos:
            break
        tokens.append(tok)
    return tokens, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def batched(model, tokenizer, prompt, n: int, rows: int, processors=None) -> dict:
    """BatchGenerator over `rows` copies of the prompt: (decode tok/s over all rows, tokens)."""
    from mlx_lm.generate import BatchGenerator

    stops = [[t] for t in tokenizer.eos_token_ids] if processors else None
    gen = BatchGenerator(
        model, stop_tokens=stops, completion_batch_size=rows, prefill_batch_size=rows
    )
    try:
        gen.insert([list(prompt)] * rows, [n] * rows, logits_processors=processors)
        with gen.stats() as st:
            while gen.next_generated():
                pass
    finally:
        gen.close()
    return {
        "tps": st.generation_tokens / st.decode_time if st.decode_time else 0.0,
        "tokens": st.generation_tokens,
    }


def mask_step(
    grammar, tokenizer, n_vocab: int, answer: list[int], rows: int, steps: int = 16
) -> dict:
    """One batched step's matcher work for `rows` rows spread along `answer` (ms, median over
    `steps` successive steps): each row consumes its next answer token and computes its mask,
    one row after another (as mlx-lm's GenerationBatch calls per-row processors), or all rows at
    once with llguidance's `consume_token_par` + `LLExecutor` (its thread pool)."""
    import llguidance
    import numpy as np

    from mlxlab.grammar import constrain

    span = max(len(answer) - steps, 1)
    offsets = [i * span // rows for i in range(rows)]

    def spread():
        cs = []
        for at in offsets:
            c = constrain(grammar, tokenizer, n_vocab)
            c.advance(answer[:at])
            cs.append(c)
        return cs

    one_by_one, together = spread(), spread()
    words = one_by_one[0].mask.size
    buf = np.zeros((rows, words), dtype=np.int32)
    executor = llguidance.LLExecutor()
    seq, par, same = [], [], True
    for s in range(steps):
        nxt = [answer[at + s] for at in offsets]
        t0 = time.perf_counter()
        for c, tok in zip(one_by_one, nxt, strict=True):
            c.advance([tok])
            c.allowed()
        seq.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        executor.consume_token_par([(c.matcher, tok) for c, tok in zip(together, nxt, strict=True)])
        executor.unsafe_compute_mask_ptr(
            [(c.matcher, i) for i, c in enumerate(together)], buf.ctypes.data, words * 4, rows
        )
        par.append(time.perf_counter() - t0)
        same = same and all(np.array_equal(buf[i], one_by_one[i].mask) for i in range(rows))
    return {
        "sequential_ms": 1e3 * statistics.median(seq),
        "parallel_ms": 1e3 * statistics.median(par),
        "parallel_equals_sequential": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-rounds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import mlxlab  # noqa: F401  (BLAS before MLX)
    from mlxlab import grammar as G
    from mlxlab.models.zoo import load
    from mlxlab.tasks.chunk.evaluate import n_vocab as logits_width

    model, tokenizer = load(args.model)
    width = logits_width(model, tokenizer)
    eos = set(tokenizer.eos_token_ids)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)

    G.json_schema({"type": "object"})  # imports llguidance
    compile_s = []  # the first compile is cold; grammar.py caches the check of a repeated schema
    for _ in range(5):
        t0 = time.perf_counter()
        grammar = G.json_schema(SCHEMA)
        compile_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    G.vocab_for(tokenizer, width)
    vocab_s = time.perf_counter() - t0
    matcher_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        G.constrain(grammar, tokenizer, width)
        matcher_s.append(time.perf_counter() - t0)

    single(model, prompt, eos, 8)  # warm-up
    log = {"consume": [], "mask": []}
    runs = {"constrained": [], "unconstrained": []}
    answer: list[int] = []
    for i in range(args.rounds):
        answer, tps_c = single(
            model, prompt, eos, args.max_tokens, timed_constraint(grammar, tokenizer, width, log)
        )
        n = len(answer) + 1  # the answer and its end-of-sequence token
        _, tps_u = single(model, prompt, eos, n)
        runs["constrained"].append(tps_c)
        runs["unconstrained"].append(tps_u)
        print(
            f"round {i + 1}: {n} tokens, constrained {tps_c:6.2f} tok/s, unconstrained {tps_u:6.2f} tok/s",
            flush=True,
        )
    text = tokenizer.decode(answer)
    valid_json = True
    try:
        json.loads(text)
    except ValueError:
        valid_json = False
    med = {k: statistics.median(v) for k, v in runs.items()}
    per_token_ms = 1e3 * (statistics.median(log["consume"]) + statistics.median(log["mask"]))
    report = {
        "model": args.model,
        "prompt_tokens": len(prompt),
        "answer_tokens": len(answer) + 1,
        "rounds": args.rounds,
        "answer": text,
        "answer_is_json": valid_json,
        "decode_tps": med,
        "ratio": med["constrained"] / med["unconstrained"],
        "compile_ms": 1e3 * compile_s[0],
        "compile_again_ms": 1e3 * statistics.median(compile_s[1:]),
        "vocab_ms": 1e3 * vocab_s,
        "matcher_ms": 1e3 * statistics.median(matcher_s),
        "per_token_ms": {
            "consume": 1e3 * statistics.median(log["consume"]),
            "mask": 1e3 * statistics.median(log["mask"]),
            "total": per_token_ms,
            "mask_p90": 1e3 * sorted(log["mask"])[int(0.9 * (len(log["mask"]) - 1))],
        },
        "unconstrained_token_ms": 1e3 / med["unconstrained"],
    }
    if args.batch:
        report["batch"] = {
            "rows": args.batch,
            **mask_step(grammar, tokenizer, width, answer, args.batch),
        }
        b = {"constrained": [], "unconstrained": []}
        n = len(answer) + 1
        for _ in range(args.batch_rounds):
            procs = [[G.constrain(grammar, tokenizer, width)] for _ in range(args.batch)]
            b["constrained"].append(
                batched(model, tokenizer, prompt, args.max_tokens, args.batch, procs)["tps"]
            )
            b["unconstrained"].append(batched(model, tokenizer, prompt, n, args.batch)["tps"])
        bmed = {k: statistics.median(v) for k, v in b.items()}
        report["batch"].update(
            decode_tps=bmed,
            ratio=bmed["constrained"] / bmed["unconstrained"],
            step_ms=1e3 * args.batch / bmed["unconstrained"],
        )

    print(
        f"\nmodel {args.model}, prompt {len(prompt)} tokens, answer {len(answer) + 1} tokens "
        f"({'valid JSON' if valid_json else 'NOT JSON'}), median of {args.rounds}"
    )
    print(f"{'':<30}{'value':>12}")
    rows = [
        ("decode tok/s, unconstrained", f"{med['unconstrained']:.2f}"),
        ("decode tok/s, constrained", f"{med['constrained']:.2f}"),
        ("ratio (target >= 0.9)", f"{report['ratio']:.3f}x"),
        ("schema compile ms", f"{report['compile_ms']:.2f}"),
        ("same schema again ms", f"{report['compile_again_ms']:.2f}"),
        ("vocabulary build ms (once)", f"{report['vocab_ms']:.0f}"),
        ("matcher create ms", f"{report['matcher_ms']:.2f}"),
        ("per token: consume ms", f"{report['per_token_ms']['consume']:.3f}"),
        ("per token: mask ms", f"{report['per_token_ms']['mask']:.3f}"),
        ("per token: total ms", f"{per_token_ms:.3f}"),
        ("  vs a decode step ms", f"{report['unconstrained_token_ms']:.1f}"),
    ]
    if args.batch:
        bt = report["batch"]
        rows += [
            (f"batch {args.batch}: masks, one by one ms", f"{bt['sequential_ms']:.2f}"),
            (f"batch {args.batch}: masks, LLExecutor ms", f"{bt['parallel_ms']:.2f}"),
            (f"batch {args.batch}: decode step ms", f"{bt['step_ms']:.1f}"),
            (
                f"batch {args.batch}: tok/s unconstrained",
                f"{bt['decode_tps']['unconstrained']:.2f}",
            ),
            (f"batch {args.batch}: tok/s constrained", f"{bt['decode_tps']['constrained']:.2f}"),
            (f"batch {args.batch}: ratio", f"{bt['ratio']:.3f}x"),
        ]
    for name, value in rows:
        print(f"{name:<30}{value:>12}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
