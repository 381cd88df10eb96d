"""The audio routes and chat input_audio on tiny models in-process (tiny-gemma3 chat,
tiny-whisper speech): every response format and its content type, the form's checks, the
per-route body cap (serve.max_audio_mb, not max_body_mb), bad audio answered with a 400 naming
the format and the server serving on, the missing-model 400, input_audio parts transcribed into
the prompt with audio seconds in the usage, /v1/models. The real model's words: test_speech_real."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.helpers.serve import make_client, sse_events
from tests.helpers.subtitles import parse_srt, parse_vtt

SPEECH = Path(__file__).parent / "data" / "speech"
WAV = (SPEECH / "sentence.wav").read_bytes()
SECONDS = len(WAV[44:]) / 32000  # 16 kHz, 16-bit mono after a 44-byte header
FORM = {"model": "whisper-1", "language": "en", "temperature": "0.4"}


@pytest.fixture(scope="module")
def served(tiny_dir, session_home):
    tiny_dir("gemma3")
    client, gateway = make_client(
        stt_model="tiny-whisper", max_audio_mb=1, max_body_mb=0.5, max_tokens=4
    )
    yield client
    gateway.stop()


@pytest.fixture(scope="module")
def deaf(tiny_dir):
    """A server without a speech model."""
    tiny_dir("gemma3")
    client, gateway = make_client(max_tokens=4)
    yield client
    gateway.stop()


def transcribe(client, data=WAV, name="sentence.wav", route="transcriptions", **form):
    return client.post(
        f"/v1/audio/{route}", files={"file": (name, data, "audio/wav")}, data={**FORM, **form}
    )


@pytest.mark.parametrize(
    "fmt,ctype",
    [
        ("json", "application/json"),
        ("text", "text/plain"),
        ("verbose_json", "application/json"),
        ("srt", "application/x-subrip"),
        ("vtt", "text/vtt"),
    ],
)
def test_each_response_format(served, fmt, ctype):
    r = transcribe(served, response_format=fmt)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(ctype)
    if fmt == "json":
        assert set(r.json()) == {"text", "usage"} and r.json()["usage"]["seconds"] == 7
    elif fmt == "verbose_json":
        body = json.loads(r.text)  # strict: no NaN or Infinity
        assert body["task"] == "transcribe" and body["language"] == "english"
        assert body["duration"] == pytest.approx(SECONDS, abs=0.05)
        for s in body["segments"]:
            assert 0 <= s["start"] <= s["end"] <= body["duration"]
    elif fmt == "srt":
        parse_srt(r.text) if r.text.strip() else None
    elif fmt == "vtt":
        parse_vtt(r.text)


def test_translations(served):
    r = served.post(
        "/v1/audio/translations",
        files={"file": ("s.wav", WAV, "audio/wav")},
        data={"model": "whisper-1", "temperature": "0.4"},
    )
    assert r.status_code == 200 and "text" in r.json()


@pytest.mark.parametrize(
    "form,param",
    [
        ({"response_format": "xml"}, "response_format"),
        ({"language": "klingon"}, "language"),
        ({"temperature": "3"}, "temperature"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),  # needs verbose_json
    ],
)
def test_bad_fields_are_400s_naming_them(served, form, param):
    r = transcribe(served, **form)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_missing_file_or_model_is_a_400(served):
    r = served.post("/v1/audio/transcriptions", data={"model": "whisper-1"})
    assert r.status_code == 400 and "file" in r.json()["error"]["message"]
    r = served.post("/v1/audio/transcriptions", files={"file": ("a.wav", WAV, "audio/wav")})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "name,data,word",
    [
        ("broken.mp3", b"ID3" + b"\x00garbage" * 500, "mp3"),
        ("notes.txt", b"hello, this is a text file\n" * 50, "txt"),
        ("zero-channels.wav", WAV[:22] + b"\x00\x00" + WAV[24:], "wav"),
        ("odd-codec.wav", WAV[:20] + b"\x77\x77" + WAV[22:], "wav"),  # unknown format tag
    ],
)
def test_bad_audio_is_a_400_naming_the_format(served, name, data, word):
    r = transcribe(served, data=data, name=name)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_audio" and word in err["message"], err


def test_after_bad_audio_the_next_request_is_served(served):
    assert transcribe(served, data=b"garbage" * 99, name="x.ogg").status_code == 400
    assert transcribe(served, response_format="text").status_code == 200


def test_audio_routes_have_their_own_body_cap(served):
    # Over max_body_mb (0.5 MB) but under max_audio_mb (1 MB): it reaches the route.
    r = transcribe(served, data=b"\x00" * 700_000, name="zeros.wav")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_audio"
    # Over max_audio_mb: 413 naming that flag, as it arrives (chunked) or by its length.
    r = transcribe(served, data=b"\x00" * 1_200_000, name="big.wav")
    assert r.status_code == 413 and "serve.max_audio_mb" in r.json()["error"]["message"]
    # The chat route keeps max_body_mb.
    big = {"messages": [{"role": "user", "content": "x" * 600_000}]}
    r = served.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "serve.max_body_mb" in r.json()["error"]["message"]


def _audio_chat(data=WAV, fmt="wav", role="user", **extra):
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt},
    }
    return {
        "messages": [{"role": role, "content": [{"type": "text", "text": "What was said?"}, part]}],
        "max_tokens": 3,
        **extra,
    }


def test_input_audio_is_transcribed_into_the_prompt(served):
    with_audio = served.post("/v1/chat/completions", json=_audio_chat())
    assert with_audio.status_code == 200, with_audio.text
    usage = with_audio.json()["usage"]
    assert usage["audio_seconds"] == pytest.approx(SECONDS, abs=0.05)
    text_only = served.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "What was said?"}], "max_tokens": 3},
    )
    assert "audio_seconds" not in text_only.json()["usage"]
    # The transcript is in the prompt: more prompt tokens than the question alone.
    assert usage["prompt_tokens"] > text_only.json()["usage"]["prompt_tokens"] + 5


@pytest.mark.parametrize("n", [1, 2])
def test_input_audio_streamed_counts_audio_seconds_in_the_usage_chunk(served, n):
    body = _audio_chat(stream=True, stream_options={"include_usage": True}, n=n)
    r = served.post("/v1/chat/completions", json=body)
    usage = [e["usage"] for e in sse_events(r.text) if e.get("usage")]
    assert usage and usage[-1]["audio_seconds"] == pytest.approx(SECONDS, abs=0.05)


@pytest.mark.parametrize(
    "body,words",
    [
        (_audio_chat(fmt="midi"), ["format", "midi"]),
        (_audio_chat(data=b"\x00not audio" * 30), ["wav", "messages[0].content[1]"]),
        (_audio_chat(role="assistant"), ["user messages"]),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}
                        ],
                    }
                ]
            },
            ["base64"],
        ),
    ],
)
def test_bad_input_audio_is_a_400(served, body, words):
    r = served.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    for w in words:
        assert w in r.json()["error"]["message"]


def test_without_a_speech_model_the_400_says_how_to_serve_one(deaf):
    r = transcribe(deaf)
    assert r.status_code == 400 and "stt_model=whisper-base" in r.json()["error"]["message"]
    r = deaf.post("/v1/chat/completions", json=_audio_chat())
    assert r.status_code == 400 and "stt_model=whisper-base" in r.json()["error"]["message"]
    assert "input_audio" not in deaf.get("/v1/models").json()["data"][0]


def test_models_lists_the_speech_model_and_the_deviation(served):
    data = served.get("/v1/models").json()["data"]
    assert "transcribed by tiny-whisper" in data[0]["input_audio"]
    card = next(c for c in data if c["id"] == "tiny-whisper")
    assert card["type"] == "speech-to-text"
    assert served.get("/v1/models/tiny-whisper").json() == card
