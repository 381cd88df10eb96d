"""The server in-process on a tiny model: endpoints, streaming, stops, cache, admission, errors."""

from __future__ import annotations

import json
import threading

import pytest
from anthropic.types import ModelInfo as AnthropicModel
from openai.types import Model as OpenAIModel

from mlxlab.serve import ask, pipeline
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.jobs import Delta, Done, Job, QueueFull, Sampling
from tests.helpers.serve import SYSTEM, make_client, sse_events, streamed_content


@pytest.fixture(scope="module")
def server(tiny_dir):
    tiny_dir("gemma3")
    client, gateway = make_client()
    yield client, gateway
    gateway.stop()


def chat(user="What does zip do?", **kw):
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "temperature": 0,
        "max_tokens": 24,
        **kw,
    }


def test_status_endpoints_and_request_ids(server):
    client, _ = server
    r = client.get("/health")
    assert (
        r.status_code == 200
        and r.json()["status"] == "ok"
        and r.headers["x-request-id"].startswith("req_")
    )
    assert (
        client.get("/health", headers={"X-Request-ID": "abc-1"}).headers["x-request-id"] == "abc-1"
    )
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-gemma3" and models["data"][0]["context_length"] > 0
    assert client.get("/v1/models/tiny-gemma3").json()["id"] == "tiny-gemma3"
    # One body for both SDKs (found by a client-SDK probe: Anthropic's types refused it).
    assert models["first_id"] == models["last_id"] == "tiny-gemma3" and not models["has_more"]
    for card in (models["data"][0], client.get("/v1/models/tiny-gemma3").json()):
        assert OpenAIModel.model_validate(card).id == AnthropicModel.model_validate(card).id
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    stats = client.get("/stats").json()
    assert {"server", "prompt_cache", "admission", "queue"} <= set(stats)
    assert stats["admission"]["max_safe_context"] == models["data"][0]["context_length"]


