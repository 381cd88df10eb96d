"""Several models behind one server (serve `models.NAME=`): load costs and what a load costs the
default model, through HTTP.

    python scripts/bench_models.py [--default gemma3-270m] [--other DIR] [--third DIR]
                                   [--decode-tokens 1024] [--load-share 0.02] [--rounds 3]
                                   [--json out.json]

One server: the default model plus `other` and `third` (by default two copies of the default's
files under other paths, so each is a separate model of the same size), with a memory budget
that holds the default and one more: asking for `third` evicts `other`. Streamed chats at
temperature 0 measure:

- TTFT warm (the default, loaded), cold (`other`'s first request: its load included), warm
  again, and after eviction (`other` asked for again once `third` evicted it); these loads run
  with the engine otherwise idle, so at full speed whatever `--load-share` says;
- the default model's decode tok/s alone, and while `third` loads (a request for it sent 16
  tokens into the default's answer), against the same tokens of the answer alone: over the
  load itself (the request's start plus `last_load_seconds`: what the issue calls "while
  another model loads"), and until `third`'s first token (on the serial lane that comes after
  the default's answer, so that window holds the attach and the rest of the answer too).
  Target: >= 0.97x. `serve.load_share` paces the load (`--load-share`): the decode loses about
  that share of its time while the load runs, and the load takes 1/share times its work. The
  answer should outlast the load (`--decode-tokens`): a load's first steps cost what they cost
  (the detach of the evicted model, unpaced; the largest weight's cast, one slice), and a window
  shorter than the load measures them without the waits that follow;
- the longest gaps between tokens while the load ran, against the same gaps alone.

Prints a table; `--json` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import events, free_port, start  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def stream(url: str, model: str, max_tokens: int, on_token=None) -> dict:
    """TTFT, every content chunk's arrival time and the tokens of one streamed chat."""
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    times = []
    for ev in events(url, "/v1/chat/completions", body, 900):
        for ch in ev.get("choices") or []:
            if (ch.get("delta") or {}).get("content"):
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(times))
    return {"ttft": times[0] - t0 if times else None, "times": times}


def stats(url: str) -> dict:
    models = httpx.get(f"{url}/stats", timeout=30).json()["models"]["models"]
    return {m["id"]: m for m in models}


def copies(spec: str, root: Path) -> tuple[str, str]:
    """Two directories holding `spec`'s files (symlinks): two models of the same size."""
    from mlxlab.models import zoo

    src = zoo.resolve(spec)
    out = []
    for name in ("other", "third"):
        d = root / name
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).symlink_to(f.resolve())
        out.append(str(d))
    return out[0], out[1]


