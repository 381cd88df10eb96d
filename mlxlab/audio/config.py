"""`python -m mlxlab transcribe`'s config (registered here: mlxlab/registry.py imports this
provider)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxlab import registry
from mlxlab.config import DTYPES
from mlxlab.errors import UserError
from mlxlab.schema import check_choice


@dataclass
class TranscribeConfig:
    """`python -m mlxlab transcribe FILE`: speech to text with Whisper (mlxlab/audio)."""

    file: str | None = None
    """The audio file: wav, mp3, m4a, ogg/opus, flac, webm (decoded by PyAV, resampled to 16 kHz)."""
    model: str = "whisper-base"
    """Zoo name (whisper-base) or a converted Whisper directory."""
    language: str | None = None
    """ISO 639-1 code or English name; unset: detected from the first 30 s."""
    task: str = "transcribe"
    """transcribe, or translate (to English)."""
    format: str = "text"
    """Output: text, json, verbose_json, srt or vtt."""
    prompt: str | None = None
    """Text the first window is conditioned on (names, spellings)."""
    temperature: float = 0.0
    """0: greedy with Whisper's fallback to higher temperatures; > 0: sample at that one."""
    word_timestamps: bool = False
    """Word-level timestamps (verbose_json's `words`)."""
    out: str | None = None
    """Write the output to this file (atomically) instead of stdout; a directory means
    <file's stem>.<txt, json, srt or vtt> inside it. Checked before the model loads."""
    progress: bool = True
    """A progress bar on stderr, advancing one 30 s window at a time."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, float16 on GPU), float32, float16."""

    def __post_init__(self):
        check_choice("task", self.task, ("transcribe", "translate"))
        check_choice("format", self.format, ("text", "json", "verbose_json", "srt", "vtt"))
        check_choice("dtype", self.dtype, DTYPES)
        if not 0.0 <= self.temperature <= 1.0:
            raise UserError(f"temperature must be in [0, 1], got {self.temperature}")


registry.command("transcribe", TranscribeConfig)
