"""Edges of the HTTP side that a battery found (issue 56): a 405's `Allow` header, the length and
characters of an echoed X-Request-ID, NaN/Infinity literals in JSON bodies."""

from __future__ import annotations

import pytest

from tests.helpers.serve import make_client


@pytest.fixture(scope="module")
def client(tiny_dir, tmp_path_factory):
    tiny_dir("gemma3")
    client, gateway = make_client(
        max_tokens=4,
        adapter_root=str(tmp_path_factory.mktemp("adapters")),
        embeddings_model="tiny-bert",
    )
    yield client
    gateway.stop()


# --- 405 + Allow (RFC 9110 15.5.6) ---------------------------------------------------------


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("GET", "/v1/messages", "POST"),
        ("PUT", "/v1/responses/resp_1", "DELETE, GET"),  # two routes on one path
        ("PUT", "/v1/adapters", "GET, POST"),  # a GET and a POST in two routers
        ("DELETE", "/health", "GET, HEAD"),
        ("POST", "/metrics", "GET"),
        ("GET", "/v1/embeddings", "POST"),
    ],
)
def test_a_405_says_which_methods_the_path_takes(client, method, path, allow):
    r = client.request(method, path)
    assert r.status_code == 405
    assert r.headers.get("allow") == allow
    body = r.json()
    assert (body["error"]["type"] if "error" in body else None) == "invalid_request_error"


# --- X-Request-ID ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given",
    ["abc-1", "0d6f2c1e-8b7a-4c3e-9f00-123456789abc", "trace:4bf92f35/00f067aa=+@_.", "x" * 128],
)
def test_an_acceptable_request_id_is_echoed(client, given):
    assert client.get("/health", headers={"X-Request-ID": given}).headers["x-request-id"] == given


@pytest.mark.parametrize(
    "given",
    [
        "x" * 129,
        "x" * 5000,
        "a b",
        "<script>alert(1)</script>",
        "id\tsplit",
        b"caf\xe9",  # latin-1 bytes on the wire
        "a;b=c,d",
    ],
)
def test_an_unacceptable_request_id_is_replaced(client, given):
    r = client.get("/health", headers={"X-Request-ID": given})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert rid.startswith("req_") and len(rid) == 36


# --- NaN / Infinity -------------------------------------------------------------------------

USER = '[{"role": "user", "content": "NaN and Infinity are fine in a string"}]'


@pytest.mark.parametrize(
    "path, body, field, literal",
    [
        (
            "/v1/chat/completions",
            f'{{"messages": {USER}, "temperature": NaN}}',
            "temperature",
            "NaN",
        ),
        ("/v1/chat/completions", f'{{"messages": {USER}, "top_p": Infinity}}', "top_p", "Infinity"),
        (
            "/v1/chat/completions",
            f'{{"messages": {USER}, "logit_bias": {{"3": -Infinity}}}}',
            "logit_bias.3",
            "-Infinity",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": {USER}, "metadata": {{"a": NaN}}}}',  # a field nothing bounds
            "metadata.a",
            "NaN",
        ),
        (
            "/v1/completions",
            '{"prompt": "x", "presence_penalty": -Infinity}',
            "presence_penalty",
            "-Infinity",
        ),
        (
            "/v1/messages",
            f'{{"model": "x", "max_tokens": 4, "messages": {USER}, "temperature": NaN}}',
            "temperature",
            "NaN",
        ),
        (
            "/v1/messages/count_tokens",
            f'{{"model": "x", "messages": {USER}, "tools": [{{"name": "f", "input_schema": '
            '{"type": "object", "properties": {"a": {"type": "number", "maximum": Infinity}}}}]}',
            "tools[0].input_schema.properties.a.maximum",
            "Infinity",
        ),
        (
            "/v1/responses",
            '{"input": [{"role": "user", "content": "x"}], "top_p": NaN}',
            "top_p",
            "NaN",
        ),
        ("/v1/embeddings", '{"input": "x", "dimensions": NaN}', "dimensions", "NaN"),
        ("/v1/adapters", '{"id": "a", "path": "x", "scale": NaN}', "scale", "NaN"),
    ],
)
def test_nan_and_infinity_literals_are_a_400_naming_the_field(client, path, body, field, literal):
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    got = r.json()
    if path.startswith("/v1/messages"):
        assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
        message = got["error"]["message"]
    else:
        assert got["error"]["param"] == field
        message = got["error"]["message"]
    assert message.startswith(f"{field}: {literal} is not a JSON number"), message


def test_the_words_inside_strings_are_not_refused(client):
    r = client.post(
        "/v1/chat/completions",
        content=f'{{"messages": {USER}, "max_tokens": 2}}'.encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
