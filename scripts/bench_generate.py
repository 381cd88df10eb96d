"""Generation speed: mlx-lm vs mlxlab (now and, optionally, at an earlier commit), one run.

    python scripts/bench_generate.py [--model gemma3-270m] [--prompt-tokens 256] [--max-tokens 64]
                                     [--rounds 3] [--before REV]

Sides, each measured in its own process (the BLAS choice is per process), alternating so machine
noise hits all of them; medians are compared:
- `mlx-lm`: plain mlx-lm as a user of `mlx_lm.load` runs it (bf16 weights as stored, MLX's
  bundled BLAS); imports no mlxlab.
- `mlx-lm-f32`: mlx-lm matched to mlxlab's settings: float32 and mlxlab's BLAS, mlx-lm's own
  code for every product (`zoo.load(decode_kernel=False)` is `mlx_lm.load` + the cast).
- `before`: mlxlab at REV (a git worktree under the system temp dir), with --before.
- `mlxlab`: this checkout.
Prints prompt and decode tok/s, the ratios to mlx-lm and mlx-lm-f32, and the decode bound:
bytes a step reads (every weight once, a tied LM head counted as such) over the bandwidth
`diag decode` measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MEASURE = r"""
import json, sys
side = sys.argv[1]
if side == "mlx-lm":
    from mlx_lm import load
    model, tokenizer = load(sys.argv[2])
else:
    import mlxlab
    from mlxlab.models.zoo import load
    kw = {"decode_kernel": False} if side == "mlx-lm-f32" else {}
    model, tokenizer = load(sys.argv[2], dtype="auto", **kw)
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


def measure(side: str, model_dir: str, prompt_tokens: int, max_tokens: int, path=None) -> dict:
    # `python -c` puts the working directory first on sys.path: an earlier commit's mlxlab is
    # imported by running in its worktree (the editable install's finder comes after it).
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, side, model_dir, str(prompt_tokens), str(max_tokens)],
        capture_output=True,
        text=True,
        check=True,
        cwd=path or REPO,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def worktree(rev: str) -> Path:
    """A checkout of `rev` (reused when it is already there)."""
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"mlxlab-bench-{sha}"
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha],
            check=True,
            capture_output=True,
        )
    return path


def decode_bound(model_dir: str) -> dict:
    """Bytes a float32 decode step reads and the bandwidth-bound tok/s."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxlab.diag.decode import measure_bandwidth
    from mlxlab.models.zoo import load

    model, _ = load(model_dir, dtype="auto", decode_kernel=False)
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    del model
    mx.clear_cache()
    bw = measure_bandwidth()
    return {
        "step_mb": nbytes / 1e6,
        "gbps": bw["all_threads_gbps"],
        "tok_per_s": bw["all_threads_gbps"] * 1e9 / nbytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", help="also measure mlxlab at this git revision")
    args = ap.parse_args()

    import mlxlab  # noqa: F401
    from mlxlab.models.zoo import resolve

    model_dir = str(resolve(args.model))
    sides = {"mlx-lm": ("mlx-lm", None), "mlx-lm-f32": ("mlx-lm-f32", None)}
    if args.before:
        sides["before"] = ("mlxlab", worktree(args.before))
    sides["mlxlab"] = ("mlxlab", None)
    runs = {side: [] for side in sides}
    for i in range(args.rounds):
        for side, (kind, path) in sides.items():
            r = measure(kind, model_dir, args.prompt_tokens, args.max_tokens, path)
            runs[side].append(r)
            print(
                f"round {i + 1} {side:<10} prompt {r['prompt_tps']:8.1f} tok/s  "
                f"decode {r['decode_tps']:6.2f} tok/s  peak {r['peak_gb']:.2f} GB",
                flush=True,
            )
    med = {
        side: {
            k: statistics.median(r[k] for r in rs) for k in ("prompt_tps", "decode_tps", "peak_gb")
        }
        for side, rs in runs.items()
    }
    bound = decode_bound(model_dir)
    print(
        f"\nmodel {args.model}, prompt {args.prompt_tokens} tokens, decode {args.max_tokens} tokens, "
        f"median of {args.rounds}" + (f"; before = {args.before}" if args.before else "")
    )
    print(f"{'':<12}{'prompt tok/s':>14}{'decode tok/s':>14}{'peak GB':>10}{'of bound':>10}")
    for side, m in med.items():
        print(
            f"{side:<12}{m['prompt_tps']:>14.1f}{m['decode_tps']:>14.2f}{m['peak_gb']:>10.2f}"
            f"{m['decode_tps'] / bound['tok_per_s']:>10.0%}"
        )
    print(
        f"float32 decode bound: {bound['step_mb']:.0f} MB per step at {bound['gbps']:.1f} GB/s "
        f"= {bound['tok_per_s']:.1f} tok/s"
    )
    ours = med["mlxlab"]
    for peer in [s for s in med if s != "mlxlab"]:
        print(
            f"ratio mlxlab/{peer}: prompt {ours['prompt_tps'] / med[peer]['prompt_tps']:.2f}x, "
            f"decode {ours['decode_tps'] / med[peer]['decode_tps']:.2f}x"
        )


if __name__ == "__main__":
    main()