def test_stream_and_non_stream_are_identical_at_temperature_0(server):
    client, _ = server
    body = chat(model="anything-goes")
    plain = client.post("/v1/chat/completions", json=body).json()
    assert plain["model"] == "tiny-gemma3" and plain["object"] == "chat.completion"
    msg = plain["choices"][0]
    assert msg["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 24
    r = client.post(
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed_content(events) == msg["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24
    for special in ("<end_of_turn>", "<start_of_turn>", "<eos>", "<bos>"):
        assert special not in msg["message"]["content"]


def test_stop_sequences_spanning_tokens(server):
    client, _ = server
    full = client.post("/v1/chat/completions", json=chat(max_tokens=40)).json()["choices"][0][
        "message"
    ]["content"]
    assert len(full) > 12
    stop = full[5:9]  # likely spans a token boundary; matched on text either way
    cut = full.index(stop)
    r = client.post(
        "/v1/chat/completions", json=chat(max_tokens=40, stop=[stop, "\u2603never"])
    ).json()
    assert (
        r["choices"][0]["message"]["content"] == full[:cut]
        and r["choices"][0]["finish_reason"] == "stop"
    )
    s = client.post("/v1/chat/completions", json=chat(max_tokens=40, stop=stop, stream=True))
    events = sse_events(s.text)
    assert streamed_content(events) == full[:cut]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_prompt_cache_reuses_the_system_prompt_and_changes_nothing(server):
    client, gateway = server
    first = client.post("/v1/chat/completions", json=chat("Tell me about itertools.")).json()
    again = client.post("/v1/chat/completions", json=chat("Tell me about functools.")).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stats = client.get("/stats").json()["prompt_cache"]
    assert stats["hits"] >= 1 and stats["entries"] >= 1 and 0 < stats["bytes"] <= stats["max_bytes"]
    # The same request with the cache off gives the same tokens.
    cold_client, cold = make_client(prompt_cache_gb=0)
    try:
        cold_first = cold_client.post(
            "/v1/chat/completions", json=chat("Tell me about itertools.")
        ).json()
        cold_again = cold_client.post(
            "/v1/chat/completions", json=chat("Tell me about functools.")
        ).json()
        assert cold_again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold_first["choices"][0]["message"] == first["choices"][0]["message"]
        assert cold_again["choices"][0]["message"] == again["choices"][0]["message"]
    finally:
        cold.stop()


def test_second_turn_reuses_the_first(server):
    client, _ = server
    body = chat("List three builtins.", max_tokens=16)
    first = client.post("/v1/chat/completions", json=body).json()
    answer = first["choices"][0]["message"]["content"]
    turn2 = {
        **body,
        "messages": body["messages"]
        + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And three more?"},
        ],
    }
    second = client.post("/v1/chat/completions", json=turn2).json()
    # The whole first prompt (and the answer, where it re-tokenizes the same) comes from the cache.
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= first["usage"]["prompt_tokens"] - 1
    )


def test_completions_and_logprobs(server):
    client, _ = server
    r = client.post(
        "/v1/completions",
        json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "logprobs": 2},
    )
    c = r.json()["choices"][0]
    assert r.json()["object"] == "text_completion" and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == 6 and all(
        len(t) == 2 for t in c["logprobs"]["top_logprobs"]
    )
    assert "".join(c["logprobs"]["tokens"]) == c["text"]
    offsets = c["logprobs"]["text_offset"]  # where each token starts in the text
    assert [c["text"][o:] for o in offsets] == [
        "".join(c["logprobs"]["tokens"][i:]) for i in range(6)
    ]
    s = client.post(
        "/v1/completions",
        json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "stream": True},
    )
    assert "".join(e["choices"][0]["text"] for e in sse_events(s.text) if e["choices"]) == c["text"]
    s = client.post(
        "/v1/completions",
        json={
            "prompt": "def f(x):",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "logprobs": 1,
        },
    )
    streamed = [
        o
        for e in sse_events(s.text)
        if e["choices"] and e["choices"][0]["logprobs"]
        for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert streamed == offsets  # counted across the stream's chunks
    lp = client.post(
        "/v1/chat/completions", json=chat(logprobs=True, top_logprobs=3, max_tokens=5)
    ).json()
    entries = lp["choices"][0]["logprobs"]["content"]
    assert len(entries) == 5 and all(len(e["top_logprobs"]) == 3 for e in entries)
    assert all(
        e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
        for e in entries
    )


def test_seeded_sampling_is_reproducible(server):
    client, _ = server

    def sample(seed):
        body = chat(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=12)
        return client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"][
            "content"
        ]

    a = sample(7)
    assert sample(7) == a
    assert sample(-1) == sample(2**64 - 1)  # int64 seeds: -1 is 2**64 - 1 as MLX's uint64
    # Sampling is really used: other seeds give other text (and greedy decoding a fixed one).
    others = {sample(seed) for seed in (8, 9, 10)}
    assert others - {a}, "three other seeds all gave the seed-7 text"
    assert len(others | {a}) >= 3


@pytest.mark.parametrize(
    "body,param",
    [
        (b"{not json", None),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]},
            "stop",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}, "logit_bias"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:x"}}],
                    }
                ]
            },
            "messages[0].content",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
            "tool_choice",
        ),
        ({"messages": "hello"}, "messages"),
        ([1, 2, 3], None),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 2**64}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"١٢": 1}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"9" * 5001: 1}},
            "logit_bias",
        ),
        # found by a bad-input battery: each was a 500
        (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', None),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
            b'"function": {"name": "f", "description": "\\udc00"}}]}',
            None,
        ),
    ],
)
def test_bad_bodies_are_400_in_openai_shape(server, body, param):
    client, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(
        "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    assert r.headers["x-request-id"]


def test_text_far_past_the_context_is_refused_before_tokenizing(server):
    """Megabytes of text: a 400 from its length alone (each token spells at most
    `token_chars` characters), never a tokenizer run that holds the render thread."""
    client, gateway = server
    loaded = gateway.loaded
    chars = loaded.token_chars * pipeline.LENGTH_SLACK * (loaded.admission.max_safe_context + 2)
    calls = []
    encode = loaded.tokenizer.encode
    loaded.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    try:
        r = client.post("/v1/completions", json={"prompt": "a" * chars, "max_tokens": 2})
        m = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a" * chars}]}]
            },
        )
    finally:
        loaded.tokenizer.encode = encode
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_over_budget"
    assert r.json()["error"]["param"] == "prompt" and not calls
    err = m.json()["error"]
    assert m.status_code == 400 and err["param"] == "messages"
    assert err["code"] == "context_over_budget" and "characters are more than" in err["message"]
    ok = client.post("/v1/completions", json={"prompt": "a" * 64, "max_tokens": 2})
    assert ok.status_code == 200


