"""Regenerates the speech test fixture: one English sentence spoken by espeak-ng, as 16 kHz mono
wav, mp3 and ogg (opus), with the text it says. The files are committed, so tests and CI need no
espeak-ng; run this only to change the sentence.

    apt-get install -y espeak-ng
    python scripts/make_speech_fixture.py            # writes tests/data/speech/sentence.*
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import mlxlab  # noqa: F401  (BLAS before MLX)
from mlxlab.audio.decode import SAMPLE_RATE, decode, encode

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"
TEXT = "Good morning. My name is Alice and I live in a small house near the city library."
VOICE, SPEED = "en-gb", 140  # en-gb: whisper-base detects English at p 0.86-0.90 (en-us: 0.36-0.57)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "espeak.wav"
        subprocess.run(
            ["espeak-ng", "-v", VOICE, "-s", str(SPEED), "-w", str(raw), TEXT], check=True
        )
        audio = decode(raw)  # 22.05 kHz from espeak -> 16 kHz mono
    # Half a second of silence either side, as a recording has (Whisper misses a first word
    # that starts at sample 0).
    pad = np.zeros(SAMPLE_RATE // 2, np.float32)
    samples = np.concatenate([pad, audio.samples, pad])
    for fmt in ("wav", "mp3", "ogg"):
        encode(samples, OUT / f"sentence.{fmt}", fmt)
    (OUT / "sentence.txt").write_text(TEXT + "\n")
    for p in sorted(OUT.iterdir()):
        print(f"{p.relative_to(OUT.parents[2])}  {p.stat().st_size} bytes", file=sys.stderr)
    print(f"{len(samples) / SAMPLE_RATE:.2f} s of audio", file=sys.stderr)


if __name__ == "__main__":
    main()
