"""A GRPO run's results as markdown, from what the run wrote (metrics.jsonl, config.yaml,
completions.jsonl), for an experiment's README.

    python scripts/grpo_report.py RUN_DIR [--title TEXT] [--command TEXT] [--out FILE]

Reports the base policy's mean reward (the first step's rollouts, sampled before any update,
and the step-0 validation), the mean reward over windows of 10 steps, the first step where the
10-step moving mean reaches 0.9, every validation, completion lengths and the truncated share,
and the mean rollout / reference / update seconds per step; then a few completions of the first
and last steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def report(run: Path, title: str, command: str) -> str:
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    recs = read(run / "metrics.jsonl")
    steps = [r for r in recs if "reward" in r]
    vals = [r for r in recs if "val_reward" in r]
    g = cfg["grpo"]
    lines = [f"# {title}", "", "```bash", command, "```", ""]
    lines += [
        f"{cfg['model']} ({cfg['dtype']}), LoRA rank {cfg['lora']['rank']} on "
        f"{' '.join(cfg['lora']['targets'])}; GRPO loss `{g['loss']}`, {cfg['batch_size']} prompts "
        f"x {g['group_size']} completions a step (at most {g['max_tokens']} tokens, temperature "
        f"{g['temperature']}, stop {g['stop']!r}), rewards {g['rewards']}, beta {g['beta']}, "
        f"{g['updates']} update(s) per step, lr {cfg['optim']['lr']} ({cfg['optim']['schedule']}), "
        f"backward {cfg['backward']['mode']}; {len(steps)} steps.",
        "",
    ]
    first = steps[0]["reward"] if steps else float("nan")
    base_val = next((r["val_reward"] for r in vals if r["step"] == 0), None)
    moving = None
    for i in range(len(steps)):
        window = steps[max(0, i - 9) : i + 1]
        if len(window) == 10 and mean(r["reward"] for r in window) >= 0.9:
            moving = steps[i]["step"]
            break
    lines += [
        "| | |",
        "|---|---|",
        f"| base policy: step 1's rollouts (before any update) | {first:.3f} |",
    ]
    if base_val is not None:
        lines.append(f"| base policy: held-out prompts (step-0 validation) | {base_val:.3f} |")
    lines.append(
        "| first step whose 10-step moving mean reward is >= 0.9 | "
        + (f"{moving} |" if moving else "not reached |")
    )
    if steps:
        last = steps[-10:]
        lines.append(
            f"| mean reward of the last 10 steps | {mean(r['reward'] for r in last):.3f} |"
        )
    for r in vals:
        lines.append(f"| validation at step {r['step']} | {r['val_reward']:.3f} |")
    lines += ["", "| steps | reward | completion tokens | truncated | rollout s | update s |"]
    lines.append("|---|---|---|---|---|---|")
    for at in range(0, len(steps), 10):
        w = steps[at : at + 10]
        lines.append(
            f"| {w[0]['step']}-{w[-1]['step']} | {mean(r['reward'] for r in w):.3f} | "
            f"{mean(r['completion_len'] for r in w):.1f} | {mean(r['truncated'] for r in w):.2f} | "
            f"{mean(r['rollout_s'] for r in w):.1f} | {mean(r.get('update_s', 0) for r in w):.1f} |"
        )
    ref = [r["ref_s"] for r in steps if "ref_s" in r]
    if ref and g["beta"]:
        lines += [
            "",
            f"Reference and old-policy passes: {mean(ref):.1f} s a step on average.",
        ]
    comps = run / "completions.jsonl"
    rows = read(comps) if comps.is_file() else []
    if rows:
        for r in (rows[0], rows[-1]) if len(rows) > 1 else rows:
            lines += ["", f"Completions at step {r['step']} (reward, text):", ""]
            for c in r["completions"][:8]:
                text = c["text"].replace("|", "\\|").replace("\n", "\\n")
                lines.append(f"- {c['reward']:g}: `{text}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--title", default="GRPO run")
    p.add_argument("--command", default="python -m mlxlab train ...")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    text = report(a.run, a.title, a.command)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