def test_surrogates_lone_and_paired(server):
    """A lone surrogate escape (or its raw UTF-8 bytes) is a 400 saying so; a valid pair (an
    escaped emoji, as json.dumps writes it) is ordinary text."""
    client, _ = server
    head = b'{"messages": [{"role": "user", "content": "'
    tail = b'"}], "max_tokens": 2}'
    for bad in (b"a\\ud800", b"\\udc00b", b"\xed\xa0\x80"):
        r = client.post(
            "/v1/chat/completions",
            content=head + bad + tail,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "lone UTF-16 surrogate" in r.text, (bad, r.text)
    pair = client.post(
        "/v1/chat/completions",
        content=head + b"\\ud83d\\ude00" + tail,
        headers={"content-type": "Application/JSON; charset=utf-8"},
    )
    assert pair.status_code == 200, pair.text


def test_unknown_routes_and_methods(server):
    client, _ = server
    form = client.post(
        "/v1/chat/completions",
        content=b'{"messages": []}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )  # what `curl -d` sends
    assert form.status_code == 400 and "Content-Type: application/json" in form.text
    assert (
        client.get("/v1/nothing").status_code == 404 and "error" in client.get("/v1/nothing").json()
    )
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    bad = client.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 2})
    assert bad.status_code == 400
    echo = client.post("/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1})
    assert echo.status_code == 400 and "echo with logprobs" in echo.json()["error"]["message"]
    suffix = client.post("/v1/completions", json={"prompt": "x", "suffix": "y"})
    assert suffix.status_code == 400 and suffix.json()["error"]["param"] == "suffix"
    for prompt, n in (([], 1), ([[1], []], 1), (["a"] * 9, 1), (["a", "b", "c"], 3)):
        r = client.post("/v1/completions", json={"prompt": prompt, "n": n, "max_tokens": 2})
        assert r.status_code == 400, (prompt, n)


def test_memory_admission(server):
    from mlxlab.serve.engine.admission import RESERVE_BYTES

    adm = server[1].loaded.admission  # a budget that holds 600 tokens of this model
    budget = (
        adm.weights_bytes
        + RESERVE_BYTES
        + 600 * (adm.full_kv_bytes_per_token + adm.score_bytes_per_token)
        + adm.sliding_window * adm.sliding_kv_bytes_per_token
    )
    client, gateway = make_client(memory_budget_gb=budget / 1e9)
    try:
        ceiling = gateway.loaded.admission.max_safe_context
        assert abs(ceiling - 600) <= 1
        r = client.post("/v1/chat/completions", json=chat(max_tokens=ceiling))
        assert r.status_code == 400
        assert (
            r.json()["error"]["type"] == "memory_admission"
            and r.json()["error"]["code"] == "context_over_budget"
        )
        # Without max_tokens the default is clamped to what fits.
        ok = client.post("/v1/chat/completions", json={**chat(), "max_tokens": None})
        assert ok.status_code == 200
        assert client.get("/stats").json()["admission"]["memory_budget_bytes"] == int(budget)
    finally:
        gateway.stop()


def test_admission_counts_sliding_and_full_layers(server):
    _, gateway = server
    adm = gateway.loaded.admission
    assert (
        adm.full_kv_bytes_per_token > 0
        and adm.sliding_kv_bytes_per_token > 0
        and adm.sliding_window > 0
    )
    assert adm.bytes_for(10 * adm.sliding_window) - adm.bytes_for(
        9 * adm.sliding_window
    ) == adm.sliding_window * (adm.full_kv_bytes_per_token + adm.score_bytes_per_token)


def test_full_queue_answers_503_with_retry_after(tiny_dir):
    client, gateway = make_client(max_queue=1)
    release = threading.Event()
    try:
        blocker = Job(prompt=[2, 5, 6, 7], max_tokens=4, sink=lambda ev: release.wait(30))
        gateway.submit(blocker)
        with pytest.raises(QueueFull):
            gateway.submit(Job(prompt=[2, 5], max_tokens=1, sink=lambda ev: None))
        r = client.post("/v1/chat/completions", json=chat())
        assert (
            r.status_code == 503
            and r.headers["retry-after"]
            and r.json()["error"]["code"] == "queue_full"
        )
        release.set()
        import time

        deadline = time.time() + 30
        while gateway.pending and time.time() < deadline:
            time.sleep(0.05)
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    finally:
        release.set()
        gateway.stop()


def test_n_choices_that_do_not_fit_the_queue_give_their_leases_back(tiny_dir):
    """Four choices and a queue of one (plus the engine's own): a 503, streamed or not, and no
    choice's lease is left behind (each cancelled or refused job gives its own back)."""
    client, gateway = make_client(max_queue=1)

    def in_flight():
        models = client.get("/stats").json()["models"]["models"]
        return next(m for m in models if m["default"])["in_flight"]

    try:
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json=chat(n=4, stream=stream))
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
            import time

            deadline = time.time() + 30
            while (gateway.pending or in_flight()) and time.time() < deadline:
                time.sleep(0.05)
            assert in_flight() == 0
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    finally:
        gateway.stop()


