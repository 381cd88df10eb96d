"""Two contrasting adapters from one server: train them, serve them, ask through the openai SDK.

    python scripts/demo_adapters.py [--steps 50] [--port 8097]

Trains `+exp=style_upper` and `+exp=style_lower` on gemma3-270m (reusing runs already in
outputs/style_*/demo), starts `python -m mlxlab serve adapters.upper=RUN adapters.lower=RUN`, and
asks the same questions with `adapter` none / upper / lower / upper+lower. Then checks the round
trip: the served greedy answer with `upper` equals mlx-lm's generate with that adapter loaded
in-process. Prints a markdown table (experiments/adapter_styles/README.md holds one run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx

import mlxlab  # noqa: F401  (BLAS before MLX)

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What does `re.split` do?",
    "What does `time.sleep` do?",
    "What does `hashlib.sha256` do?",
]
SYSTEM = "You are a concise Python reference. Answer in one sentence."


def train(style: str, steps: int) -> Path:
    run = REPO / "outputs" / f"style_{style}" / "demo"
    if not (run / "adapter" / "adapters.safetensors").is_file():
        cmd = [
            sys.executable,
            "-m",
            "mlxlab",
            "train",
            f"+exp=style_{style}",
            f"out_dir={run}",
            f"iters={steps}",
            "wandb=disabled",
        ]
        if run.exists():
            cmd.append("resume=true")
        subprocess.run(cmd, check=True, cwd=REPO)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--port", type=int, default=8097)
    args = ap.parse_args()
    runs = {style: train(style, args.steps) for style in ("upper", "lower")}

    import openai

    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxlab",
            "serve",
            f"port={args.port}",
            f"adapters.upper={runs['upper']}",
            f"adapters.lower={runs['lower']}",
            f"adapter_root={REPO / 'outputs'}",
        ],
        cwd=REPO,
    )
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-demo")
        print(
            client.models.list().data[0].id,
            [a["id"] for a in httpx.get(url + "/v1/adapters").json()["adapters"]],
        )
        answers = {}
        print("\n| question | adapter | answer |\n|---|---|---|")
        for q in QUESTIONS:
            for spec in ("none", "upper", "lower", "upper+lower"):
                r = client.chat.completions.create(
                    model="gemma3-270m",
                    temperature=0,
                    max_tokens=40,
                    extra_body={"adapter": spec},
                    messages=[
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": q},
                    ],
                )
                answers[q, spec] = r.choices[0].message.content
                print(f"| {q} | {spec} | {answers[q, spec].strip()} |".replace("\n", " "))
        stats = httpx.get(url + "/stats").json()["adapters"]["mounted"]
        print("\nrequests per adapter:", {m["id"]: m["requests"] for m in stats})
    finally:
        server.terminate()
        server.wait(60)

    from mlx_lm import generate

    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load

    model, tok = load("gemma3-270m")
    lora_io.load(model, runs["upper"])
    q = QUESTIONS[0]
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        add_generation_prompt=True,
    )
    local = generate(model, tok, prompt, max_tokens=40)
    same = local == answers[q, "upper"]
    print(
        f"\nround trip (served 'upper' == in-process load, greedy 40 tokens): {'yes' if same else 'NO'}"
    )
    if not same:
        print("in-process:", repr(local), "\nserved:    ", repr(answers[q, "upper"]))
        sys.exit(1)


if __name__ == "__main__":
    main()