def weight_bytes(spec: str) -> int:
    from mlxlab.models import zoo
    from mlxlab.serve.engine.catalog import facts

    size = facts(zoo.resolve(spec)).weight_bytes
    if size is None:
        raise SystemExit(f"cannot read the weights of {spec}")
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--default", default="gemma3-270m")
    ap.add_argument("--other", default=None, help="default: a copy of --default's files")
    ap.add_argument("--third", default=None, help="default: a copy of --default's files")
    ap.add_argument("--decode-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load-share", type=float, default=0.02)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import mlxlab  # noqa: F401  (BLAS before MLX)
    from mlxlab.serve.engine.admission import RESERVE_BYTES

    tmp = tempfile.TemporaryDirectory()
    other, third = args.other, args.third
    if other is None or third is None:
        a, b = copies(args.default, Path(tmp.name))
        other, third = other or a, third or b
    w_default, w_other, w_third = map(weight_bytes, (args.default, other, third))
    # the default and one more fit, with room for the KV of one request; two more never do
    room = min(w_other, w_third) // 2
    budget = RESERVE_BYTES + w_default + max(w_other, w_third) + room
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "mlxlab",
        "serve",
        f"model={args.default}",
        f"models.other={other}",
        f"models.third={third}",
        f"memory_budget_gb={budget / 1e9}",
        f"load_share={args.load_share}",
        f"port={port}",
    ]
    proc = start(cmd, port)
    out: dict = {"budget_bytes": budget, "weights": [w_default, w_other, w_third]}
    try:
        stream(url, args.default, 8)  # warm-up
        out["ttft_warm_default"] = statistics.median(
            stream(url, args.default, 8)["ttft"] for _ in range(args.rounds)
        )
        out["ttft_cold"] = stream(url, "other", 8)["ttft"]
        out["ttft_warm"] = statistics.median(
            stream(url, "other", 8)["ttft"] for _ in range(args.rounds)
        )
        stream(url, "third", 8)  # evicts `other`
        assert stats(url)["other"]["state"] == "unloaded", stats(url)["other"]
        out["ttft_after_eviction"] = stream(url, "other", 8)["ttft"]
        assert stats(url)["third"]["state"] == "unloaded", stats(url)["third"]  # evicted in turn

        # the default's decode alone, then with `third` loading meanwhile (`other` is loaded:
        # `third` evicts it again and loads while the default generates)
        alone = stream(url, args.default, args.decode_tokens)["times"]
        loads_before = stats(url)["third"]["loads"]
        load: dict = {}

        def load_third(n: int) -> None:
            if n == 16 and not load:
                load["thread"] = threading.Thread(
                    target=lambda: load.update(
                        start=time.perf_counter(),
                        r=stream(url, "third", 1),
                        end=time.perf_counter(),
                    )
                )
                load["thread"].start()

        beside = stream(url, args.default, args.decode_tokens, on_token=load_third)["times"]
        load["thread"].join()
        loaded = stats(url)["third"]
        if "end" not in load or loaded["loads"] != loads_before + 1:
            raise SystemExit(
                f"`third` did not load while the default answered ({loaded}): a load longer "
                "than a request waits for one (600 s) at this --load-share?"
            )

        # the tokens that arrived while `third` was asked for (until its first token: on the
        # serial lane that follows the default's answer) and while its load itself ran (the
        # request's start + the load's seconds), against the same tokens of the answer alone
        def ratio(end: float) -> tuple:
            idx = [i for i, t in enumerate(beside) if load["start"] <= t <= end]
            if len(idx) < 2 or idx[-1] >= len(alone):
                return None, None, len(idx)
            during = (len(idx) - 1) / (beside[idx[-1]] - beside[idx[0]])
            solo = (len(idx) - 1) / (alone[idx[-1]] - alone[idx[0]])
            return solo, during, len(idx)

        # (`last_load_seconds` counts from the loader's start, a few ms after the request's)
        # where the time went: the longest gaps between tokens while the load ran, against the
        # same tokens' gaps in the answer alone (one long stall points at an unpaced step)
        end = load["start"] + loaded["last_load_seconds"]
        idx = [i for i, t in enumerate(beside) if load["start"] <= t <= end and 0 < i < len(alone)]
        gaps = sorted(
            ((beside[i] - beside[i - 1], alone[i] - alone[i - 1], i) for i in idx), reverse=True
        )
        out["longest_gaps_ms"] = [
            {"token": i, "during": round(g * 1e3, 1), "alone": round(a * 1e3, 1)}
            for g, a, i in gaps[:6]
        ]
        solo, during, n = ratio(load["end"])
        load_solo, load_during, load_n = ratio(end)
        out.update(
            third_load_s=loaded["last_load_seconds"],
            decode_alone_tok_s=solo,
            decode_during_load_tok_s=during,
            decode_ratio=(during / solo) if solo and during else None,
            tokens_during_load=n,
            load_only_ratio=(load_during / load_solo) if load_solo and load_during else None,
            tokens_during_load_only=load_n,
        )
    finally:
        proc.terminate()
        proc.wait(30)
        tmp.cleanup()

    print(f"{'TTFT warm (default)':32s} {out['ttft_warm_default'] * 1e3:9.1f} ms")
    print(f"{'TTFT cold (load included)':32s} {out['ttft_cold'] * 1e3:9.1f} ms")
    print(f"{'TTFT warm':32s} {out['ttft_warm'] * 1e3:9.1f} ms")
    print(f"{'TTFT after eviction':32s} {out['ttft_after_eviction'] * 1e3:9.1f} ms")
    print(f"{'load of third (s)':32s} {out['third_load_s']}")
    print(
        f"default decode: alone {out['decode_alone_tok_s']} tok/s, during the load "
        f"{out['decode_during_load_tok_s']} tok/s ({out['tokens_during_load']} tokens): "
        f"ratio {out['decode_ratio']} (target >= 0.97)"
    )
    print(
        f"while the load itself ran ({out['tokens_during_load_only']} tokens): ratio "
        f"{out['load_only_ratio']}"
    )
    print(
        "longest gaps while the load ran (ms, during / alone): "
        + ", ".join(f"#{g['token']} {g['during']}/{g['alone']}" for g in out["longest_gaps_ms"])
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
