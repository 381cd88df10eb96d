"""Images through the server, in-process on tiny random-init VLMs: tokens equal to mlx-vlm's own
generate, one request path under the three protocols, the handbook's ids, table and limits, the
URL fetcher's refusals (against a local HTTP server), admission, lanes, adapters, the SDKs."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import openai
import pytest

from mlxlab.serve import image_fetch
from mlxlab.vision import images, prompt
from tests.helpers.images import anthropic_user, data_url, encoded, jpeg_with_exif
from tests.helpers.serve import BASE_URL, make_adapter, make_client, named_events, sse_events


class Finished(list):
    """The Done of every job the engine finishes from now on (their generated token ids)."""

    def __init__(self, gateway):
        super().__init__()
        self.grew = threading.Condition()
        gateway.observers.append(self.add)

    def add(self, job, done) -> None:
        with self.grew:
            self.append(done)
            self.grew.notify_all()

    def after(self, n: int):
        """The Done of the job finished after the first `n`: observers run after the answer has
        been sent, so the HTTP response can arrive first."""
        with self.grew:
            assert self.grew.wait_for(lambda: len(self) > n, timeout=10)
            return self[n]


def capture(gateway) -> Finished:
    return Finished(gateway)


@pytest.fixture(scope="module")
def vlm(tiny_dir):
    tiny_dir("gemma3-vl")
    client, gateway = make_client(model="tiny-gemma3-vl", max_tokens=8)
    yield client, gateway, capture(gateway)
    gateway.stop()


@pytest.fixture(scope="module")
def text_client(tiny_dir):
    tiny_dir("gemma3")
    client, gateway = make_client()
    yield client
    gateway.stop()


def user(*images_, text="What is it?"):
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in images_]
    return {"role": "user", "content": parts}


def chat(*messages, **kw):
    return {"model": "x", "messages": list(messages), "temperature": 0, "max_tokens": 8, **kw}


def answer(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


PNG0, PNG1, PNG2 = (encoded(k) for k in range(3))


# --- tokens: the server against mlx-vlm's own generate ----------------------------------------


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_served_tokens_equal_mlx_vlm_generate(family, vlm, tiny_dir, tmp_path):
    from mlx_vlm import generate
    from mlx_vlm import load as vlm_load

    if family == "gemma3":
        client, gateway, done = vlm
    else:
        tiny_dir("qwen2-vl")
        client, gateway = make_client(model="tiny-qwen2-vl")
        done = capture(gateway)
    model_dir = tiny_dir(f"{family}-vl")
    ref_model, processor = vlm_load(str(model_dir))
    tok = processor.tokenizer
    for kind, data in enumerate((PNG0, PNG2)):
        path = tmp_path / f"{kind}.png"
        path.write_bytes(data)
        seen = [
            {"type": "text", "text": "What is it?"},
            {"type": "text", "text": "[Image 1]"},
            {"type": "image"},
        ]
        text = tok.apply_chat_template(
            [{"role": "user", "content": seen}], add_generation_prompt=True, tokenize=False
        )
        ref = generate(ref_model, processor, text, image=[str(path)], max_tokens=16, temperature=0)
        before = len(done)
        r = client.post("/v1/chat/completions", json=chat(user(data_url(data)), max_tokens=16))
        got = r.json()
        assert r.status_code == 200, got
        ours = done.after(before).tokens
        n = len(ref.token_ids)
        assert ours[:n] == ref.token_ids, (ours, ref.token_ids)
        assert n == 16 or got["choices"][0]["finish_reason"] == "stop"
        assert got["usage"]["prompt_tokens"] == ref.prompt_tokens
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no prompt cache
    if family != "gemma3":
        gateway.stop()


def test_three_protocols_send_the_same_image_to_the_same_model(vlm):
    client, _, done = vlm
    b64 = base64.b64encode(PNG1).decode()
    openai_body = chat(user(data_url(PNG1)))
    n = len(done)
    content = answer(client.post("/v1/chat/completions", json=openai_body))
    tokens = done.after(n).tokens
    assert content.startswith("<details>") and "| 1 | image_" in content
    source = {"type": "base64", "media_type": "image/png", "data": b64}
    anthropic_body = {
        "model": "x",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is it?"},
                    {"type": "image", "source": source},
                ],
            }
        ],
    }
    msg = client.post("/v1/messages", json=anthropic_body)
    assert msg.status_code == 200, msg.text
    assert msg.json()["content"][0]["text"] == content and done.after(n + 1).tokens == tokens
    parts = [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": data_url(PNG1)},
    ]
    resp = client.post(
        "/v1/responses",
        json={
            "model": "x",
            "max_output_tokens": 8,
            "temperature": 0,
            "input": [{"role": "user", "content": parts}],
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["output"][0]["content"][0]["text"] == content
    assert done.after(n + 2).tokens == tokens
    # streamed: the table first, then the same text
    s = client.post("/v1/chat/completions", json={**openai_body, "stream": True})
    deltas = [e["choices"][0]["delta"].get("content") for e in sse_events(s.text) if e["choices"]]
    assert "".join(d or "" for d in deltas) == content and deltas[1].startswith("<details>")
    stream = client.post("/v1/messages", json={**anthropic_body, "stream": True})
    text = "".join(
        d["delta"].get("text", "")
        for name, d in named_events(stream.text)
        if name == "content_block_delta"
    )
    assert text == content
    count = client.post(
        "/v1/messages/count_tokens",
        json={"model": "x", "messages": anthropic_body["messages"]},
    )
    assert count.json()["input_tokens"] == msg.json()["usage"]["input_tokens"]


def test_image_ids_are_stable_across_three_requests(vlm):
    """Request 1 shows A; request 2 (A kept in the history) shows B; request 3, with every image
    dropped from the history, re-uploads A beside a new C: A stays Image 1, C becomes Image 3."""
    client, _, _ = vlm
    a, b, c = data_url(PNG0, name="beach.png"), data_url(PNG1), data_url(PNG2)
    ha, hb, hc = (images.digest_of(x)[:8] for x in (PNG0, PNG1, PNG2))
    first = answer(client.post("/v1/chat/completions", json=chat(user(a))))
    assert f"| 1 | image_{ha}.png | beach.png |" in first
    second = answer(
        client.post(
            "/v1/chat/completions",
            json=chat(user(a), {"role": "assistant", "content": first}, user(b, text="And this?")),
        )
    )
    assert prompt.table_rows(second) == [(2, hb)]
    third = answer(
        client.post(
            "/v1/chat/completions",
            json=chat(
                {"role": "user", "content": "What is it?"},  # base64 dropped by the client
                {"role": "assistant", "content": first},
                {"role": "user", "content": "And this?"},
                {"role": "assistant", "content": second},
                user(c, a, text="Compare these."),
            ),
        )
    )
    assert prompt.table_rows(third) == [(3, hc), (1, ha)]


def test_history_images_reach_a_text_model_as_labels_but_shown_ones_are_refused(vlm, text_client):
    client, _, _ = vlm
    first = answer(client.post("/v1/chat/completions", json=chat(user(data_url(PNG0)))))
    follow = chat(
        user(data_url(PNG0)),
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Which colour was Image 1?"},
    )
    r = text_client.post("/v1/chat/completions", json=follow)  # the handbook's vision -> text
    assert r.status_code == 200 and "<details>" not in answer(r)
    bodies = {
        "/v1/chat/completions": chat(user(data_url(PNG0))),
        "/v1/messages": {
            "model": "x",
            "max_tokens": 4,
            "messages": [anthropic_user(PNG0)],
        },
        "/v1/responses": {
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG0)}]}
            ]
        },
    }
    for path, body in bodies.items():
        r = text_client.post(path, json=body)
        assert r.status_code == 400, r.text
        message = r.text
        assert "tiny-gemma3" in message and "no vision" in message, message


# --- limits and bad images ------------------------------------------------------------------


@pytest.mark.parametrize(
    "content,status,code",
    [
        ([data_url(PNG0[:-40])], 400, "invalid_image"),  # truncated PNG
        ([data_url(PNG0, "image/jpeg")], 400, "image_type_mismatch"),  # wrong MIME
        ([data_url(PNG0, "text/plain")], 400, "image_type_mismatch"),
        ([data_url(encoded(0, "BMP"), "image/bmp")], 400, "unsupported_image_format"),
        (["data:image/png;base64,@@@not base64@@@"], 400, "invalid_image"),
        (["data:image/png,rawbytes"], 400, "invalid_image"),
        (["file:///etc/passwd"], 400, "invalid_image"),
        ([data_url(PNG0)] * 6, 400, "too_many_images"),
        (["https://example.com/cat.png"], 400, "image_urls_disabled"),
    ],
    ids=[
        "truncated",
        "mime",
        "not-image-mime",
        "bmp",
        "base64",
        "not-base64",
        "file",
        "six",
        "url",
    ],
)
def test_bad_images_get_their_4xx_and_the_server_answers_the_next_request(
    vlm, content, status, code
):
    client, _, _ = vlm
    r = client.post("/v1/chat/completions", json=chat(user(*content)))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == "messages[0].content", err
    assert answer(client.post("/v1/chat/completions", json=chat(user(data_url(PNG1)))))


def test_total_image_bytes_are_capped(vlm):
    _, gateway, _ = vlm
    client, _ = make_client(gateway, max_image_mb=1, max_images_mb=2)
    bulky = PNG0 + bytes(900_000)
    r = client.post("/v1/chat/completions", json=chat(user(*[data_url(bulky)] * 3)))
    assert r.status_code == 413 and r.json()["error"]["code"] == "images_too_large", r.text
    r = client.post("/v1/chat/completions", json=chat(user(data_url(PNG0 + bytes(1_100_000)))))
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
    # the body cap grew to serve.vision_body_mb: a 20 MB image fits where 16 MB bodies would not
    assert client.post("/v1/chat/completions", json=chat(user(data_url(PNG1)))).status_code == 200


def test_exif_columns_come_off_with_the_flag(vlm):
    _, gateway, _ = vlm
    on = answer(
        vlm[0].post(
            "/v1/chat/completions", json=chat(user(data_url(jpeg_with_exif(), "image/jpeg")))
        )
    )
    assert "📍 34.0522°N, 118.2437°W | 📅 2024-06-15 | Apple iPhone 14 |" in on
    client, _ = make_client(gateway, image_exif=False)
    off = answer(
        client.post(
            "/v1/chat/completions", json=chat(user(data_url(jpeg_with_exif(), "image/jpeg")))
        )
    )
    assert "| Image | Filename |\n" in off and "2024" not in off
    client, _ = make_client(gateway, image_table=False)
    bare = answer(client.post("/v1/chat/completions", json=chat(user(data_url(PNG0)))))
    assert prompt.TABLE_MARK not in bare


def test_structured_answers_have_no_table_and_parse(vlm):
    client, _, _ = vlm
    r = client.post(
        "/v1/chat/completions",
        json=chat(user(data_url(PNG0)), max_tokens=24, response_format={"type": "json_object"}),
    )
    content = answer(r)
    assert prompt.TABLE_MARK not in content
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


# --- engine: admission, lanes, adapters, the store --------------------------------------------


def test_admission_counts_the_vision_tower(vlm):
    client, gateway, _ = vlm
    vision = gateway.loaded.vision
    assert vision.bytes_per_image > 0 and vision.reference_tokens == 4
    stats = client.get("/stats").json()["vision"]
    assert stats["bytes_per_image"] == vision.bytes_per_image and stats["vision_bytes"] > 0
    assert client.get("/v1/models").json()["data"][0]["vision"] is True
    adm = gateway.loaded.admission
    usable = adm.budget_bytes - adm.bytes_for(64)
    old = vision.bytes_per_image
    vision.bytes_per_image = usable  # one image now leaves no room for 64 tokens
    try:
        r = client.post("/v1/chat/completions", json=chat(user(data_url(PNG0)), max_tokens=40))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_over_budget"
        assert "vision tower" in r.json()["error"]["message"]
        # the same prompt as text fits
        assert answer(client.post("/v1/chat/completions", json=chat(user(), max_tokens=40)))
    finally:
        vision.bytes_per_image = old


def test_adapters_and_the_batched_lane_beside_images(tiny_dir, tmp_path):
    """Under batch=2: an image request runs on the serial lane beside a batched text one; an
    adapter changes text answers on a VLM and is refused with images."""
    adapter = make_adapter(tiny_dir("gemma3-vl"), tmp_path / "a", seed=3)
    client, gateway = make_client(
        model="tiny-gemma3-vl",
        adapters={"style": str(adapter)},
        adapter_root=str(tmp_path),
        batch=2,
    )
    try:
        results = {}

        def post(key, body):
            results[key] = client.post("/v1/chat/completions", json=body)

        threads = [
            threading.Thread(target=post, args=("image", chat(user(data_url(PNG0))))),
            threading.Thread(target=post, args=("text", chat(user(), max_tokens=12))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert prompt.TABLE_MARK in answer(results["image"])
        base = answer(results["text"])
        assert client.get("/stats").json()["batch"]["served_serial"] >= 1
        tuned = client.post(
            "/v1/chat/completions", json=chat(user(), max_tokens=12, adapter="style")
        )
        assert answer(tuned) != base
        r = client.post("/v1/chat/completions", json=chat(user(data_url(PNG0)), adapter="style"))
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "adapter_not_supported_with_images"
    finally:
        gateway.stop()


def test_responses_store_keeps_ids_not_bytes(vlm):
    client, gateway, _ = vlm
    first = client.post(
        "/v1/responses",
        json={
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG0)}]}
            ],
            "max_output_tokens": 4,
        },
    ).json()
    rid = first["id"]
    stored = json.dumps(client.app.state.response_store.get(rid)["messages"])
    assert base64.b64encode(PNG0).decode()[:40] not in stored and images.digest_of(PNG0) in stored
    second = client.post(
        "/v1/responses",
        json={
            "previous_response_id": rid,
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG1)}]}
            ],
            "max_output_tokens": 4,
        },
    )
    assert second.status_code == 200, second.text
    text = second.json()["output"][0]["content"][0]["text"]
    assert prompt.table_rows(text) == [(2, images.digest_of(PNG1)[:8])]
    # no new user message: the stored one's image is a hash now, so the model gets its label
    third = client.post(
        "/v1/responses",
        json={"previous_response_id": second.json()["id"], "input": [], "max_output_tokens": 4},
    )
    assert third.status_code == 200, third.text
    assert prompt.TABLE_MARK not in third.json()["output"][0]["content"][0]["text"]


# --- the official SDKs --------------------------------------------------------------------------


def test_the_sdks_send_an_image(vlm):
    client, _, _ = vlm
    oa = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="k", http_client=client, max_retries=0)
    out = oa.chat.completions.create(
        model="tiny-gemma3-vl", messages=[user(data_url(PNG2))], max_tokens=6, temperature=0
    )
    assert out.choices[0].message.content.startswith("<details>")
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="x", messages=[user(data_url(PNG2[:-30]))], max_tokens=2)
    assert e.value.code == "invalid_image"
    claude = anthropic.Anthropic(base_url=BASE_URL, api_key="k", http_client=client, max_retries=0)
    msg = claude.messages.create(
        model="x",
        max_tokens=6,
        extra_body={"temperature": 0},
        messages=[anthropic_user(PNG2, text="What is it?")],
    )
    assert msg.content[0].text == out.choices[0].message.content
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model="x",
            max_tokens=2,
            messages=[anthropic_user("AAAA", "image/gif")],
        )


# --- image URLs ---------------------------------------------------------------------------------


class _Images(BaseHTTPRequestHandler):
    hits: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        _Images.hits.append(self.path)
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.end_headers()
        elif self.path == "/img.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG2)))
            self.end_headers()
            self.wfile.write(PNG2)
        elif self.path == "/big":
            self.send_response(200)
            self.end_headers()  # no Content-Length: the cap must hold while reading
            self.wfile.write(PNG2 + bytes(300_000))
        elif self.path == "/slow":
            threading.Event().wait(2)
            self.send_response(200)
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()


@pytest.fixture(scope="module")
def image_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def fetch(url, hosts=(), max_bytes=1_000_000, timeout=5.0):
    return asyncio.run(image_fetch.fetch(url, max_bytes, timeout, hosts))


@pytest.mark.parametrize(
    "url,kind",
    [
        ("http://127.0.0.1:{port}/img.png", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[::1]:{port}/img.png", "loopback"),
        ("http://10.1.2.3/img.png", "private"),
        ("http://[::ffff:127.0.0.1]:{port}/img.png", "loopback"),
        ("http://localhost:{port}/img.png", "loopback"),  # a name: judged by what it resolves to
        ("http://localhost:{port}/redirect?to=http://127.0.0.1:{port}/img.png", "loopback"),
        ("http://localhost:{port}/redirect?to=http://169.254.169.254/", "link-local"),
        ("http://localhost:{port}/redirect?to=http://[::1]:{port}/img.png", "loopback"),
    ],
)
def test_the_fetcher_refuses_non_public_addresses_and_redirects_to_them(image_server, url, kind):
    port = image_server
    url = url.format(port=port)
    hosts = ["localhost"] if "redirect" in url else []  # let the first hop through
    before = list(_Images.hits)
    with pytest.raises(image_fetch.FetchError) as e:
        fetch(url, hosts)
    assert e.value.code == "image_url_refused" and f"a {kind} address" in str(e.value)
    new = _Images.hits[len(before) :]
    assert all(p.startswith("/redirect") for p in new), new  # never reached the image


def test_the_fetcher_caps_size_and_time_and_follows_allowed_redirects(image_server):
    port = image_server
    ok = f"http://localhost:{port}/img.png"
    assert fetch(ok, ["localhost"]) == (PNG2, "image/png")
    redirected = f"http://localhost:{port}/redirect?to=/img.png"
    assert fetch(redirected, ["LOCALHOST"])[0] == PNG2
    with pytest.raises(image_fetch.FetchError) as e:
        fetch(f"http://localhost:{port}/big", ["localhost"], max_bytes=100_000)
    assert e.value.status == 413
    with pytest.raises(image_fetch.FetchError) as e:
        fetch(f"http://localhost:{port}/slow", ["localhost"], timeout=0.5)
    assert "longer than 0.5 s" in str(e.value)
    with pytest.raises(image_fetch.FetchError):
        fetch(f"http://localhost:{port}/missing", ["localhost"])
    with pytest.raises(image_fetch.FetchError) as e:
        fetch("ftp://example.com/x.png")
    assert "only http and https" in str(e.value)
    loop = f"http://localhost:{port}/redirect?to=/redirect?to=/redirect?to=/redirect?to=/img.png"
    with pytest.raises(image_fetch.FetchError) as e:
        fetch(loop, ["localhost"])
    assert "redirects" in str(e.value)


def test_image_urls_through_the_server(vlm, image_server):
    _, gateway, _ = vlm
    port = image_server
    client, _ = make_client(gateway, allow_image_urls=True, image_url_hosts=["localhost"])
    content = answer(
        client.post("/v1/chat/completions", json=chat(user(f"http://localhost:{port}/img.png")))
    )
    assert "| 1 | image_" in content and "| img.png |" in content
    r = client.post("/v1/chat/completions", json=chat(user(f"http://127.0.0.1:{port}/img.png")))
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_url_refused"
    assert "loopback" in r.json()["error"]["message"]
    plain, _ = make_client(gateway, allow_image_urls=True)  # localhost not allowed here
    r = plain.post("/v1/chat/completions", json=chat(user(f"http://localhost:{port}/img.png")))
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_url_refused"


# --- a family mlx-lm has no text class for: mlx-vlm alone --------------------------------------


def test_a_vlm_mlx_lm_cannot_read_is_served_by_mlx_vlm_alone(tiny_dir, tmp_path):
    """Tiny PaliGemma (no chat template: mlx-vlm's own prompt format): image and text requests
    run through mlx-vlm, tokens equal its generate; no adapters; the vision tower is admitted."""
    from mlx_vlm import generate
    from mlx_vlm import load as vlm_load
    from mlx_vlm.prompt_utils import apply_chat_template

    model_dir = tiny_dir("paligemma")
    client, gateway = make_client(model="tiny-paligemma", batch=2)
    done = capture(gateway)
    try:
        vision = gateway.loaded.vision
        assert vision.alone and client.get("/stats").json()["vision"]["alone"] is True
        adm = gateway.loaded.admission
        assert adm.weights_bytes >= vision.own_bytes  # the whole VLM, vision tower included
        ref_model, processor = vlm_load(str(model_dir))
        path = tmp_path / "p.png"
        path.write_bytes(PNG2)
        text = apply_chat_template(
            processor,
            ref_model.config,
            [{"role": "user", "content": "caption en[Image 1]"}],
            num_images=1,
        )
        ref = generate(ref_model, processor, text, image=[str(path)], max_tokens=8, temperature=0)
        n = len(done)
        r = client.post("/v1/chat/completions", json=chat(user(data_url(PNG2), text="caption en")))
        assert prompt.table_rows(answer(r))
        ours = done.after(n).tokens
        assert ours[: len(ref.token_ids)] == ref.token_ids and ref.token_ids
        # text: /v1/completions through mlx-vlm too (no chat template for /v1/chat/completions)
        c = client.post("/v1/completions", json={"prompt": "caption en", "max_tokens": 4})
        assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] >= 1, c.text
        assert client.get("/stats").json()["batch"]["served_serial"] >= 2  # never batched
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "adapter": "a"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_not_supported"
    finally:
        gateway.stop()
