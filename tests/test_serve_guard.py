"""serve/guard.py in-process on a tiny model: API keys (both headers, a key file, the admin key,
each protocol's 401 shape, the SDKs), the Host check against DNS rebinding, Origin and CORS, and
the start-time checks (the warning when exposed without a key, a bad key file)."""

from __future__ import annotations

import logging

import anthropic
import openai
import pytest

from mlxlab import cli
from mlxlab.config import UserError
from mlxlab.serve import cli as serve_cli
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.guard import host_name, is_loopback, load_keys
from tests.helpers.cli import run_cli
from tests.helpers.serve import BASE_URL, make_client, sse_events, streamed_content

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
MESSAGE = {"model": "claude-x", **CHAT}
RESPONSE = {"input": "Hi", "max_output_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def gateway(tiny_dir):
    tiny_dir("gemma3")
    _, g = make_client()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def keyed(gateway):
    """API key "k1" and the admin key "adm"."""
    c, _ = make_client(gateway, api_key="k1", admin_key="adm")
    return c


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_401(r):
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert r.headers["x-request-id"]
    return err


def test_missing_or_wrong_key_is_401_in_each_protocols_shape(keyed):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x"})):
        err = assert_openai_401(keyed.post(path, json=body))
        assert err["message"].startswith("no API key given")
        err = assert_openai_401(keyed.post(path, json=body, headers=bearer("k2")))
        assert err["message"].startswith("invalid API key") and "k2" not in err["message"]
    assert_openai_401(keyed.post("/v1/responses", json=RESPONSE, headers={"x-api-key": "nope"}))
    assert_openai_401(keyed.get("/v1/responses/resp_x"))
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = keyed.post(path, json=MESSAGE, headers={"x-api-key": "k2"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
        }
    # Every route but /health, unknown paths included (no route list to forget one in).
    for path in ("/v1/models", "/stats", "/v1/adapters", "/metrics", "/openapi.json", "/nowhere"):
        assert_openai_401(keyed.get(path))
    assert_openai_401(keyed.get("/v1/models", headers={"Authorization": "Basic k1"}))
    assert_openai_401(keyed.get("/v1/models", headers={"Authorization": "Bearer"}))


def test_both_header_forms_open_every_protocol(keyed):
    chat = keyed.post("/v1/chat/completions", json=CHAT, headers=bearer("k1"))
    assert chat.status_code == 200, chat.text
    text = chat.json()["choices"][0]["message"]["content"]
    again = keyed.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "k1"})
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == text
    msg = keyed.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "k1"})
    assert msg.status_code == 200 and msg.json()["content"][0]["text"] == text
    resp = keyed.post("/v1/responses", json=RESPONSE, headers={"authorization": "bearer k1"})
    assert resp.status_code == 200 and resp.json()["output"][0]["content"][0]["text"] == text
    # A wrong value in one header does not spoil a right one in the other.
    both = {"Authorization": "Bearer wrong", "x-api-key": "k1"}
    assert keyed.get("/v1/models", headers=both).status_code == 200
    # The admin key opens the ordinary routes too.
    assert keyed.get("/stats", headers=bearer("adm")).status_code == 200


def test_health_stays_open(keyed):
    r = keyed.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.headers["x-request-id"]
    assert keyed.head("/health").status_code == 200
    assert keyed.post("/health").status_code == 401  # only GET/HEAD /health are open


def test_streaming_with_a_key(keyed):
    r = keyed.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=bearer("k1"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    plain = keyed.post("/v1/chat/completions", json=CHAT, headers=bearer("k1")).json()
    assert streamed_content(events) == plain["choices"][0]["message"]["content"]
    r = keyed.post("/v1/messages", json={**MESSAGE, "stream": True}, headers={"x-api-key": "k1"})
    assert r.status_code == 200 and "event: message_stop" in r.text


def test_the_sdks_with_a_key(keyed):
    ok = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="k1", http_client=keyed, max_retries=0)
    out = ok.chat.completions.create(model="any", **CHAT)
    assert out.choices[0].finish_reason == "length"
    chunks = list(ok.chat.completions.create(model="any", stream=True, **CHAT))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        out.choices[0].message.content
    )
    bad = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="k2", http_client=keyed, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.code == "invalid_api_key"
    claude = anthropic.Anthropic(base_url=BASE_URL, api_key="k1", http_client=keyed, max_retries=0)
    sdk_body = {"model": "x", "messages": CHAT["messages"], "max_tokens": 3}
    msg = claude.messages.create(**sdk_body, extra_body={"temperature": 0})
    assert msg.content[0].text == out.choices[0].message.content
    wrong = anthropic.Anthropic(base_url=BASE_URL, api_key="k2", http_client=keyed, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**sdk_body)


