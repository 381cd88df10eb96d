"""Speech pieces without a real model: audio decoding (PyAV), the CTranslate2 reader, the
CTranslate2 -> mlx-audio Whisper conversion (round trip from a random mlx-audio model), the
transcript formats, WER, and tiny-whisper through `Speech`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mlxlab.audio import formats
from mlxlab.audio.decode import SAMPLE_RATE, AudioError, decode, encode
from mlxlab.audio.speech import Segment, Transcript, language_code
from mlxlab.audio.wer import wer
from mlxlab.errors import UserError
from mlxlab.models import ctranslate2
from tests.helpers.subtitles import parse_srt, parse_vtt

SPEECH = Path(__file__).parent / "data" / "speech"
WAV = (SPEECH / "sentence.wav").read_bytes()


# --- decoding ----------------------------------------------------------------------------------


def test_the_fixture_decodes_alike_from_wav_mp3_and_ogg():
    got = {f: decode(SPEECH / f"sentence.{f}") for f in ("wav", "mp3", "ogg")}
    assert got["wav"].container == "wav" and got["mp3"].container == "mp3"
    assert got["ogg"].container == "ogg" and got["ogg"].codec == "opus"
    for a in got.values():
        assert a.samples.dtype == np.float32 and a.samples.ndim == 1
        assert abs(a.seconds - got["wav"].seconds) < 0.06, a.seconds
        assert 0.05 < np.abs(a.samples).max() <= 1.0


def test_stereo_44k_is_resampled_to_16k_mono(tmp_path):
    import av

    t = np.arange(44100) / 44100
    left = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    path = tmp_path / "stereo.wav"
    with av.open(str(path), "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=44100, layout="stereo")
        frame = av.AudioFrame.from_ndarray(
            np.stack([left, left], axis=1).reshape(1, -1).copy(), format="flt", layout="stereo"
        )
        frame.sample_rate = 44100
        for f in av.AudioResampler("s16", "stereo", 44100).resample(frame):
            for p in stream.encode(f):
                out.mux(p)
        for p in stream.encode(None):
            out.mux(p)
    a = decode(path)
    assert abs(len(a.samples) - SAMPLE_RATE) < 200
    spectrum = np.abs(np.fft.rfft(a.samples[:SAMPLE_RATE]))
    assert abs(np.argmax(spectrum) - 440) <= 2  # 1 Hz bins: the tone survived resampling


@pytest.mark.parametrize(
    "data,hint,words",
    [
        (b"this is not audio at all, just text" * 50, "mp3", ["mp3 format", "not audio"]),
        (b"", "wav", ["wav format", "empty"]),
        (b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk" * 40, "wav", ["wav"]),
        (WAV[:20] + b"\x77\x77" + WAV[22:], "wav", ["wav", "codec is not supported"]),
        (WAV[:22] + b"\x00\x00" + WAV[24:], "wav", ["wav", "corrupt"]),
    ],
)
def test_bad_audio_is_an_error_naming_the_format(data, hint, words):
    with pytest.raises(AudioError) as e:
        decode(data, hint, "'upload'")
    for w in words:
        assert w in str(e.value)


def test_a_truncated_file_is_refused_or_decodes_what_is_there():
    data = (SPEECH / "sentence.mp3").read_bytes()
    try:
        a = decode(data[: len(data) // 2], "mp3")
    except AudioError as e:
        assert "mp3" in str(e)
    else:
        assert 1.0 < a.seconds < 5.0  # half the file: half the audio, no garbage


def test_format_hints_come_from_extensions_or_format_fields():
    from mlxlab.audio.decode import format_hint

    assert format_hint("talk.MP3") == "mp3" and format_hint("a.b/talk.ogg") == "ogg"
    assert format_hint("recording") is None and format_hint("dir.d/recording") is None
    assert format_hint("mp3", field=True) == "mp3" and format_hint(".WAV", field=True) == "wav"
    assert format_hint(None) is None and format_hint("", field=True) is None


def test_audio_longer_than_the_cap_is_refused():
    with pytest.raises(AudioError, match="longer than 2 s"):
        decode(SPEECH / "sentence.wav", "wav", max_seconds=2)


def test_encode_round_trips_through_the_bundled_codecs(tmp_path):
    tone = np.sin(2 * np.pi * 300 * np.arange(SAMPLE_RATE) / SAMPLE_RATE).astype(np.float32) / 2
    for fmt in ("wav", "mp3", "ogg", "flac", "m4a", "webm"):
        encode(tone, tmp_path / f"t.{fmt}", fmt)
        back = decode(tmp_path / f"t.{fmt}")
        assert abs(back.seconds - 1.0) < 0.1, (fmt, back.seconds)


# --- CTranslate2 ---------------------------------------------------------------------------------


def test_ctranslate2_read_inverts_write(tmp_path):
    model = ctranslate2.CT2Model(
        "WhisperSpec",
        3,
        {
            "a/weight": np.arange(6, dtype=np.float16).reshape(2, 3),
            "a/bias": np.array([1.5, -2], np.float32),
            "n": np.array(8, np.int16),
            "flag": np.array(1, np.int8),
        },
        {"b/weight": "a/weight"},
    )
    ctranslate2.write(tmp_path / "model.bin", model)
    back = ctranslate2.read(tmp_path / "model.bin")
    assert back.spec == "WhisperSpec" and back.revision == 3 and back.aliases == model.aliases
    for k, v in model.variables.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)
    assert back.scalar("n") == 8 and np.array_equal(back["b/weight"], model.variables["a/weight"])


def test_a_damaged_model_bin_is_a_clear_error(tmp_path):
    model = ctranslate2.CT2Model("WhisperSpec", 3, {"x": np.ones((4, 4), np.float16)}, {})
    ctranslate2.write(tmp_path / "model.bin", model)
    raw = (tmp_path / "model.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(raw[: len(raw) - 10])
    with pytest.raises(UserError, match="truncated"):
        ctranslate2.read(tmp_path / "cut.bin")
    (tmp_path / "v.bin").write_bytes((99).to_bytes(4, "little") + raw[4:])
    with pytest.raises(UserError, match="known version"):
        ctranslate2.read(tmp_path / "v.bin")


# --- CTranslate2 -> mlx-audio Whisper --------------------------------------------------------------

DIMS = {
    "n_mels": 8,
    "n_audio_ctx": 10,
    "n_audio_state": 16,
    "n_audio_head": 2,
    "n_audio_layer": 2,
    "n_vocab": 51865,
    "n_text_ctx": 12,
    "n_text_state": 16,
    "n_text_head": 2,
    "n_text_layer": 2,
}


def _as_ct2(params: dict, dims: dict, key_bias: float = 0.0) -> ctranslate2.CT2Model:
    """The inverse of the conversion, written independently: mlx-audio names -> WhisperSpec."""
    from mlxlab.models.whisper import _sinusoids

    p = {k: np.array(v, dtype=np.float16) for k, v in params.items()}
    v: dict[str, np.ndarray] = {}
    zeros = np.full(dims["n_audio_state"], key_bias, np.float16)

    def copy(dst, src, norm=False):
        v[f"{dst}/{'gamma' if norm else 'weight'}"] = p[f"{src}.weight"]
        v[f"{dst}/{'beta' if norm else 'bias'}"] = p[f"{src}.bias"]

    for c in ("conv1", "conv2"):
        v[f"encoder/{c}/weight"] = p[f"encoder.{c}.weight"].transpose(0, 2, 1).copy()
        v[f"encoder/{c}/bias"] = p[f"encoder.{c}.bias"]
    v["encoder/position_encodings/encodings"] = _sinusoids(
        dims["n_audio_ctx"], dims["n_audio_state"]
    ).astype(np.float16)
    v["decoder/position_encodings/encodings"] = p["decoder.positional_embedding"]
    v["decoder/embeddings/weight"] = p["decoder.token_embedding.weight"]
    copy("encoder/layer_norm", "encoder.ln_post", norm=True)
    copy("decoder/layer_norm", "decoder.ln", norm=True)
    for side in ("encoder", "decoder"):
        for i in range(dims["n_audio_layer"]):
            s, d = f"{side}.blocks.{i}", f"{side}/layer_{i}"
            copy(f"{d}/self_attention/layer_norm", f"{s}.attn_ln", norm=True)
            a = f"{s}.attn"
            v[f"{d}/self_attention/linear_0/weight"] = np.concatenate(
                [p[f"{a}.query.weight"], p[f"{a}.key.weight"], p[f"{a}.value.weight"]]
            )
            v[f"{d}/self_attention/linear_0/bias"] = np.concatenate(
                [p[f"{a}.query.bias"], zeros, p[f"{a}.value.bias"]]
            )
            copy(f"{d}/self_attention/linear_1", f"{a}.out")
            copy(f"{d}/ffn/layer_norm", f"{s}.mlp_ln", norm=True)
            copy(f"{d}/ffn/linear_0", f"{s}.mlp1")
            copy(f"{d}/ffn/linear_1", f"{s}.mlp2")
            if side == "decoder":
                c = f"{s}.cross_attn"
                copy(f"{d}/attention/layer_norm", f"{s}.cross_attn_ln", norm=True)
                copy(f"{d}/attention/linear_0", f"{c}.query")
                v[f"{d}/attention/linear_1/weight"] = np.concatenate(
                    [p[f"{c}.key.weight"], p[f"{c}.value.weight"]]
                )
                v[f"{d}/attention/linear_1/bias"] = np.concatenate([zeros, p[f"{c}.value.bias"]])
                copy(f"{d}/attention/linear_2", f"{c}.out")
    v["encoder/num_heads"] = np.array(dims["n_audio_head"], np.int16)
    v["decoder/num_heads"] = np.array(dims["n_text_head"], np.int16)
    return ctranslate2.CT2Model(
        "WhisperSpec", 3, v, {"decoder/projection/weight": "decoder/embeddings/weight"}
    )


def _ct2_dir(tmp_path, key_bias=0.0):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    from mlxlab.models.whisper import package_data

    mx.random.seed(3)
    model = Model(ModelDimensions(**DIMS), dtype=mx.float32)
    params = dict(tree_flatten(model.parameters()))
    src = tmp_path / "ct2"
    src.mkdir()
    ctranslate2.write(src / "model.bin", _as_ct2(params, DIMS, key_bias))
    (src / "config.json").write_text(json.dumps({"alignment_heads": [[1, 0]]}))
    (src / "tokenizer.json").write_bytes((package_data()[0] / "tokenizer.json").read_bytes())
    return src, params


def test_whisper_conversion_round_trips_every_weight(tmp_path):
    from mlx.utils import tree_flatten

    from mlxlab.models import whisper

    src, params = _ct2_dir(tmp_path)
    out = whisper.convert(src, tmp_path / "mlx")
    assert json.loads((out / "config.json").read_text()) == {
        "model_type": "whisper",
        **DIMS,
        "source": "CTranslate2 WhisperSpec",
    }
    loaded = dict(tree_flatten(whisper.load(out, "float32").parameters()))
    assert loaded.keys() == params.keys()
    for k, v in params.items():
        want = np.array(v, dtype=np.float16).astype(np.float32)
        assert np.array_equal(np.array(loaded[k]), want), k
    tok = json.loads((out / "tokenizer.json").read_text())
    assert {"id": 50364, "content": "<|0.00|>"}.items() <= next(
        t for t in tok["added_tokens"] if t["content"] == "<|0.00|>"
    ).items()
    assert json.loads((out / "generation_config.json").read_text())["alignment_heads"] == [[1, 0]]


def test_a_key_bias_means_not_whisper_and_leaves_nothing(tmp_path):
    from mlxlab.models import whisper

    src, _ = _ct2_dir(tmp_path, key_bias=0.5)
    with pytest.raises(UserError, match="key bias"):
        whisper.convert(src, tmp_path / "mlx")
    assert not (tmp_path / "mlx").exists()


def test_the_zoo_keeps_speech_models_out_of_chat_loading(session_home):
    from mlxlab.models import zoo

    kinds = {row["name"]: row["kind"] for row in zoo.listing()}
    assert kinds["whisper-base"] == "stt" and kinds["all-minilm-l6-v2"] == "embeddings"
    assert kinds["gemma3-270m"] == "lm"
    with pytest.raises(UserError, match="stt_model=whisper-base"):
        zoo.load("whisper-base")


# --- formats, WER, languages -----------------------------------------------------------------------


def _transcript() -> Transcript:
    seg = dict(tokens=[1, 2], temperature=0.0, avg_logprob=-0.2, compression_ratio=1.1)
    return Transcript(
        text="Hello there. General Kenobi.",
        language="en",
        duration=3.21,
        segments=[
            Segment(0, 0.0, 1.4, " Hello there.", no_speech_prob=0.01, **seg),
            Segment(1, 1.4, 3.0, " General\n\nKenobi.", no_speech_prob=0.02, **seg),
        ],
    )


def test_srt_and_vtt_parse_with_the_segments_timings():
    t = _transcript()
    want = [(0.0, 1.4, "Hello there."), (1.4, 3.0, "General Kenobi.")]
    assert parse_srt(formats.as_srt(t)) == want
    assert parse_vtt(formats.as_vtt(t)) == want
    assert "01:02:03,456" in formats._clock(3723.456, ",")


def test_json_bodies_carry_openai_fields():
    t = _transcript()
    assert formats.render(t, "json") == {
        "text": t.text,
        "usage": {"type": "duration", "seconds": 4},
    }
    v = formats.render(t, "verbose_json")
    assert v["language"] == "english" and v["duration"] == 3.21 and v["task"] == "transcribe"
    assert [s["start"] for s in v["segments"]] == [0.0, 1.4] and "words" not in v
    assert formats.render(t, "text") == t.text + "\n"


def test_wer():
    assert wer("The cat sat on the mat.", "the cat sat on the mat") == 0.0
    assert wer("the cat sat on the mat", "the cat sat on mat") == pytest.approx(1 / 6)
    assert wer("a b c d", "a x c d e") == pytest.approx(2 / 4)
    assert wer("Good morning, Alice!", "good-morning alice") == 0.0


def test_languages_by_code_or_name():
    assert language_code("en") == "en" and language_code("German") == "de"
    assert language_code(None) is None and language_code(" ") is None
    with pytest.raises(UserError, match="ISO 639-1"):
        language_code("klingon")


def test_tiny_whisper_transcribes_through_mlx_audio(session_home):
    from mlxlab.audio.speech import Speech

    speech = Speech("tiny-whisper")
    audio = decode(SPEECH / "sentence.wav")
    t = speech.transcribe(audio.samples, language="en", temperature=0.5)
    assert t.duration == pytest.approx(audio.seconds, abs=1e-3) and t.language == "en"
    for s in t.segments:  # random weights say something: its timings are kept inside the audio
        assert 0.0 <= s.start <= s.end <= t.duration
    body = json.dumps(formats.render(t, "verbose_json"))  # finite numbers only
    assert "NaN" not in body and "Infinity" not in body
    assert math.isfinite(t.duration)
