"""Speech and embedding speed on this machine: Whisper base's real-time factor (seconds of
compute per second of audio; < 1 is faster than real time) and all-MiniLM-L6-v2's embeddings
per second, in one run.

    python scripts/bench_speech.py                    # the espeak-ng fixture, and it x8 (~54 s)
    python scripts/bench_speech.py --repeats 3 --texts 512

The long clip is the fixture repeated, so Whisper works through two 30 s windows as on a real
recording. Transcription runs as the CLI and the server run it (language given: one encoder pass
per window; detected: one more for the first window). Embeddings: short sentences of the
paraphrase test set, batched as /v1/embeddings batches them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import mlxlab  # noqa: F401  (BLAS before MLX)
from mlxlab.audio.decode import decode
from mlxlab.audio.speech import Speech
from mlxlab.audio.wer import wer
from mlxlab.embed.model import Embedder
from mlxlab.runtime import blas_report

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"
SENTENCES = [  # short, everyday sentences (7-20 tokens), as search queries and chat lines are
    "A man is playing a guitar.",
    "How do I reset my password?",
    "The stock market fell sharply today.",
    "Children are playing football in the park.",
    "Python lists are mutable and can grow as items are appended.",
    "Turn off the lights when you leave the office.",
    "The company hired ten engineers for its new data centre in Lisbon.",
    "What is the difference between a process and a thread?",
]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--long", type=int, default=8, help="the fixture repeated this many times")
    ap.add_argument("--texts", type=int, default=256, help="sentences embedded per pass")
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()

    said = (FIXTURE / "sentence.txt").read_text().strip()
    short = decode(FIXTURE / "sentence.wav").samples
    long = np.concatenate([short] * args.long)
    speech = Speech("whisper-base")
    results = {"blas": blas_report()}
    for name, audio, language in [
        ("fixture, language=en", short, "en"),  # one 30 s window
        ("fixture, detected", short, None),
        (f"fixture x{args.long}, language=en", long, "en"),
    ]:
        seconds, t = timed(
            lambda a=audio, lang=language: speech.transcribe(a, language=lang), args.repeats
        )
        dur = len(audio) / 16000
        results[name] = {
            "audio_s": round(dur, 2),
            "compute_s": round(seconds, 2),
            "rtf": round(seconds / dur, 3),
            "wer": round(wer(" ".join([said] * round(dur / (len(short) / 16000))), t.text), 3),
        }
        print(
            f"{name:<28} {dur:6.1f} s audio  {seconds:6.1f} s  RTF {seconds / dur:.3f}  WER {results[name]['wer']:.3f}",
            flush=True,
        )

    texts = [SENTENCES[i % len(SENTENCES)] for i in range(args.texts)]
    embedder = Embedder("all-minilm-l6-v2")
    ids = embedder.tokenize(texts)
    embedder.embed(ids[:32])  # warm-up
    seconds, _ = timed(lambda: embedder.embed(ids), args.repeats)
    tokens = sum(map(len, ids))
    results["embeddings"] = {
        "texts": len(texts),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "per_s": round(len(texts) / seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
    }
    print(
        f"all-MiniLM-L6-v2: {len(texts)} texts ({tokens} tokens) in {seconds:.2f} s: "
        f"{len(texts) / seconds:.1f} embeddings/s, {tokens / seconds:.0f} tokens/s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
