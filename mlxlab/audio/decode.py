"""Any common audio file -> 16 kHz mono float32 samples, through PyAV (FFmpeg's demuxers and
decoders bundled in the wheel: wav, mp3, m4a/aac, ogg/vorbis, opus, flac, webm; no system
ffmpeg). Bad input is an `AudioError` (a UserError) naming the format: what the caller said it
is (the file's extension, input_audio's `format`) and what FFmpeg found, if anything.

Decoding streams frame by frame through FFmpeg's resampler, so memory holds the decoded
samples (64 KB per second of audio) and never a second copy of the input; `max_seconds`
stops a file that decodes to more audio than that (a tiny file can hold hours of silence).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from mlxlab.errors import UserError

SAMPLE_RATE = 16000

FORMATS = ("wav", "mp3", "m4a", "mp4", "aac", "ogg", "oga", "opus", "flac", "webm", "mpeg", "mpga")
"""What callers may name (file extensions, input_audio `format`); the content decides in the end."""


class AudioError(UserError):
    """Audio the server or CLI cannot use: unsupported, corrupt, empty or too long."""


@dataclass
class Audio:
    samples: np.ndarray  # float32, mono, SAMPLE_RATE
    container: str  # FFmpeg's demuxer name, e.g. "wav", "mp3", "ogg", "mov,mp4,m4a,3gp,3g2,mj2"
    codec: str  # e.g. "pcm_s16le", "mp3float", "vorbis", "opus"

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def format_hint(name: str | None, field: bool = False) -> str | None:
    """The format a file name's extension names (lower case, no dot), or None (no extension);
    `field`: `name` is a `format` field ("mp3" or ".mp3")."""
    if not name:
        return None
    if field:
        return name.lstrip(".").lower() or None
    return os.path.splitext(os.path.basename(name))[1].lstrip(".").lower() or None


def _what(hint: str | None, label: str) -> str:
    return f"{label} ({hint} format)" if hint else label


def decode(
    source: bytes | BinaryIO | str | os.PathLike,
    hint: str | None = None,
    label: str = "the audio",
    max_seconds: float | None = None,
) -> Audio:
    """Decode `source` (bytes, a seekable binary file object, or a path) to 16 kHz mono float32.

    `hint`: the format the caller named (an extension or input_audio's `format`), used in error
    messages; the content decides how it is decoded. `label`: what to call it in messages
    (a file name, `messages[0].content[1]`). Raises AudioError."""
    import av

    if isinstance(source, (bytes, bytearray, memoryview)):
        if not len(source):
            raise AudioError(f"{_what(hint, label)} is empty")
        source = io.BytesIO(source)
    elif isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise AudioError(f"no such audio file: {source}")
        if os.path.getsize(source) == 0:
            raise AudioError(f"{_what(hint, label)} is empty")
    try:
        container = av.open(source, mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as e:
        raise AudioError(
            f"{_what(hint, label)} is not audio FFmpeg can read: unsupported or corrupt "
            f"({_reason(e)}); send wav, mp3, m4a, ogg/opus, flac or webm"
        ) from None
    with container:
        found = container.format.name
        if not container.streams.audio:
            raise AudioError(
                f"{_what(hint, label)}: the {found} container has no audio stream "
                "(unsupported format; send wav, mp3, m4a, ogg/opus, flac or webm)"
            )
        stream = container.streams.audio[0]
        if stream.codec_context is None:  # a codec this FFmpeg build does not have
            raise AudioError(
                f"{_what(hint, label)}: the {found} file's audio codec is not supported "
                "(send wav, mp3, m4a, ogg/opus, flac or webm)"
            )
        codec = stream.codec_context.name
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        limit = None if max_seconds is None else int(max_seconds * SAMPLE_RATE)
        chunks, n = [], 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1).copy())
                    n += chunks[-1].size
                if limit is not None and n > limit:
                    raise AudioError(
                        f"{_what(hint, label)} is longer than {max_seconds:g} s (serve.max_audio_s)"
                    )
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1).copy())
        except AudioError:
            raise
        except (av.error.FFmpegError, ValueError, ArithmeticError) as e:  # what a bad stream raises
            raise AudioError(
                f"{_what(hint, label)}: corrupt {found} audio ({codec}) after "
                f"{n / SAMPLE_RATE:.1f} s: {_reason(e)}"
            ) from None
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioError(f"{_what(hint, label)}: the {found} stream ({codec}) holds no audio")
    if limit is not None and samples.size > limit:
        raise AudioError(f"{_what(hint, label)} is longer than {max_seconds:g} s")
    return Audio(samples, found, codec)


def _reason(e: Exception) -> str:
    """FFmpeg's words without the errno and the file name it adds."""
    msg = getattr(e, "strerror", None) or str(e)
    return str(msg).rstrip(".")


def encode(samples: np.ndarray, path: str | os.PathLike, fmt: str, rate: int = SAMPLE_RATE):
    """Write mono float samples as `fmt` (wav, mp3, ogg, flac, opus, m4a) with PyAV's bundled
    encoders (the test fixture's mp3 and ogg copies; round trips in tests)."""
    import av

    codecs = {
        "wav": ("wav", "pcm_s16le", "s16"),
        "mp3": ("mp3", "libmp3lame", "fltp"),
        "ogg": ("ogg", "libopus", "flt"),  # the wheel has no libvorbis encoder
        "opus": ("ogg", "libopus", "flt"),
        "flac": ("flac", "flac", "s16"),
        "m4a": ("ipod", "aac", "fltp"),
        "webm": ("webm", "libopus", "flt"),
    }
    container_fmt, codec, sample_fmt = codecs[fmt]
    out_rate = 48000 if codec == "libopus" else rate
    samples = np.asarray(samples, np.float32).reshape(1, -1)
    with av.open(str(path), mode="w", format=container_fmt) as out:
        stream = out.add_stream(codec, rate=out_rate, layout="mono")
        if codec in ("libopus", "libmp3lame"):
            stream.bit_rate = 64000
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=sample_fmt, layout="mono", rate=out_rate)
        for f in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
