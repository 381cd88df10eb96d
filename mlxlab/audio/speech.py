"""Speech-to-text with Whisper: mlx-audio's Whisper model and its transcription loop (OpenAI's:
30 s windows, each decoded with timestamps, the next window starting after the last complete
segment, the previous text as the next window's prompt, temperature fallback), wrapped into a
`Transcript` with OpenAI's verbose_json fields.

MLX work: call `transcribe` only from the thread that owns MLX (the server's engine thread;
the CLI's main thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxlab.errors import UserError

# OpenAI's default: decode greedily, and fall back to sampling at rising temperatures when a
# window's text repeats itself (gzip ratio > 2.4) or is improbable (mean log-prob < -1).
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
TASKS = ("transcribe", "translate")


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float | None
    avg_logprob: float | None
    compression_ratio: float | None
    no_speech_prob: float | None
    words: list[dict] | None = None  # {word, start, end, probability} with word timestamps


@dataclass
class Transcript:
    text: str
    language: str  # ISO 639-1 code ("en")
    duration: float  # seconds of audio
    task: str = "transcribe"
    segments: list[Segment] = field(default_factory=list)

    @property
    def language_name(self) -> str:
        return languages().get(self.language, self.language)

    @property
    def words(self) -> list[dict]:
        return [w for s in self.segments for w in (s.words or [])]


def languages() -> dict[str, str]:
    """ISO 639-1 code -> English name, Whisper's 99 languages (mlx-audio's table)."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    return dict(LANGUAGES)


def language_code(value: str | None) -> str | None:
    """A language as a code ("en"), from a code or an English name ("English"); None: detect.
    A UserError names the value when Whisper does not know it."""
    if value is None or not str(value).strip():
        return None
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

    v = str(value).strip().lower()
    if v in LANGUAGES:
        return v
    if v in TO_LANGUAGE_CODE:
        return TO_LANGUAGE_CODE[v]
    raise UserError(
        f"language {value!r} is not one Whisper knows: give an ISO 639-1 code (en, de, fr, ...)"
    )


def _finite(x) -> float | None:
    """A float for JSON: None for NaN and infinities (a window's score can be -inf)."""
    x = float(x)
    return x if np.isfinite(x) else None


class Speech:
    """A loaded Whisper model: `Speech("whisper-base")` (a zoo name or an MLX Whisper directory)."""

    def __init__(self, spec: str, dtype: str = "auto"):
        from mlxlab.models import whisper, zoo

        if spec in zoo.ZOO and zoo.ZOO[spec].kind != "stt":
            raise UserError(
                f"{spec} is not a speech-to-text model (stt models: "
                f"{', '.join(n for n, e in zoo.ZOO.items() if e.kind == 'stt')})"
            )
        self.name = spec if spec in zoo.ZOO else Path(spec).name
        self.path = zoo.resolve(spec)
        self.model = whisper.load(self.path, dtype)
        self.multilingual = bool(self.model.is_multilingual)

    def transcribe(
        self,
        samples: np.ndarray,
        *,
        language: str | None = None,
        task: str = "transcribe",
        prompt: str | None = None,
        temperature: float | None = None,
        word_timestamps: bool = False,
        progress: bool = False,
    ) -> Transcript:
        """16 kHz mono float32 samples -> a Transcript. `language`: a code or name (None:
        detected from the first window); `task`: transcribe, or translate (to English);
        `prompt`: text the first window is conditioned on (spellings, names); `temperature`:
        None or 0 for OpenAI's fallback ladder, > 0 to sample at that temperature alone;
        `progress`: a progress bar on stderr, advancing window by window."""
        import mlx.core as mx

        if task not in TASKS:
            raise UserError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        code = language_code(language)
        if not self.multilingual and (task == "translate" or code not in (None, "en")):
            raise UserError(f"{self.name} is English-only: no {task} from {code}")
        temperatures = FALLBACK_TEMPERATURES if not temperature else (float(temperature),)
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        result = self.model.generate(
            mx.array(samples),
            language=code,
            task=task,
            temperature=temperatures,
            initial_prompt=prompt or None,
            word_timestamps=word_timestamps,
            verbose=False if progress else None,
            fp16=self.model.dtype == mx.float16,
        )
        duration = round(len(samples) / 16000, 3)

        def at(seconds) -> float:  # timestamps inside the audio (a window's last one may not be)
            return round(min(max(float(seconds), 0.0), duration), 3)

        segments = [
            Segment(
                id=i,
                start=at(s["start"]),
                end=max(at(s["end"]), at(s["start"])),
                text=s["text"],
                tokens=[int(t) for t in s["tokens"]],
                temperature=_finite(s["temperature"]),
                avg_logprob=_finite(s["avg_logprob"]),
                compression_ratio=_finite(s["compression_ratio"]),
                no_speech_prob=_finite(s["no_speech_prob"]),
                words=[
                    {
                        "word": w["word"],
                        "start": at(w["start"]),
                        "end": max(at(w["end"]), at(w["start"])),
                        "probability": _finite(w.get("probability", 0.0)),
                    }
                    for w in s.get("words", [])
                ]
                if word_timestamps
                else None,
            )
            for i, s in enumerate(s for s in result.segments if s["text"].strip())
        ]
        return Transcript(
            text=result.text.strip(),
            language=result.language or code or "en",
            duration=duration,
            task=task,
            segments=segments,
        )
