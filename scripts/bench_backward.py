"""Peak memory and seconds/step of each backward mode vs mlx-lm's grad checkpointing, one run.

    python scripts/bench_backward.py [--model gemma3-270m] [--lengths 512 1024 2048 4096]
                                     [--modes full checkpoint mlx_lm_gc seg1 seg2 seg4 auto]
                                     [--steps 1] [--target-gb 1.6] [--out bench_backward]

One LoRA step (rank 8 on q k v o gate up down of all layers) on one sequence of L tokens of real
text whose last quarter is the response; every (mode, L) in its own process after a warm-up step
(mlxlab/diag/memory.py, the same harness as `python -m mlxlab diag memory`). `mlx_lm_gc` is
mlx-lm's own step with its grad checkpointing, what `mlx_lm.lora --grad-checkpoint` runs, at the
same dtype and BLAS. Prints the table and the ratios at the longest length: segmented peak vs
mlx-lm's grad-checkpoint peak (target <= 0.5x) and segmented time vs the full backward
(target <= 1.3x). Writes <out>.json, <out>.md (the table) and <out>.png.

A preference step: `--modes dpo-full dpo-seg4 orpo-seg4` (one pair, each side L tokens).
`--model` takes any model spec, a quantized one too (`models quantize`); `--lora-type dora|full`
trains DoRA or the projections' own weights instead of LoRA.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["full", "checkpoint", "mlx_lm_gc", "seg1", "seg2", "seg4", "auto"],
    )
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--target-gb", type=float, default=1.6)
    ap.add_argument("--out", default="bench_backward")
    ap.add_argument(
        "--lora-type", default="lora", choices=["lora", "dora", "full"], help="what is trained"
    )
    args = ap.parse_args()

    import mlxlab  # noqa: F401
    from mlxlab.diag import memory

    report = memory.sweep(
        args.model,
        args.lengths,
        args.modes,
        args.steps,
        target_gb=args.target_gb,
        progress=lambda line: print(line, flush=True),
        lora_type=args.lora_type,
    )
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [memory.table(report)]
    res = report["results"]
    ok = [
        L
        for L in args.lengths
        if all(
            "error" not in res.get(m, {}).get(str(L), {"error": 1}) for m in ("full", "mlx_lm_gc")
        )
    ]
    if ok:
        L = str(max(ok))
        for mode in [m for m in args.modes if m.startswith("seg") or m == "auto"]:
            r = res[mode].get(L, {})
            if "peak_gb" in r:
                lines.append(
                    f"{mode} @ {L}: peak {r['peak_gb'] / res['mlx_lm_gc'][L]['peak_gb']:.2f}x mlx-lm "
                    f"grad-checkpoint (target <= 0.5), time "
                    f"{r['s_per_step'] / res['full'][L]['s_per_step']:.2f}x full backward (target <= 1.3)"
                )
    text = "\n".join(lines)
    print("\n" + text)
    Path(f"{args.out}.md").write_text("```\n" + text + "\n```\n")
    png = memory.plot(report, Path(f"{args.out}.png"))
    print(f"wrote {args.out}.json, {args.out}.md" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
