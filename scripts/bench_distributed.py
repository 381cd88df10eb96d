"""Training on 1 vs 2 processes: tokens/s, bytes moved per step, peak memory per rank, bubble.

    python scripts/bench_distributed.py [--model gemma3-270m] [--iters 5] [--segment-size 4]
                                        [--only NAME ...] [--two-threads] [--out DIR]

Every run is `python -m mlxlab train` on the bundled quickstart data (LoRA rank 8 on every
projection), validation and checkpoints off, in its own processes; the two-process runs start
their ranks as `mlx.launch --backend ring -n 2` does (MLX_RANK + a loopback hostfile):

  one process, 1 BLAS thread    the per-process baseline (one core)
  data parallel, 2 x 1 thread   each rank trains on half of every batch of 4
  segmented, 1 thread           backward.mode=segmented, batches of 1 x grad_accum 4 micro-batches
  pipeline, 2 x 1 thread        the same with backward.pipeline=true (segments on the two ranks)
  (--two-threads adds one process with 2 BLAS threads, both cores, for each mode: on an idle
  machine the fair single-run baseline; on a loaded one OpenBLAS's spinning threads make it
  pathologically slow, measured 200+ s/step for gemma3-270m here)

tok/s counts the real tokens of the steps after the first (warm-up) one over their wall time
(metrics.jsonl `elapsed_s`); bytes moved are what each rank handed to collectives and sends
per step (payload: a ring all_sum puts 2 (N-1)/N of it on the wire per rank). On a 2-core
machine the two ranks share the cores the single process has: this measures the overhead of
running as two processes (communication, duplicated work, idle waits), not a speed-up; with
two machines each rank would have a machine's cores. Writes <out>/bench_distributed.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.dist import start_ranks, wait_all  # noqa: E402

DATA = ROOT / "mlxlab" / "data" / "quickstart"


def common(model: str, iters: int) -> list[str]:
    return [
        "train",
        f"model={model}",
        f"iters={iters}",
        "val_every=0",
        "save_every=0",
        "log_every=1",
        "wandb=disabled",
        f"data.train={DATA}",
        "data.max_seq_length=256",
        "lora.targets=[q,k,v,o,gate,up,down]",
        "lora.rank=8",
        "lora.scale=20.0",
    ]


RUNS = [
    # name, processes, BLAS threads per process, extra overrides
    ("one process, 2 threads", 1, 2, ["batch_size=4"]),
    ("one process, 1 thread", 1, 1, ["batch_size=4"]),
    ("data parallel, 2 x 1 thread", 2, 1, ["batch_size=4"]),
    ("segmented, 2 threads", 1, 2, ["batch_size=1", "grad_accum=4", "backward.mode=segmented"]),
    ("segmented, 1 thread", 1, 1, ["batch_size=1", "grad_accum=4", "backward.mode=segmented"]),
    (
        "pipeline, 2 x 1 thread",
        2,
        1,
        ["batch_size=1", "grad_accum=4", "backward.mode=segmented", "backward.pipeline=true"],
    ),
]


def selected(args) -> list:
    runs = [r for r in RUNS if args.two_threads or r[2] == 1 or r[1] > 1]
    return [r for r in runs if not args.only or any(s in r[0] for s in args.only)]


def run(name, procs, threads, extra, args, tmp: Path) -> dict:
    out = tmp / name.replace(" ", "_").replace(",", "")
    cmd = [*common(args.model, args.iters), *extra, f"out_dir={out}"]
    if "backward.mode=segmented" in extra:
        cmd.append(f"backward.segment_size={args.segment_size}")
    env = {"OPENBLAS_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    if procs == 1:
        done = subprocess.run(
            [sys.executable, "-m", "mlxlab", *cmd],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        codes, err = [done.returncode], done.stderr
    else:
        results = wait_all(start_ranks(cmd, procs, tmp, env), timeout=3600)
        codes, err = [r[0] for r in results], results[0][2]
    if any(codes):
        raise SystemExit(f"{name} failed ({codes}):\n{err[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    timed = steps[1:]
    seconds = timed[-1]["elapsed_s"] - steps[0]["elapsed_s"]
    summary = json.loads((out / "summary.json").read_text())
    row = {
        "name": name,
        "processes": procs,
        "blas_threads": threads,
        "s_per_step": seconds / len(timed),
        "tok_per_s": sum(r["tokens"] for r in timed) / seconds,
        "trained_tok_per_s": sum(r["trained_tokens"] for r in timed) / seconds,
        "peak_mem_gb_ranks": summary.get("peak_mem_gb_ranks", [summary["peak_mem_gb"]]),
        "wall_s": round(time.perf_counter() - t0, 1),
        "final_loss": steps[-1]["loss"],
    }
    sent = [r["sent_mb_ranks"] for r in timed if "sent_mb_ranks" in r]
    if sent:  # per step, each rank (the records' windows are one step each)
        row["sent_mb_per_step_ranks"] = [sum(s[k] for s in sent) / len(sent) for k in range(procs)]
    if "bubble_ranks" in summary:
        row["bubble_ranks"] = summary["bubble_ranks"]
        row["weights_gb_ranks"] = summary["weights_gb_ranks"]
        row["weights_gb_model"] = summary["weights_gb_model"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| run | s/step | tok/s | peak GB per rank | MB sent per step per rank | bubble |",
        "|---|---:|---:|---|---|---|",
    ]
    for r in rows:
        peaks = " / ".join(f"{p:.2f}" for p in r["peak_mem_gb_ranks"])
        sent = " / ".join(f"{s:.2f}" for s in r.get("sent_mb_per_step_ranks", [])) or "-"
        bubble = " / ".join(f"{b:.0%}" for b in r.get("bubble_ranks", [])) or "-"
        lines.append(
            f"| {r['name']} | {r['s_per_step']:.2f} | {r['tok_per_s']:.0f} | {peaks} | {sent} "
            f"| {bubble} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--segment-size", type=int, default=4, help="layers per segment (segmented runs)"
    )
    p.add_argument("--only", nargs="*", help="run names to keep (substring match)")
    p.add_argument("--two-threads", action="store_true", help="add the 2-thread single runs")
    p.add_argument("--out", default=str(ROOT / "experiments" / "distributed"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, procs, threads, extra in selected(args):
            rows.append(run(name, procs, threads, extra, args, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench_distributed.py " + " ".join(sys.argv[1:])
    (out / "bench_distributed.json").write_text(
        json.dumps({"command": command.strip(), "model": args.model, "runs": rows}, indent=2) + "\n"
    )
    text = table(rows)
    (out / "bench_distributed.md").write_text(f"`{command.strip()}`\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