def test_admin_key_guards_the_adapter_mutations(keyed, gateway, tmp_path):
    # A valid API key is 403 there; no key or a wrong one 401; the admin key reaches the route.
    mount = {"id": "a", "path": str(tmp_path / "missing")}
    r = keyed.post("/v1/adapters", json=mount, headers=bearer("k1"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert keyed.delete("/v1/adapters/a", headers={"x-api-key": "k1"}).status_code == 403
    assert_openai_401(keyed.post("/v1/adapters", json=mount))
    assert_openai_401(keyed.delete("/v1/adapters/a", headers=bearer("k2")))
    r = keyed.delete("/v1/adapters/a", headers=bearer("adm"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    # Reading the list is not a state change: the API key does.
    assert keyed.get("/v1/adapters", headers=bearer("k1")).status_code == 200
    assert keyed.get("/v1/adapters/available", headers=bearer("k1")).status_code == 200


def test_admin_key_alone_leaves_the_api_open(gateway):
    c, _ = make_client(gateway, admin_key="adm")
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert_openai_401(c.delete("/v1/adapters/a"))
    assert c.delete("/v1/adapters/a", headers={"x-api-key": "adm"}).status_code == 404


def test_admin_routes_are_closed_without_the_guard():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from mlxlab.serve.admin import router as admin

    bare = FastAPI()
    bare.state.draining = False
    bare.include_router(admin.admin_router)
    r = TestClient(bare).delete("/v1/adapters/a")
    assert r.status_code == 403 and "without serve/guard.py" in r.json()["error"]["message"]


def test_no_key_configured_is_open(gateway):
    c, _ = make_client(gateway)
    assert c.get("/v1/models").status_code == 200
    assert c.delete("/v1/adapters/a", headers=bearer("whatever")).status_code == 404


def test_key_file_with_two_keys_and_the_environment(gateway, tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# one key per client\n\nclient-a\n  client-b  \n# client-c\n")
    monkeypatch.setenv("MLXLAB_API_KEY", "from-env")
    c, _ = make_client(gateway, api_key_file=str(keys))
    for key in ("client-a", "client-b", "from-env"):
        assert c.get("/v1/models", headers=bearer(key)).status_code == 200, key
    for key in ("client-c", "# client-c", "one"):
        assert_openai_401(c.get("/v1/models", headers=bearer(key)))
    # serve.api_key wins over the variable; an empty variable is no key.
    c, _ = make_client(gateway, api_key="flag")
    assert c.get("/v1/models", headers=bearer("flag")).status_code == 200
    assert_openai_401(c.get("/v1/models", headers=bearer("from-env")))
    monkeypatch.setenv("MLXLAB_API_KEY", "")
    monkeypatch.setenv("MLXLAB_ADMIN_KEY", "env-admin")
    c, _ = make_client(gateway)
    assert c.get("/v1/models").status_code == 200
    assert c.post("/v1/adapters", json={"id": "a", "path": "x"}).status_code == 401
    r = c.post("/v1/adapters", json={"id": "a", "path": "/"}, headers=bearer("env-admin"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "outside_adapter_root"


def test_bad_key_files_and_keys_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="cannot read it"):
        load_keys(ServeConfig(api_key_file=str(tmp_path / "none")), {})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(UserError, match="holds no key"):
        load_keys(ServeConfig(api_key_file=str(empty)), {})
    spaced = tmp_path / "spaced"
    spaced.write_text("ok-key\nsecret with spaces\n")
    with pytest.raises(UserError, match=r"spaced:2: an API key must be") as e:
        load_keys(ServeConfig(api_key_file=str(spaced)), {})
    assert "secret" not in str(e.value)
    with pytest.raises(UserError, match="serve.api_key: an API key must be"):
        ServeConfig(api_key="")
    with pytest.raises(UserError, match="MLXLAB_API_KEY: an API key must be"):
        load_keys(ServeConfig(), {"MLXLAB_API_KEY": "has space"})
    with pytest.raises(UserError, match="must differ"):
        load_keys(ServeConfig(api_key="same", admin_key="same"), {})
    assert repr(load_keys(ServeConfig(api_key="secret"), {})) == "Keys(api=1, admin=False)"
    assert "secret" not in repr(ServeConfig(api_key="secret", admin_key="secret-admin"))


@pytest.mark.slow
def test_bad_key_file_exits_1_before_loading(tmp_path):
    r = run_cli("serve", "model=tiny-gemma3", f"api_key_file={tmp_path / 'none'}", timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert (
        lines[-1].startswith("mlxlab serve: error: serve.api_key_file=")
        and "loading" not in r.stderr
    )


def test_warning_when_exposed_without_a_key(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="mlxlab.serve.cli"):
        serve_cli.check_security(ServeConfig(host="0.0.0.0"))
    assert "listening on 0.0.0.0 without an API key" in caplog.text
    assert "mount adapters" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxlab.serve.cli"):
        serve_cli.check_security(ServeConfig(host="::1"))
        serve_cli.check_security(ServeConfig(host="localhost", cors_origins=["http://a.example"]))
        keys = serve_cli.check_security(ServeConfig(host="0.0.0.0", api_key="sekrit-k"))
    assert caplog.text == "" and len(keys.api) == 1
    with caplog.at_level(logging.WARNING, logger="mlxlab.serve.cli"):
        serve_cli.check_security(ServeConfig(cors_origins=["*"]))
    assert "cors_origins=[*] without an API key" in caplog.text
    with pytest.raises(UserError, match="cannot read it"):
        serve_cli.check_security(ServeConfig(api_key_file=str(tmp_path / "none")))


def test_host_names_and_loopback():
    assert host_name("[::1]:8090") == "::1" and host_name("LocalHost.:80") == "localhost"
    assert host_name("a.example") == "a.example" and host_name("::1") == "::1"
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "::1", "[::1]:1", "localhost:8090")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.1", "localhost.evil.example", "")))


def test_host_check_against_dns_rebinding(gateway):
    c, _ = make_client(gateway)
    for host in ("localhost", "localhost:8090", "127.0.0.1:8090", "[::1]:8090", "LOCALHOST"):
        assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8090", "127.0.0.1.evil.example", "10.0.0.2"):
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
        assert r.json()["error"]["type"] == "permission_error" and r.headers["x-request-id"]
    r = c.post("/v1/messages", json=MESSAGE, headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert r.json()["type"] == "error"  # the Anthropic shape
    assert c.get("/health", headers={"Host": "evil.example"}).status_code == 403
    # An allow-listed name is served, with loopback still; `*` serves any.
    c, _ = make_client(gateway, allowed_hosts=["box.lan", "[fd00::1]"])
    for host in ("box.lan", "box.lan:8090", "[fd00::1]:8090", "localhost"):
        assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
    assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403
    c, _ = make_client(gateway, allowed_hosts=["*"])
    assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 200
    # Bound elsewhere: any Host, unless an allow-list is set (then loopback names are not in it).
    c, _ = make_client(gateway, host="0.0.0.0")
    assert c.get("/v1/models", headers={"Host": "10.0.0.2:8090"}).status_code == 200
    c, _ = make_client(gateway, host="0.0.0.0", allowed_hosts=["box.lan"])
    assert c.get("/v1/models", headers={"Host": "box.lan"}).status_code == 200
    assert c.get("/v1/models", headers={"Host": "10.0.0.2"}).status_code == 403


def test_origin_checks_and_cors(gateway):
    c, _ = make_client(gateway, cors_origins=["http://localhost:3000"])
    evil = {"Origin": "https://evil.example"}
    r = c.post("/v1/chat/completions", json=CHAT, headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers and r.headers["x-request-id"]
    r = c.post("/v1/messages", json=MESSAGE, headers={"Origin": "null"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert c.delete("/v1/responses/resp_x", headers=evil).status_code == 403
    # A read from another origin is answered, without CORS headers (the browser hides it).
    r = c.get("/v1/models", headers=evil)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # A listed origin gets the CORS headers, streams included.
    ok = {"Origin": "http://localhost:3000"}
    r = c.post("/v1/chat/completions", json=CHAT, headers=ok)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ok["Origin"]
    assert (
        r.headers["vary"] == "Origin"
        and "x-request-id" in r.headers["access-control-expose-headers"]
    )
    r = c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=ok)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ok["Origin"]
    # The server's own origin (a page it serves) is allowed; SDKs send no Origin at all.
    assert (
        c.post("/v1/chat/completions", json=CHAT, headers={"Origin": BASE_URL}).status_code == 200
    )
    same = {"Host": "127.0.0.1:8090", "Origin": "http://127.0.0.1:8090"}
    assert c.post("/v1/chat/completions", json=CHAT, headers=same).status_code == 200
    other_port = {"Host": "127.0.0.1:8090", "Origin": "http://127.0.0.1:8091"}
    assert c.post("/v1/chat/completions", json=CHAT, headers=other_port).status_code == 403
    # `*` allows any origin (echoed).
    c, _ = make_client(gateway, cors_origins=["*"])
    r = c.post("/v1/chat/completions", json=CHAT, headers=evil)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == evil["Origin"]


def test_preflight(gateway):
    c, _ = make_client(gateway, api_key="k1", cors_origins=["http://localhost:3000"])
    ask = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    r = c.options("/v1/chat/completions", headers=ask)  # no key: browsers send none here
    assert r.status_code == 204 and r.content == b""
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = r.headers["access-control-allow-headers"].split(", ")
    for h in ("authorization", "x-api-key", "content-type", "anthropic-version", "x-request-id"):
        assert h in allowed
    assert "x-stainless-os" in allowed and r.headers["x-request-id"]
    r = c.options("/v1/messages", headers={**ask, "Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["type"] == "error"
    assert "access-control-allow-origin" not in r.headers
    # A plain OPTIONS (no Origin) is no preflight: it needs the key like any request.
    assert_openai_401(c.options("/v1/chat/completions"))
    # The real request after the preflight: the key, and the CORS headers on the 401 too.
    r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": ask["Origin"]})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ask["Origin"]
    r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": ask["Origin"], **bearer("k1")})
    assert r.status_code == 200


def test_websocket_handshake_is_guarded_too(gateway):
    from starlette.websockets import WebSocketDisconnect

    c, _ = make_client(gateway, api_key="k1")
    with pytest.raises(WebSocketDisconnect) as refused:
        with c.websocket_connect("ws://localhost/ws"):
            pass
    assert refused.value.code == 1008
    with pytest.raises(WebSocketDisconnect) as unrouted:  # past the guard: no such route
        with c.websocket_connect("ws://localhost/ws", headers=bearer("k1")):
            pass
    assert unrouted.value.code != 1008


def test_security_settings_through_the_command_line():
    cfg = cli.compose(
        "serve",
        [
            "allowed_hosts=[a.example,b.example]",
            "cors_origins=[http://localhost:3000,https://app.example]",
            "api_key=12345",
            "admin_key=sk-admin",
        ],
    )
    assert cfg.allowed_hosts == ["a.example", "b.example"]
    assert cfg.cors_origins == ["http://localhost:3000", "https://app.example"]
    assert cfg.api_key == "12345" and cfg.admin_key == "sk-admin"
    assert cli.compose("serve", ["cors_origins=[*]"]).cors_origins == ["*"]
    with pytest.raises(UserError, match="scheme://host"):
        cli.compose("serve", ["cors_origins=[http://localhost:3000/]"])
    with pytest.raises(UserError, match="not a host name"):
        cli.compose("serve", ["allowed_hosts=[http://a.example]"])
