"""End to end: `python -m mlxlab serve model=tiny-gemma3-vl` as a subprocess, driven over real
HTTP by the official openai and anthropic SDKs with images; a 21 MB image; an image URL from a
local HTTP server; and `python -m mlxlab generate image=FILE` against the served answer."""

from __future__ import annotations

import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest

from mlxlab.vision import prompt
from tests.helpers.cli import run_cli
from tests.helpers.images import anthropic_user, data_url, encoded
from tests.helpers.serve import free_port
from tests.test_serve_e2e import start_server, wait_ready

pytestmark = pytest.mark.slow  # a subprocess server, the CLI in subprocesses

PNG = encoded(2)


class _Image(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/cat.png" else 404)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        if self.path == "/cat.png":
            self.wfile.write(PNG)


@pytest.fixture(scope="module")
def served(tiny_dir):
    tiny_dir("gemma3-vl")
    images = ThreadingHTTPServer(("127.0.0.1", 0), _Image)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    port = free_port()
    proc = start_server(
        port,
        "model=tiny-gemma3-vl",
        "memory_budget_gb=2",
        "max_tokens=8",
        "allow_image_urls=true",
        "image_url_hosts=[localhost]",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url, images.server_address[1]
    finally:
        images.shutdown()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def image_message(data: bytes, text="What is it?") -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(data)}},
        ],
    }


def test_the_sdks_send_an_image_over_http(served):
    url, _ = served
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-any", max_retries=0)
    out = oa.chat.completions.create(
        model="tiny-gemma3-vl", messages=[image_message(PNG)], temperature=0
    )
    content = out.choices[0].message.content
    assert prompt.table_rows(content) and out.usage.prompt_tokens > 4  # 4 image positions
    chunks = oa.chat.completions.create(
        model="x", messages=[image_message(PNG)], temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    resp = oa.responses.create(
        model="x",
        temperature=0,
        max_output_tokens=8,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is it?"},
                    {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                ],
            }
        ],
    )
    assert resp.output_text == content
    claude = anthropic.Anthropic(base_url=url, api_key="sk-ant-any", max_retries=0)
    msg = claude.messages.create(
        model="x",
        max_tokens=8,
        extra_body={"temperature": 0},
        messages=[anthropic_user(PNG, text="What is it?")],
    )
    assert msg.content[0].text == content
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="x",
            max_tokens=2,
            messages=[anthropic_user(PNG[:-40])],
        )
    assert "truncated or corrupt" in str(e.value)


def test_a_21_mb_image_is_a_413_and_the_server_carries_on(served):
    url, _ = served
    big = PNG + bytes(21_000_000)  # 28 MB of base64: inside serve.vision_body_mb (72)
    body = {"model": "x", "messages": [image_message(big)], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large", r.text[:300]
    six = {"model": "x", "messages": [image_message(PNG)] * 1, "max_tokens": 2}
    six["messages"][0]["content"] += [six["messages"][0]["content"][1]] * 5
    r = httpx.post(f"{url}/v1/chat/completions", json=six, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"
    ok = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "x", "messages": [image_message(PNG)], "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


def test_an_image_url_is_fetched_from_an_allowed_host_only(served):
    url, port = served
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-any", max_retries=0)
    parts = [{"type": "image_url", "image_url": {"url": f"http://localhost:{port}/cat.png"}}]
    out = oa.chat.completions.create(
        model="x", messages=[{"role": "user", "content": parts}], temperature=0
    )
    assert "| cat.png |" in out.choices[0].message.content
    parts[0]["image_url"]["url"] = f"http://127.0.0.1:{port}/cat.png"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="x", messages=[{"role": "user", "content": parts}])
    assert e.value.code == "image_url_refused"


def test_generate_with_an_image_gives_the_served_answer(served, tmp_path):
    url, _ = served
    path = tmp_path / "pic.png"
    path.write_bytes(PNG)
    r = run_cli(
        "generate",
        "model=tiny-gemma3-vl",
        f"image={path}",
        "prompt=What is it?",
        "max_tokens=8",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "1 image(s)" in r.stderr
    served_text = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [image_message(PNG)], "temperature": 0, "max_tokens": 8},
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert r.stdout.strip() == prompt.strip_tables(served_text).strip()
    bad = run_cli("generate", "model=tiny-gemma3", f"image={path}", timeout=300)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 1 and len(lines) == 1 and "has no vision" in lines[0], bad.stderr