def test_a_streamed_n_starts_before_its_first_choices_end(server):
    """A re-probe found the headers held until choices 0..n-2 had ended (each choice's first
    token awaited in turn): now all are submitted and the stream starts at once, so after its
    first line all three choices still hold their leases. The client leaving cancels them."""
    client, gateway = server
    eos = sorted(gateway.loaded.eos)
    body = chat(n=3, stream=True, max_tokens=400, logit_bias={str(t): -100 for t in eos})

    def in_flight():
        models = client.get("/stats").json()["models"]["models"]
        return next(m for m in models if m["default"])["in_flight"]

    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
        assert in_flight() == 3
    import time

    deadline = time.time() + 30
    while in_flight() and time.time() < deadline:
        time.sleep(0.05)
    assert in_flight() == 0
    # n and logprobs may be null, as OpenAI's schema allows
    r = client.post("/v1/chat/completions", json=chat(n=None, logprobs=None, max_tokens=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_cancelled_job_stops_within_a_step(server):
    _, gateway = server
    got, finished = [], threading.Event()
    job = Job(
        prompt=gateway.loaded.tokenizer.encode("def f(x):"),
        max_tokens=500,
        sink=None,
        sampling=Sampling(temperature=0.0),
    )

    def sink(ev):
        got.append(ev)
        if sum(isinstance(e, Delta) for e in got) == 3:
            job.cancelled.set()
        if isinstance(ev, Done):
            finished.set()

    job.sink = sink
    gateway.submit(job)
    assert finished.wait(60)
    done = got[-1]
    assert done.finish_reason == "cancelled" and done.completion_tokens <= 5
    assert gateway.stats()["cancelled"] >= 1


def test_a_request_without_max_tokens_gets_the_server_default_and_a_long_one_is_logged(
    server, caplog
):
    """/v1/completions with no max_tokens runs up to serve.max_tokens (1024 by default; OpenAI's
    legacy endpoint stops at 16), and an answer still generating after serve.read_timeout_s is
    logged once, saying so."""
    client, gateway = server
    cfg = client.app.state.cfg
    job = pipeline.make_job(gateway, cfg, ask.Ask(prompt="def f(x):"))
    assert job.default_limit and job.max_tokens == cfg.max_tokens == 1024
    assert job.slow_s == cfg.read_timeout_s
    given = pipeline.make_job(gateway, cfg, ask.Ask(prompt="def f(x):", max_tokens=7))
    assert not given.default_limit and given.max_tokens == 7
    # the same job, as if its client's timeout were tiny: the warning comes once, mid-answer
    got, finished = [], threading.Event()
    job.max_tokens, job.slow_s, job.id = 12, 1e-6, "cmpl-slow"
    job.sampling = Sampling(temperature=0.0)
    job.sink = lambda ev: (got.append(ev), isinstance(ev, Done) and finished.set())
    with caplog.at_level("WARNING", logger="mlxlab.serve.engine.rows"):
        gateway.submit(job)
        assert finished.wait(60)
    slow = [r.getMessage() for r in caplog.records if "cmpl-slow" in r.getMessage()]
    assert len(slow) == 1, slow
    assert "past serve.read_timeout_s" in slow[0] and "gave no max_tokens" in slow[0]


def test_sampling_precedence(server):
    _, gateway = server
    loaded = gateway.loaded
    from mlxlab.serve.openai.protocol import ChatRequest

    req = ChatRequest(messages=[{"role": "user", "content": "x"}], top_k=5)
    old = dict(loaded.generation_config)
    try:
        loaded.generation_config.update({"temperature": 0.6, "top_k": 64, "top_p": 0.95})
        s = ask.resolve_sampling(
            ask.SamplingAsk.of(req), ServeConfig(model="tiny-gemma3", top_p=0.5), loaded
        )
        assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.6, 0.5, 5, 0.0)
    finally:
        loaded.generation_config.clear()
        loaded.generation_config.update(old)


def test_n_choices_seeded_one_by_one_streamed_and_not(server):
    """OpenAI's `n` (a client-SDK probe found it refused): choice i is the answer with seed
    seed + i; usage counts the prompt once; the stream interleaves the choices by index, with
    one usage chunk and one [DONE]; completions too."""
    client, _ = server
    body = chat(temperature=1.0, seed=7, max_tokens=12)
    many = client.post("/v1/chat/completions", json={**body, "n": 3}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    alone = [
        client.post("/v1/chat/completions", json={**body, "seed": 7 + i}).json() for i in range(3)
    ]
    for c, one in zip(many["choices"], alone, strict=True):
        assert c["message"] == one["choices"][0]["message"]
    u = many["usage"]
    assert u["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    streamed = {"stream": True, "stream_options": {"include_usage": True}, "n": 3}
    r = client.post("/v1/chat/completions", json={**body, **streamed})
    events = sse_events(r.text)
    assert [e for e in events if not e["choices"]] == [events[-1]]  # one usage chunk, last
    streamed_usage = events[-1]["usage"]  # (its cached_tokens: the prompt cache is warm now)
    assert all(streamed_usage[k] == u[k] for k in ("prompt_tokens", "completion_tokens"))
    for i in range(3):
        mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert streamed_content(mine) == many["choices"][i]["message"]["content"]
        assert mine[-1]["choices"][0]["finish_reason"] == many["choices"][i]["finish_reason"]
    legacy = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 3}
    two = client.post("/v1/completions", json={**legacy, "n": 2}).json()
    one = client.post("/v1/completions", json={**legacy, "seed": 4}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][1]["text"] == one["choices"][0]["text"]


def test_completions_prompt_list_and_echo(server):
    """The legacy endpoint's list of prompts (texts or token-id lists; a client-SDK probe found it
    refused): prompt p's choice i has index p * n + i, and is the answer that prompt alone gets;
    usage counts every prompt once. `echo` answers the prompt's text before the completion's,
    streamed as the first chunk."""
    client, gateway = server
    greedy = {"max_tokens": 5, "temperature": 0}
    prompts = ["Once upon a time", "The capital of France"]
    alone = [client.post("/v1/completions", json={**greedy, "prompt": p}).json() for p in prompts]
    both = client.post("/v1/completions", json={**greedy, "prompt": prompts, "n": 2}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in both["choices"]]
    assert texts == [alone[0]["choices"][0]["text"]] * 2 + [alone[1]["choices"][0]["text"]] * 2
    u = both["usage"]
    assert u["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert u["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
    ids = [gateway.loaded.tokenizer.encode(p) for p in prompts]
    by_ids = client.post("/v1/completions", json={**greedy, "prompt": ids, "echo": True}).json()
    assert [c["text"] for c in by_ids["choices"]] == [
        p + a["choices"][0]["text"] for p, a in zip(prompts, alone, strict=True)
    ]  # (echoed without the BOS the ids start with)
    echoed = client.post("/v1/completions", json={**greedy, "prompt": prompts[0], "echo": True})
    assert echoed.json()["choices"][0]["text"] == prompts[0] + alone[0]["choices"][0]["text"]
    r = client.post(
        "/v1/completions", json={**greedy, "prompt": prompts, "echo": True, "stream": True}
    )
    events = [e for e in sse_events(r.text) if e["choices"]]
    for k, p in enumerate(prompts):
        mine = [e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == k]
        assert mine[0] == p and "".join(mine) == p + alone[k]["choices"][0]["text"]
