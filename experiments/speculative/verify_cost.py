"""The cost of one batched verify step of gemma3-270m as a function of (rows, positions per row).

    PYTHONPATH=. python experiments/speculative/verify_cost.py [--rows 1,2,4,8,16]
        [--positions 1,2,3,5,9,16] [--context 320] [--reps 5] [--avx512 1]

For each row count a BatchDecoder (the batched lane's own, on zoo.load's model: float32 with
the bf16 decode copies) prefills that many prompts of `context` tokens; then a step of each
positions count is timed in turn, round after round (interleaved, so a shared machine's load
falls on every cell alike), as a verify step does it: `speculative.forward` over [rows,
positions] inputs, each row's logprobs (`process`), argmax, and `rollback_rows` with rows
rejecting different counts (row i accepts i % positions drafts: the per-row shift is the
costly case). Positions 1 is a one-token step through the same code; `next` mlx-lm's own plain step
(`GenerationBatch.next`, what a step without drafts runs), the unit of the table. Prints ms medians and each
cell over the same rows' `next`, and `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--positions", default="1,2,3,5,9,16")
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--avx512", type=int, default=1, help="0: the kernel's AVX2 loops only")
    ap.add_argument("--json")
    args = ap.parse_args()

    import mlxlab  # noqa: F401, I001  (before mlx.core: MLX's fast BLAS)
    from mlxlab import kernels
    from mlxlab.decode import speculative as spec
    from mlxlab.decode import speculative_batch as sb
    from mlxlab.decode.batch import BatchDecoder, Row
    from mlxlab.decode.settings import DecodeSettings
    from mlxlab.models.zoo import load

    import mlx.core as mx

    model, tok = load("gemma3-270m")
    model.eval()
    if not args.avx512:
        kernels._load()[0].matvec_avx512(0)
    rows_list = [int(x) for x in args.rows.split(",")]
    pos_list = [int(x) for x in args.positions.split(",")]
    table: dict = {}
    for rows in rows_list:
        rng = random.Random(rows)
        d = BatchDecoder(model, set(tok.eos_token_ids), DecodeSettings(batch=rows))
        for _ in range(rows):
            prompt = [rng.randrange(1000, 20000) for _ in range(args.context)]
            d.add(Row(prompt, 100000, lambda t, lp: None, lambda f, t: None))
        while len(d.gen) < rows or len(d.prompt_batch):
            d.step()
        cache = d.gen.prompt_cache
        times: dict = {p: [] for p in pos_list}
        times["next"] = []
        for rep in range(args.reps + 1):  # the first round warms up
            t = time.perf_counter()
            d.gen.next()  # mlx-lm's own plain step (pipelined), what k = 0 runs
            mx.eval(d.gen._next_tokens)
            if rep:
                times["next"].append(time.perf_counter() - t)
            for p in pos_list:
                inputs = [[rng.randrange(1000, 20000) for _ in range(p)] for _ in range(rows)]
                t = time.perf_counter()
                sb.temporal_rows(cache)
                logits = spec.forward(model, inputs, cache)
                lps = [spec.process(logits[i], [], [], inputs[i]) for i in range(rows)]
                samples = mx.argmax(mx.concatenate(lps, axis=0), axis=-1)
                mx.eval(samples)
                samples.tolist()
                if p > 1:
                    sb.rollback_rows(cache, [p - 1 - (i % p) for i in range(rows)])
                    mx.eval([c.state for c in cache])
                if rep:
                    times[p].append(time.perf_counter() - t)
        table[rows] = {p: statistics.median(v) * 1000 for p, v in times.items()}
        print(
            f"rows {rows:>2}: " + "  ".join(f"{p}:{table[rows][p]:7.1f}" for p in pos_list) + " ms",
            flush=True,
        )
        del d, cache
        mx.clear_cache()
    print(f"\nover the same rows' plain step (mlx-lm's next()), avx512={args.avx512}:")
    print("| rows | " + " | ".join(f"{p} pos" for p in pos_list) + " |")
    print("|---" * (len(pos_list) + 1) + "|")
    for rows in rows_list:
        base = table[rows]["next"]
        print(f"| {rows} | " + " | ".join(f"{table[rows][p] / base:.2f}" for p in pos_list) + " |")
    print(f"status: {kernels.status()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"avx512": args.avx512, "context": args.context, "ms": table}, f, indent=1)


if __name__ == "__main__":
    main()
