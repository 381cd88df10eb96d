"""Generation speed: plain mlx-lm (its defaults) vs mlxlab, same model and prompt, one run.

    python scripts/bench_generate.py [--model gemma3-270m] [--prompt-tokens 256] [--max-tokens 64] [--rounds 3]

Each measurement runs in its own process (the BLAS choice is per process), alternating
mlx-lm / mlxlab so machine noise hits both; medians are compared. mlx-lm's side imports no
mlxlab: it loads the converted directory as a user of `mlx_lm.load` would (bf16 weights as
stored, MLX's bundled BLAS). Prints prompt and decode tok/s and their ratios (mlxlab / mlx-lm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MEASURE = r"""
import json, sys
use_mlxlab = sys.argv[1] == "mlxlab"
if use_mlxlab:
    import mlxlab
    from mlxlab.models.zoo import load
    model, tokenizer = load(sys.argv[2], dtype="auto")
else:
    from mlx_lm import load
    model, tokenizer = load(sys.argv[2])
import mlx.core as mx
from mlx_lm.generate import stream_generate
words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches near the old river bank ").split()
ids = tokenizer.encode(" ".join(words * 200))[: int(sys.argv[3])]
mx.reset_peak_memory()
for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=int(sys.argv[4])):
    pass
print(json.dumps({"prompt_tps": r.prompt_tps, "decode_tps": r.generation_tps,
                  "prompt_tokens": r.prompt_tokens, "decode_tokens": r.generation_tokens,
                  "peak_gb": mx.get_peak_memory() / 1e9}))
"""


def measure(side: str, model_dir: str, prompt_tokens: int, max_tokens: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, side, model_dir, str(prompt_tokens), str(max_tokens)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import mlxlab  # noqa: F401
    from mlxlab.models.zoo import resolve

    model_dir = str(resolve(args.model))
    runs = {"mlx-lm": [], "mlxlab": []}
    for i in range(args.rounds):
        for side in ("mlx-lm", "mlxlab"):
            r = measure(side, model_dir, args.prompt_tokens, args.max_tokens)
            runs[side].append(r)
            print(
                f"round {i + 1} {side:<7} prompt {r['prompt_tps']:8.1f} tok/s  "
                f"decode {r['decode_tps']:6.2f} tok/s  peak {r['peak_gb']:.2f} GB",
                flush=True,
            )
    med = {
        side: {
            k: statistics.median(r[k] for r in rs) for k in ("prompt_tps", "decode_tps", "peak_gb")
        }
        for side, rs in runs.items()
    }
    print(
        f"\nmodel {args.model}, prompt {args.prompt_tokens} tokens, decode {args.max_tokens} tokens, "
        f"median of {args.rounds}"
    )
    print(f"{'':<8}{'prompt tok/s':>14}{'decode tok/s':>14}{'peak GB':>10}")
    for side, m in med.items():
        print(f"{side:<8}{m['prompt_tps']:>14.1f}{m['decode_tps']:>14.2f}{m['peak_gb']:>10.2f}")
    ratio_p = med["mlxlab"]["prompt_tps"] / med["mlx-lm"]["prompt_tps"]
    ratio_d = med["mlxlab"]["decode_tps"] / med["mlx-lm"]["decode_tps"]
    print(
        f"ratio mlxlab/mlx-lm: prompt {ratio_p:.2f}x (target >= 8), decode {ratio_d:.2f}x (target >= 1.4)"
    )


if __name__ == "__main__":
    main()
