"""Concurrent clients: aggregate tok/s of mlxlab's batched lane, its serial lane, and mlx_lm.server.

    python scripts/bench_batch.py [--model gemma3-270m] [--clients 1 2 4 8] [--max-tokens 64]
                                  [--requests 2] [--with-defaults] [--json FILE]

Each server runs alone (started, warmed up, measured, stopped):

- `mlxlab batch=N`: the continuous-batching lane, N = the largest client count;
- `mlxlab serial`: the same server with batch=1 (one request at a time);
- `mlx_lm.server --decode-concurrency N --prompt-concurrency N`, matched: float32 weights and the
  same OpenBLAS mlxlab loads (as in scripts/bench_serve.py); `--with-defaults` adds mlx_lm.server
  as users run it (bf16 weights, the BLAS mlx[cpu] ships).

At each level C, C clients start together; each sends `--requests` non-streamed chats one after
another (distinct prompts, temperature 0, `--max-tokens`). Aggregate tok/s = all completion tokens
/ (last answer - start). `--repeats` passes alternate the server order and the table shows their mean. Prints the table
and the ratios the issue asks for (mlxlab batched vs
mlx_lm.server at every level, vs our serial lane at 4 clients) and how many answers were the same
text on mlxlab's batched lane and mlx_lm.server.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import f32_copy, free_port, start  # noqa: E402

TOPICS = (
    "a robot",
    "the sea",
    "a lighthouse keeper",
    "a lost key",
    "the first snow",
    "a train at night",
    "an old map",
    "a garden",
    "a clockmaker",
    "a storm",
    "a library",
    "a mountain village",
    "a violin",
    "a comet",
    "a bakery",
    "a fox",
)


def chat(url: str, client: int, round_: int, max_tokens: int) -> dict:
    topic = TOPICS[(client * 7 + round_) % len(TOPICS)]
    body = {
        "messages": [
            {
                "role": "user",
                "content": f"Client {client}, request {round_}: tell a long story about {topic}.",
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1200)
    if r.status_code != 200:
        raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    out = r.json()
    return {
        "tokens": out["usage"]["completion_tokens"],
        "text": out["choices"][0]["message"]["content"],
        "key": (client, round_),
    }


def level(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    results, errors = [], []
    barrier = threading.Barrier(clients + 1)

    def client(i):
        barrier.wait()
        try:
            for k in range(requests):
                results.append(chat(url, i, k, max_tokens))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{url}: {errors[0]}")
    tokens = sum(r["tokens"] for r in results)
    return {
        "clients": clients,
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "texts": {f"{c}:{k}": r["text"] for r in results for c, k in [r["key"]]},
    }


def measure(
    cmd: list[str], port: int, levels: list[int], requests: int, max_tokens: int, ours: bool
) -> dict:
    proc = start(cmd, port)
    url = f"http://127.0.0.1:{port}"
    try:
        level(url, 1, 1, 8)  # warm-up
        out = {}
        for c in levels:
            out[c] = level(url, c, requests, max_tokens)
            print(
                f"  {c} clients: {out[c]['tok_s']:.2f} tok/s ({out[c]['tokens']} tokens in {out[c]['wall_s']:.1f} s)",
                file=sys.stderr,
            )
        stats = httpx.get(f"{url}/stats", timeout=10).json() if ours else None
        return {"levels": out, "batch_stats": (stats or {}).get("batch")}
    finally:
        proc.terminate()
        proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument(
        "--requests", type=int, default=2, help="requests per client, one after another"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--with-defaults", action="store_true", help="also mlx_lm.server with its defaults (bf16)"
    )
    ap.add_argument("--skip-serial", action="store_true")
    ap.add_argument(
        "--repeats", type=int, default=2, help="passes over the servers, alternating their order"
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import mlxlab  # noqa: F401
    from mlxlab.models.zoo import resolve
    from mlxlab.runtime import home

    model_dir = resolve(args.model)
    n = max(*args.clients, 2)
    servers = {
        f"mlxlab batch={n}": [
            sys.executable,
            "-m",
            "mlxlab",
            "serve",
            f"model={args.model}",
            f"batch={n}",
            f"prefill_batch={n}",
            f"max_queue={4 * n}",
        ]
    }
    if not args.skip_serial:
        servers["mlxlab serial"] = [
            sys.executable,
            "-m",
            "mlxlab",
            "serve",
            f"model={args.model}",
            f"max_queue={4 * n}",
        ]
    concurrency = ["--decode-concurrency", str(n), "--prompt-concurrency", str(n)]
    f32 = f32_copy(model_dir, home() / "bench" / f"{args.model}-f32")
    shim = (
        "import sys, mlxlab; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
    )
    servers["mlx_lm.server (matched)"] = [
        sys.executable,
        "-c",
        shim,
        "--model",
        str(f32),
        *concurrency,
    ]
    if args.with_defaults:
        servers["mlx_lm.server (defaults)"] = [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(model_dir),
            *concurrency,
        ]
    # Passes alternate the server order (A B C, then C' B A ...) so slow drift of this noisy machine
    # does not favour whoever runs first; the serial lane runs in the first pass only.
    passes = {name: [] for name in servers}
    for p in range(args.repeats):
        order = list(servers) if p % 2 == 0 else list(reversed(servers))
        for name in order:
            if p and name == "mlxlab serial":
                continue
            port = free_port()
            print(f"{name} (pass {p + 1}) ...", file=sys.stderr)
            ours = name.startswith("mlxlab")
            port_arg = [f"port={port}"] if ours else ["--port", str(port)]
            passes[name].append(
                measure(
                    servers[name] + port_arg,
                    port,
                    args.clients,
                    args.requests,
                    args.max_tokens,
                    ours,
                )
            )
    runs = {}
    for name, got in passes.items():
        levels = {
            c: {
                "tok_s": sum(g["levels"][c]["tok_s"] for g in got) / len(got),
                "per_pass": [round(g["levels"][c]["tok_s"], 2) for g in got],
                "texts": got[0]["levels"][c]["texts"],
            }
            for c in args.clients
        }
        runs[name] = {"levels": levels, "batch_stats": got[-1]["batch_stats"]}

    ours = runs[f"mlxlab batch={n}"]["levels"]
    print(
        f"\naggregate tok/s ({args.model}, {args.requests} requests per client, max_tokens {args.max_tokens}; "
        f"mean of {args.repeats} passes, per pass in the JSON)"
    )
    print(f"{'server':<26}" + "".join(f"{str(c) + ' clients':>12}" for c in args.clients))
    for name, r in runs.items():
        print(f"{name:<26}" + "".join(f"{r['levels'][c]['tok_s']:>12.2f}" for c in args.clients))
    ratios = {}
    for name, r in runs.items():
        if name.startswith("mlx_lm"):
            ratios[f"vs {name} (target >= 1.0x)"] = {
                c: ours[c]["tok_s"] / r["levels"][c]["tok_s"] for c in args.clients
            }
    if "mlxlab serial" in runs:
        ratios["vs mlxlab serial (target >= 2x at 4 clients)"] = {
            c: ours[c]["tok_s"] / runs["mlxlab serial"]["levels"][c]["tok_s"] for c in args.clients
        }
    for name, per in ratios.items():
        print(f"mlxlab batched {name}: " + ", ".join(f"{c}: {v:.2f}x" for c, v in per.items()))
    ref = runs["mlx_lm.server (matched)"]["levels"]
    same = sum(
        ours[c]["texts"].get(k) == t for c in args.clients for k, t in ref[c]["texts"].items()
    )
    total = sum(len(ref[c]["texts"]) for c in args.clients)
    print(
        f"answers with the same text on mlxlab batched and mlx_lm.server (matched): {same}/{total}"
    )
    print(f"mlxlab batch stats: {json.dumps(runs[f'mlxlab batch={n}']['batch_stats'])}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "args": vars(args),
                    "runs": runs,
                    "ratios": ratios,
                    "same_text": [same, total],
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
