"""The real models end to end (slow): Whisper base (from its PyPI packages) on the espeak-ng
fixture through the endpoint, the openai SDK and the CLI, word error rate <= 15% and the same
words from wav, mp3 and ogg; srt/vtt that parse; input_audio through the openai SDK answered by
gemma3-270m; a 60 MB upload refused with 413 without the server holding it; all-MiniLM-L6-v2
against a plain numpy BERT, ranking paraphrases above unrelated pairs, through the SDK."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest

from mlxlab.audio.wer import wer, words
from tests.helpers.bert_numpy import sentence_vector
from tests.helpers.cli import run_cli
from tests.helpers.serve import free_port, start_server
from tests.helpers.subtitles import parse_srt, parse_vtt

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

SPEECH = Path(__file__).parent / "data" / "speech"
SAID = (SPEECH / "sentence.txt").read_text().strip()
MAX_WER = 0.15


@pytest.fixture(scope="module")
def server(real_model_dir):
    port, gateway, srv, thread = start_server(
        model="gemma3-270m",
        stt_model="whisper-base",
        stt_language="en",
        embeddings_model="all-minilm-l6-v2",
        memory_budget_gb=6,
        max_tokens=16,
    )
    url = f"http://127.0.0.1:{port}"
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-any", max_retries=0, timeout=600)
    yield url, sdk, gateway
    srv.should_exit = True
    thread.join(30)
    gateway.stop()


def test_whisper_base_through_the_endpoint_sdk_and_all_three_formats(server):
    url, sdk, _ = server
    with httpx.Client(base_url=url, timeout=600) as client:
        r = client.post(  # language detected (the fixture's voice: English at p ~0.9)
            "/v1/audio/transcriptions",
            files={"file": ("sentence.wav", (SPEECH / "sentence.wav").read_bytes())},
            data={"model": "whisper-1", "response_format": "verbose_json"},
        )
        assert r.status_code == 200, r.text
        verbose = r.json()
        vtt = client.post(
            "/v1/audio/transcriptions",
            files={"file": ("sentence.ogg", (SPEECH / "sentence.ogg").read_bytes())},
            data={"model": "whisper-1", "response_format": "vtt", "language": "en"},
        )
        assert vtt.status_code == 200 and vtt.headers["content-type"].startswith("text/vtt")
    with (SPEECH / "sentence.mp3").open("rb") as f:
        srt = sdk.audio.transcriptions.create(
            model="whisper-1", file=f, response_format="srt", language="en"
        )
    assert verbose["language"] == "english" and verbose["duration"] == pytest.approx(6.81, abs=0.05)
    error = wer(SAID, verbose["text"])
    print(f"\nWER {error:.3f}: {verbose['text']!r}")
    assert error <= MAX_WER
    srt_cues, vtt_cues = parse_srt(srt), parse_vtt(vtt.text)
    for cues in (srt_cues, vtt_cues):
        assert cues and cues[-1][1] <= verbose["duration"] + 0.01
    assert words(" ".join(c[2] for c in srt_cues)) == words(verbose["text"])
    assert words(" ".join(c[2] for c in vtt_cues)) == words(verbose["text"])
    seg = verbose["segments"][0]
    assert 0 <= seg["start"] < seg["end"] and seg["avg_logprob"] > -1


def test_the_cli_transcribes_with_a_progress_bar(server, session_home, tmp_path):
    out = tmp_path / "said.txt"
    r = run_cli("transcribe", str(SPEECH / "sentence.ogg"), "language=en", f"out={out}")
    assert r.returncode == 0, r.stderr
    assert "frames" in r.stderr and "100%" in r.stderr  # the progress bar, one step per window
    error = wer(SAID, out.read_text())
    print(f"\nCLI WER {error:.3f}")
    assert error <= MAX_WER


def test_input_audio_through_the_sdk_is_answered_by_gemma3_270m(server):
    _, sdk, _ = server
    data = base64.b64encode((SPEECH / "sentence.mp3").read_bytes()).decode()
    r = sdk.chat.completions.create(
        model="gemma3-270m",
        temperature=0,
        max_tokens=16,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": data, "format": "mp3"}},
                    {"type": "text", "text": "What is the speaker's name?"},
                ],
            }
        ],
    )
    answer = r.choices[0].message.content
    print(f"\ngemma3-270m: {answer!r}")
    assert "alice" in answer.lower()  # only the transcript says so
    assert r.usage.model_extra["audio_seconds"] == pytest.approx(6.81, abs=0.05)


def test_a_60_mb_upload_is_a_413_and_the_server_never_holds_it(tiny_dir, session_home):
    """A `serve` process of its own (fresh, so its RSS has no freed memory to reuse): two 60 MB
    uploads, one declaring its length and one chunked, are 413s while its peak RSS stays flat;
    then a 15 MB JSON body, which the server does hold, shows that the watch would see one."""
    tiny_dir("gemma3")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxlab", "serve", "model=tiny-gemma3", f"port={port}"],
        env={**os.environ, "MLXLAB_HOME": str(session_home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        server = psutil.Process(proc.pid)
        peak, stop = [server.memory_info().rss], threading.Event()

        def watch():
            while not stop.is_set():
                peak.append(server.memory_info().rss)
                time.sleep(0.005)

        def body(size: int):
            chunk = b"\x00" * (1 << 20)
            sent = 0
            while sent < size:
                piece = chunk[: size - sent]
                sent += len(piece)
                yield piece

        def grown(send) -> float:
            stop.clear()
            peak[:] = [server.memory_info().rss]
            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                send()
            finally:
                stop.set()
                watcher.join()
            return (max(peak) - peak[0]) / 1e6

        size = 60_000_000

        def uploads():
            with httpx.Client(base_url=url, timeout=120) as client:
                for headers in ({"content-length": str(size)}, {}):  # declared, then chunked
                    r = client.post(
                        "/v1/audio/transcriptions",
                        content=body(size),
                        headers={"content-type": "multipart/form-data; boundary=x", **headers},
                    )
                    assert r.status_code == 413, r.text
                    assert "serve.max_audio_mb" in r.json()["error"]["message"]

        def held():  # 15 MB under max_body_mb (16): BodyLimit reads it into memory (a 400 after)
            r = httpx.post(
                f"{url}/v1/chat/completions",
                content=b"[" + b" " * 15_000_000,
                headers={"content-type": "application/json"},
                timeout=300,
            )
            assert r.status_code == 400, r.text

        audio_growth = grown(uploads)
        control = grown(held)
        print(
            f"\nserver RSS growth: two 60 MB uploads {audio_growth:.1f} MB, "
            f"a 15 MB JSON body {control:.1f} MB"
        )
        assert control > 14  # the watch sees a body held in memory
        assert audio_growth < 8
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(30)


# --- all-MiniLM-L6-v2 --------------------------------------------------------------------------

PAIRS = [  # (a, its paraphrase)
    ("A man is playing a guitar.", "Someone is strumming a guitar."),
    ("The cat is sleeping on the sofa.", "A cat naps on the couch."),
    ("How do I reset my password?", "What are the steps to change my forgotten password?"),
    ("The stock market fell sharply today.", "Share prices dropped steeply this afternoon."),
    ("She is cooking pasta for dinner.", "She's making spaghetti for the evening meal."),
    ("The train to Paris was delayed.", "The Paris-bound train ran late."),
    ("Children are playing football in the park.", "Kids kick a soccer ball around the park."),
    ("It is going to rain tomorrow.", "Tomorrow's forecast says rain."),
    ("He bought a new laptop.", "He purchased a new notebook computer."),
    ("The museum opens at nine.", "Doors of the museum open at 9 a.m."),
    ("Python lists are mutable.", "In Python, a list can be changed after it is created."),
    ("The doctor examined the patient.", "The physician checked the patient."),
    ("Turn off the lights when you leave.", "Switch the lights off on your way out."),
    ("The river flooded the village.", "The village was inundated by the river."),
    ("I can't find my keys.", "My keys are missing."),
    ("The concert was sold out.", "There were no tickets left for the concert."),
    ("She won the chess tournament.", "She came first in the chess competition."),
    ("The coffee is too hot to drink.", "This coffee is scalding."),
    ("Birds migrate south in winter.", "In winter, birds fly to the south."),
    ("The company hired ten engineers.", "Ten engineers were recruited by the firm."),
]


def embed(sdk, texts, **kw) -> np.ndarray:
    r = sdk.embeddings.create(model="all-minilm-l6-v2", input=texts, **kw)
    return np.array([d.embedding for d in r.data], np.float64)


def test_minilm_equals_a_plain_numpy_bert(server):
    _, sdk, gateway = server
    embedder = gateway.loaded.embedder
    texts = [a for a, _ in PAIRS[:4]] + ["a", "The os module, " * 30]
    got = embed(sdk, texts)
    assert got.shape == (len(texts), 384)
    for i, ids in enumerate(embedder.tokenize(texts)):
        np.testing.assert_allclose(got[i], sentence_vector(embedder.path, ids), atol=1e-5, rtol=0)


def test_paraphrases_rank_above_unrelated_pairs(server):
    _, sdk, _ = server
    a = embed(sdk, [p[0] for p in PAIRS])
    b = embed(sdk, [p[1] for p in PAIRS])
    sims = a @ b.T  # normalized vectors: cosine similarities
    paraphrase = np.diag(sims)
    unrelated = sims[~np.eye(len(PAIRS), dtype=bool)]
    print(f"\nparaphrase cos min {paraphrase.min():.3f}, unrelated max {unrelated.max():.3f}")
    assert paraphrase.min() > unrelated.max()
    assert (sims.argmax(axis=1) == np.arange(len(PAIRS))).all()


def test_minilm_base64_limits_and_dimensions(server):
    url, sdk, _ = server
    # The SDK asks for base64 itself and decodes it unless told a format: embed() above does.
    floats = embed(sdk, ["base64 please"], encoding_format="float")[0]
    b64 = sdk.embeddings.create(model="x", input="base64 please", encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    assert np.array_equal(decoded, floats.astype(np.float32))
    assert np.array_equal(embed(sdk, ["base64 please"])[0].astype(np.float32), decoded)
    with httpx.Client(base_url=url, timeout=120) as client:
        long = "word " * 300
        r = client.post("/v1/embeddings", json={"input": long})
        assert r.status_code == 400 and "256" in r.json()["error"]["message"]
        r = client.post("/v1/embeddings", json={"input": long, "truncate": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
        r = client.post("/v1/embeddings", json={"input": "x", "dimensions": 128})
        assert r.status_code == 400 and "Matryoshka" in r.json()["error"]["message"]
        assert (
            client.post("/v1/embeddings", json={"input": "x", "dimensions": 384}).status_code == 200
        )
