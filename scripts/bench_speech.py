"""Speech and embedding speed on this machine: Whisper base's real-time factor (seconds of
compute per second of audio; < 1 is faster than real time) and all-MiniLM-L6-v2's embeddings
per second, in one run.

    python scripts/bench_speech.py                    # the fixture (6.8 s) and a 12-sentence passage
    python scripts/bench_speech.py --repeats 3 --texts 512

The passage (12 different sentences read by espeak-ng, ~70 s) makes Whisper work through several
30 s windows as on a real recording. Transcription runs as the CLI and the server run it (language given: one encoder pass
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


PASSAGE = [  # read by espeak-ng (en-gb) into a ~70 s recording of different sentences
    "This morning I read a book about the history of music and art in Europe.",
    "Please remember to buy some milk, bread and eggs on your way home from work.",
    "The train leaves the station at half past seven and arrives in the city before nine.",
    "My sister works as a nurse in a large hospital near the river.",
    "We planted tomatoes, beans and carrots in the garden last spring.",
    "The museum is closed on Mondays, but it opens early on Saturday mornings.",
    "He forgot his umbrella, so he got wet walking to the office.",
    "Our neighbours have two dogs and a very old cat that sleeps all day.",
    "The teacher asked the students to write a short story about their holidays.",
    "After dinner we usually take a walk around the park before it gets dark.",
    "The new library has thousands of books and a quiet room for studying.",
    "It rained all weekend, so we stayed inside and played board games.",
]


def passage() -> tuple[np.ndarray, str]:
    """~70 s of different sentences spoken by espeak-ng (apt-get install espeak-ng), half a
    second apart; without espeak-ng, the fixture eight times over (Whisper, conditioned on its
    previous window, tends to drop repeats of one sentence: read that WER with care)."""
    import shutil
    import subprocess
    import tempfile

    gap = np.zeros(8000, np.float32)
    if shutil.which("espeak-ng") is None:
        short = decode(FIXTURE / "sentence.wav").samples
        return np.concatenate([short] * 8), " ".join([(FIXTURE / "sentence.txt").read_text()] * 8)
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(PASSAGE):
            path = Path(tmp) / f"{i}.wav"
            cmd = ["espeak-ng", "-v", "en-gb", "-s", "140", "-w", str(path), text]
            subprocess.run(cmd, check=True)
            parts += [decode(path).samples, gap]
    return np.concatenate([gap, *parts]), " ".join(PASSAGE)


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
    ap.add_argument("--texts", type=int, default=256, help="sentences embedded per pass")
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()

    said = (FIXTURE / "sentence.txt").read_text().strip()
    short = decode(FIXTURE / "sentence.wav").samples
    long, long_said = passage()
    speech = Speech("whisper-base")
    import os

    # The machine's load, at the start and the end: on a shared box the ratio to an idle run
    # is roughly the load over the core count.
    results = {"blas": blas_report(), "loadavg_start": os.getloadavg()[0]}
    for name, audio, language, text in [
        ("fixture, language=en", short, "en", said),  # one 30 s window
        ("fixture, detected", short, None, said),
        ("passage, language=en", long, "en", long_said),  # several windows
    ]:
        seconds, t = timed(
            lambda a=audio, lang=language: speech.transcribe(a, language=lang), args.repeats
        )
        dur = len(audio) / 16000
        results[name] = {
            "audio_s": round(dur, 2),
            "compute_s": round(seconds, 2),
            "rtf": round(seconds / dur, 3),
            "wer": round(wer(text, t.text), 3),
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
    results["loadavg_end"] = os.getloadavg()[0]
    print(
        f"load average {results['loadavg_start']:.1f} -> {results['loadavg_end']:.1f} "
        f"on {os.cpu_count()} cores"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
