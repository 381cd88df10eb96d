"""Several models behind one server (serve `models.NAME=SPEC`, engine/entries.py, engine/models.py,
engine/loader.py): tiny models of three families answer alternately and in parallel with the
texts they give served alone; an unknown model is a 404 on every protocol; eviction under a small
budget and reload; idle unload; a load that fails leaves the others serving; a model too large is
refused; paced loads; leases; /v1/models, /stats and /metrics per model. Adapters on several
models (mount lists) and shared tokenizers: tests/test_serve_mounts.py."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import weakref

import httpx
import pytest

import mlxlab  # noqa: F401  (BLAS before MLX)
from mlxlab.serve.engine.admission import RESERVE_BYTES
from tests.helpers.models import (
    PROMPTS,
    SMALL,
    all_at_once,
    complete,
    hold_engine,
    model_stats,
    post_in_thread,
    stats_of,
    wait_for,
    weights,
)
from tests.helpers.serve import make_client


@pytest.fixture(scope="module")
def served(tiny_dir):
    for spec in SMALL.values():  # pulled: an unloaded model's card reads its files
        tiny_dir(spec.removeprefix("tiny-"))
    client, gateway = make_client(models=SMALL, batch=4)
    yield client, gateway
    gateway.stop()


def test_models_answer_alternately_as_served_alone(served, alone):
    client, _ = served
    for p_i, prompt in enumerate(PROMPTS):
        for name in ("tiny-gemma3", "small", "qwen", "small", "tiny-gemma3"):
            assert complete(client, name, prompt) == alone[name][p_i], (name, prompt)
    # the default answers a request that names no model
    r = client.post(
        "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    )
    assert r.json()["model"] == "tiny-gemma3"
    assert r.json()["choices"][0]["text"] == alone["tiny-gemma3"][0]


def test_models_answer_in_parallel_as_served_alone(served, alone):
    client, _ = served
    work = [(name, i) for name in ("tiny-gemma3", "small", "qwen") for i in range(len(PROMPTS))]
    got = all_at_once(lambda name, i: complete(client, name, PROMPTS[i], max_tokens=8), work)
    for name, i in work:
        assert got[name, i] == alone[name][i], (name, i)


def test_models_listed_and_counted(served):
    client, _ = served
    complete(client, "small", PROMPTS[0])
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"tiny-gemma3", "small", "qwen"}
    assert cards["tiny-gemma3"]["default"] and not cards["small"]["default"]
    for card in cards.values():
        assert card["size_bytes"] > 0 and card["context_length"] > 0
    assert cards["small"]["loaded"] and cards["small"]["state"] == "loaded"
    assert client.get("/v1/models/small").json()["id"] == "small"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    small = stats_of(client, "small")
    assert small["loads"] == 1 and small["requests"] >= 1 and small["completion_tokens"] >= 1
    assert small["last_load_seconds"] is not None
    metrics = client.get("/metrics").text
    assert 'mlxlab_model_loads_total{model="small"} 1.0' in metrics
    assert 'mlxlab_model_requests_total{model="small"}' in metrics


def test_unknown_model_on_every_protocol(served):
    client, _ = served
    chat = [{"role": "user", "content": "hi"}]
    openai = [
        ("/v1/chat/completions", {"model": "nope", "messages": chat}),
        ("/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("/v1/responses", {"model": "nope", "input": "hi"}),
    ]
    for path, body in openai:
        r = client.post(path, json=body)
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "'nope'" in err["message"], path
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(path, json={"model": "nope", "max_tokens": 8, "messages": chat})
        assert r.status_code == 404, (path, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error", path
        assert "'nope'" in body["error"]["message"]


def test_model_picked_on_anthropic_and_responses(served):
    client, _ = served
    chat = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/messages", json={"model": "qwen", "max_tokens": 4, "messages": chat})
    assert r.status_code == 200 and r.json()["model"] == "qwen", r.text
    r = client.post(
        "/v1/messages/count_tokens", json={"model": "qwen", "max_tokens": 4, "messages": chat}
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    r = client.post("/v1/responses", json={"model": "small", "input": "hi", "max_output_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == "small", r.text


def test_one_model_server_answers_any_name(tiny_dir):
    """Without `models`, the one model answers whatever a request names (as it always has)."""
    client, gateway = make_client()
    try:
        r = client.post(
            "/v1/completions", json={"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["model"] == "tiny-gemma3"
    finally:
        gateway.stop()


def test_an_alias_answers_under_the_name_asked_for(tiny_dir):
    """models.NAME=SPEC with the default's spec is another name for the default model: its
    answers echo the name asked for (as OpenAI clients expect), on every protocol."""
    client, gateway = make_client(models={"alias": "tiny-gemma3", **SMALL})
    try:
        assert complete(client, "alias", PROMPTS[0]) == complete(client, "tiny-gemma3", PROMPTS[0])
        chat = [{"role": "user", "content": "hi"}]
        r = client.post("/v1/messages", json={"model": "alias", "max_tokens": 2, "messages": chat})
        assert r.status_code == 200 and r.json()["model"] == "alias"
        r = client.post("/v1/responses", json={"model": "alias", "input": "hi"})
        assert r.status_code == 200 and r.json()["model"] == "alias"
    finally:
        gateway.stop()


def test_eviction_under_a_small_budget_and_reload(tiny_dir, alone):
    """The default and one other fit, not two others: asking for the second evicts the first
    (least recently used, idle), asking for the first again reloads it, with the same answers."""
    w = {f: weights(tiny_dir, f) for f in ("gemma3", "llama", "qwen2")}
    room = 600_000  # under either small model's weights: two of them never fit
    assert room < min(w["llama"], w["qwen2"])
    budget = RESERVE_BYTES + w["gemma3"] + max(w["llama"], w["qwen2"]) + room
    client, gateway = make_client(models=SMALL, memory_budget_gb=budget / 1e9, prefill_step=16)
    try:
        assert complete(client, "small", PROMPTS[0]) == alone["small"][0]
        evicted = weakref.ref(gateway.models.entries["small"].loaded.model)
        assert complete(client, "qwen", PROMPTS[1], 8) == alone["qwen"][1]
        assert stats_of(client, "small")["state"] == "unloaded"
        assert evicted() is None  # nothing holds the evicted model: its memory is freed
        assert stats_of(client, "small")["evictions"] == 1
        assert complete(client, "small", PROMPTS[1], 8) == alone["small"][1]
        small, qwen = stats_of(client, "small"), stats_of(client, "qwen")
        assert small["loads"] == 2 and small["state"] == "loaded"
        assert qwen["evictions"] == 1 and qwen["state"] == "unloaded"
        assert stats_of(client, "tiny-gemma3")["evictions"] == 0  # the default is pinned
        assert complete(client, "tiny-gemma3", PROMPTS[2], 8) == alone["tiny-gemma3"][2]
    finally:
        gateway.stop()


def test_a_model_that_cannot_fit_is_refused(tiny_dir):
    budget = RESERVE_BYTES + weights(tiny_dir, "gemma3") + 100_000
    client, gateway = make_client(models=SMALL, memory_budget_gb=budget / 1e9, prefill_step=16)
    try:
        r = client.post("/v1/completions", json={"model": "small", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "model_too_large" and "memory_budget_gb" in err["message"]
        assert stats_of(client, "small")["state"] == "unloaded"
    finally:
        gateway.stop()


def test_a_load_plan_counts_the_kv_of_every_request_in_flight():
    """Batched rows hold their KV together: the plan sums every lease's, not the largest."""
    from mlxlab.serve.config import ServeConfig
    from mlxlab.serve.engine.entries import ModelError
    from mlxlab.serve.engine.models import Lease, Models

    gb = 10**9
    models = Models(ServeConfig(model="a", models={"b": "b-spec"}, memory_budget_gb=10).engine())
    default, other = models.default, models.entries["b"]
    default.state, default.reserved = "loaded", 2 * gb
    for _ in range(3):  # three requests of 2 GB each on the default: 6 GB, the largest 2 GB
        lease = Lease(models, default)
        lease.need_bytes = 2 * gb
        default.leases.add(lease)
    # 2 GB of weights + 6 GB of KV + the reserve leave less than 2 GB for b
    with pytest.raises(ModelError) as e:
        models.plan_load(other, 2 * gb)
    assert e.value.status == 503 and e.value.code == "insufficient_memory"
    lease.release()  # 4 GB of KV in flight now: b fits
    assert models.plan_load(other, 2 * gb - RESERVE_BYTES) == []
    assert other.state == "loading"


def test_a_load_plan_waits_for_a_lease_about_to_end():
    """Room held only by a busy model's lease: the plan waits (up to `wait_s`) for a lease to
    end and plans again, rather than refusing; with none ending in time it is the 503."""
    from mlxlab.serve.config import ServeConfig
    from mlxlab.serve.engine.entries import ModelError
    from mlxlab.serve.engine.models import Lease, Models

    gb = 10**9
    models = Models(ServeConfig(model="a", models={"b": "b-spec"}, memory_budget_gb=10).engine())
    default, other = models.default, models.entries["b"]
    default.state, default.reserved = "loaded", 2 * gb
    lease = Lease(models, default)
    lease.need_bytes = 6 * gb
    default.leases.add(lease)
    began = time.monotonic()
    with pytest.raises(ModelError) as e:
        models.plan_load(other, 2 * gb, wait_s=0.3)  # nothing ends: the 503, after the wait
    assert e.value.code == "insufficient_memory" and time.monotonic() - began >= 0.3
    assert other.state == "unloaded" and other.reserved == 0
    ends = threading.Timer(0.3, lease.release)
    ends.start()
    began = time.monotonic()
    assert models.plan_load(other, 2 * gb, wait_s=30) == []
    assert 0.25 <= time.monotonic() - began < 10
    assert other.state == "loading" and other.reserved == 2 * gb
    ends.join()


def test_a_lease_handed_after_its_request_left_goes_back(tiny_dir):
    """A request that leaves after the loader claimed its future (set_running_or_notify_cancel)
    but before it set the lease: the lease still goes back, so the model can become idle."""
    import asyncio

    from mlxlab.serve import model_choice

    _, gateway = make_client(models=SMALL)
    try:
        gateway.loader.stop()  # nothing loads: the test plays the loader's part
        models, small = gateway.models, gateway.models.entries["small"]

        async def leave():
            task = asyncio.create_task(model_choice.lease_for(gateway, "small"))
            while not small.waiters:
                await asyncio.sleep(0.01)
            ((future, _),) = small.waiters
            assert future.set_running_or_notify_cancel()  # the loader is handing it over...
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return future

        future = asyncio.run(leave())
        future.set_result(models._lease(small))  # ... and hands it, after the request left
        assert not small.leases and models.describe(small)["in_flight"] == 0
    finally:
        gateway.stop()


def test_the_loader_goes_on_after_an_error_and_a_stuck_load_is_a_503(tiny_dir, monkeypatch, alone):
    """An error in the loader's loop (here: looking for idle models) is logged and the loader
    goes on; a request whose model does not load within LOAD_WAIT_S is a 503 and holds nothing."""
    from mlxlab.serve import model_choice

    monkeypatch.setattr(model_choice, "LOAD_WAIT_S", 30.0)
    other = str(tiny_dir("llama"))  # tiny-llama again, under another spec: a third model
    client, gateway = make_client(models={**SMALL, "other": other})
    try:
        models, real, calls = gateway.models, gateway.models.idle_victims, []

        def failing_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in the loader's loop")
            return real()

        monkeypatch.setattr(models, "idle_victims", failing_once)
        assert complete(client, "small", PROMPTS[0]) == alone["small"][0]
        assert complete(client, "qwen", PROMPTS[0]) == alone["qwen"][0]  # the loader went on
        assert len(calls) >= 2
        gateway.loader.stop()  # a load that never ends
        monkeypatch.setattr(model_choice, "LOAD_WAIT_S", 0.5)
        r = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_load_timeout" and r.headers["Retry-After"]
        assert stats_of(client, "other")["in_flight"] == 0
    finally:
        gateway.stop()


def test_a_load_is_planned_from_the_headers_else_from_the_disk_else_refused(tiny_dir, tmp_path):
    """planned_bytes: the headers' weights (a VLM's vision tower included: what loading it
    measures); an unreadable header: an upper bound from the files' sizes; no weights: refused."""
    from mlxlab.serve.config import ServeConfig
    from mlxlab.serve.engine.catalog import planned_bytes
    from mlxlab.serve.engine.loaded import Loaded

    vlm = tiny_dir("gemma3-vl")
    loaded = Loaded(ServeConfig(model=str(vlm), memory_budget_gb=2).engine())
    assert loaded.vision is not None and loaded.vision.extra_bytes > 0
    assert planned_bytes(vlm) == loaded.admission.weights_bytes
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir("llama"), broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])  # a header length past any header
    assert planned_bytes(broken) >= planned_bytes(tiny_dir("llama"))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight files"):
        planned_bytes(bare)


def test_idle_model_is_unloaded_and_reloads(tiny_dir, alone):
    client, gateway = make_client(models=SMALL, model_idle_s=0.3)
    try:
        assert complete(client, "small", PROMPTS[0]) == alone["small"][0]
        assert wait_for(lambda: stats_of(client, "small")["state"] == "unloaded")
        assert stats_of(client, "small")["idle_unloads"] == 1
        assert stats_of(client, "tiny-gemma3")["state"] == "loaded"  # never the default
        assert complete(client, "small", PROMPTS[0]) == alone["small"][0]
        assert stats_of(client, "small")["loads"] == 2
    finally:
        gateway.stop()


def test_a_failed_load_leaves_the_others_serving(tiny_dir, tmp_path, alone):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir("qwen3"), broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"\x00garbage" * 1000)
    client, gateway = make_client(models={**SMALL, "broken": str(broken)})
    try:
        r = client.post(
            "/v1/completions", json={"model": "broken", "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "model_load_failed"
        assert stats_of(client, "broken")["state"] == "failed"
        assert stats_of(client, "broken")["failures"] == 1
        assert complete(client, "tiny-gemma3", PROMPTS[0]) == alone["tiny-gemma3"][0]
        assert complete(client, "small", PROMPTS[0]) == alone["small"][0]
        # a request soon after gets the same error at once, without another try
        r = client.post(
            "/v1/completions", json={"model": "broken", "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 500 and stats_of(client, "broken")["failures"] == 1
        assert client.get("/health").status_code == 200
    finally:
        gateway.stop()


def test_models_from_the_hugging_face_cache(tiny_dir, tmp_path, monkeypatch, alone):
    """models_from_cache=true: a model in the local cache is listed (unloaded, its size read
    from its files) and answers by its repo id; a repo id not in the cache is a 404."""
    from tests.helpers.hub import write_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_cache(tmp_path / "hub", "tiny-org/llama", tiny_dir("llama"))
    from mlxlab.models import zoo
    from mlxlab.serve.engine import entries

    scans, reads = [], []
    real_scan, real_facts = zoo.hub_cached, entries.facts
    monkeypatch.setattr(zoo, "hub_cached", lambda: scans.append(1) or real_scan())
    monkeypatch.setattr(entries, "facts", lambda *a: reads.append(a[0]) or real_facts(*a))
    monkeypatch.setattr(entries, "HUB_TTL_S", 3600.0)
    client, gateway = make_client(models_from_cache=True)
    try:
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        card = cards["tiny-org/llama"]
        assert not card["loaded"] and card["size_bytes"] == weights(tiny_dir, "llama")
        read = len(reads)
        for _ in range(3):  # listed again: the cache's scan and the headers are reused
            assert "tiny-org/llama" in {c["id"] for c in client.get("/v1/models").json()["data"]}
        assert len(scans) == 1 and len(reads) == read
        assert complete(client, "tiny-org/llama", PROMPTS[0]) == alone["small"][0]
        assert stats_of(client, "tiny-org/llama")["loads"] == 1
        r = client.post(
            "/v1/completions", json={"model": "tiny-org/absent", "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert len(scans) == 1  # the 404 too
        monkeypatch.setattr(entries, "HUB_TTL_S", 0.0)  # past its time: scanned again
        client.get("/v1/models")
        assert len(scans) == 2
    finally:
        gateway.stop()


@pytest.mark.parametrize("family", ["qwen2", "gemma3-vl"])
def test_a_paced_load_is_the_same_model_and_evaluates_only_through_pace(
    tiny_dir, monkeypatch, family
):
    """vision.model.load(pace=...) -> zoo.load (the loader's slices, engine/pacer.py) builds the
    same weights (a VLM's vision tower too) and tokenizer as a plain load; every evaluation runs
    inside `pace(fn)` (the server runs those on its engine thread), none on the calling thread,
    which builds the lazy model on the engine thread's stream (as the loader does) without
    moving the engine thread's random state (a seeded request's)."""
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxlab.vision.model import load

    model_dir = str(tiny_dir(family))  # built (and evaluated) before the check
    engine = ThreadPoolExecutor(1)  # stands for the engine thread
    engine_ident = engine.submit(threading.get_ident).result()
    stream = engine.submit(lambda: mx.default_stream(mx.default_device())).result()
    engine.submit(mx.random.seed, 3).result()
    evals, calls = [], []
    real_eval = mx.eval

    def recording_eval(*args, **kwargs):
        evals.append(threading.get_ident())
        return real_eval(*args, **kwargs)

    def pace(fn=None):
        calls.append(fn is not None)
        return engine.submit(fn).result() if fn is not None else None

    monkeypatch.setattr(mx, "eval", recording_eval)
    with mx.stream(stream):
        paced, tok_paced, vision_paced = load(model_dir, pace=pace)
    monkeypatch.setattr(mx, "eval", real_eval)
    assert evals and set(evals) == {engine_ident}

    def draw():
        return mx.random.uniform(shape=(4,)).tolist()

    after = engine.submit(draw).result()
    engine.submit(mx.random.seed, 3).result()
    assert after == engine.submit(draw).result()
    engine.shutdown()
    assert calls.count(True) >= 1 and calls.count(False) >= 1  # the weights, then the tokenizer
    plain, tok_plain, vision_plain = load(model_dir)
    pairs = [(paced, plain)]
    if vision_plain is not None:
        pairs.append((vision_paced.model, vision_plain.model))
        assert vision_paced.bytes_per_image > 0  # measured, on the engine thread
    for x, y in pairs:
        a, b = dict(tree_flatten(x.parameters())), dict(tree_flatten(y.parameters()))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k
    assert tok_paced.encode("hello there") == tok_plain.encode("hello there")


def test_the_pacer_runs_slices_through_run_and_waits_only_while_the_engine_generates():
    from mlxlab.serve.engine.pacer import Pacer

    pacer = Pacer(share=0.5)
    ran = []
    pacer.run = lambda fn: ran.append(1) or fn()
    pacer.start()
    assert pacer.pace(lambda: time.sleep(0.05) or "result") == "result" and ran == [1]
    assert pacer.waited_s == 0  # the engine is idle: no wait at all
    pacer.busy(True)
    pacer.start()
    pacer.pace(lambda: time.sleep(0.05))  # a 50 ms slice at share 0.5: about 50 ms of waiting
    assert pacer.waited_s >= 0.04
    waited = pacer.waited_s
    pacer.busy(False)  # the engine goes idle: the next slice does not wait
    pacer.pace(lambda: time.sleep(0.05))
    assert pacer.waited_s == waited


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"models": {"small": ""}}, "models.small"),
        ({"model": "tiny-gemma3", "models": {"tiny-gemma3": "tiny-llama"}}, "default model's name"),
        ({"model_idle_s": -1}, "model_idle_s"),
        ({"load_share": 0}, "load_share"),
        ({"load_share": 1.5}, "load_share"),
        ({"model_adapters": {"nope": {"a": "x"}}}, "'nope' is not a served model's name"),
        (
            {"model": "tiny-gemma3", "model_adapters": {"tiny-gemma3": {"a": "x"}}},
            "'tiny-gemma3' is the default model's name",
        ),
        ({"models": {"small": "tiny-llama"}, "model_adapters": {"small": {"a": ""}}}, "an id"),
    ],
)
def test_bad_model_settings_are_refused(bad, words):
    from mlxlab.config import UserError
    from mlxlab.serve.config import ServeConfig

    with pytest.raises(UserError, match=words):
        ServeConfig(**bad)


def stream_tokens(url, model, out: list, max_tokens=300, never=()):
    """Stream a completion from a real server, appending each content chunk's arrival time to
    `out` (a TestClient hands a stream over only once it has ended); `never`: token ids banned
    (the end tokens: a random model's answer runs to max_tokens)."""
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0}
    body["logit_bias"] = {str(t): -100 for t in never}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                out.append(time.monotonic())


def test_the_default_model_generates_while_another_loads(server, alone):
    """With load_share=0.01 a load waits ~99x its slices out while the engine generates: the
    default's answer streams on while `small` is loading, and `small` then answers as alone."""
    url, gateway = server(load_share=0.01)
    times, got = [], {}
    eos = gateway.loaded.eos
    default = threading.Thread(target=stream_tokens, args=(url, "tiny-gemma3", times, 300, eos))
    default.start()
    assert wait_for(lambda: len(times) >= 5)

    def ask_small():
        body = {"model": "small", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        got["text"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()

    small = threading.Thread(target=ask_small)
    small.start()
    assert wait_for(lambda: model_stats(url, "small")["state"] == "loading")
    seen_loading = time.monotonic()
    default.join(120)
    small.join(120)
    assert sum(t > seen_loading for t in times) >= 5, "the default stalled during the load"
    assert got["text"]["choices"][0]["text"] == alone["small"][0]
    assert httpx.get(f"{url}/stats").json()["models"]["load_waited_s"] > 0


def test_no_room_beside_a_busy_model_is_a_503(server, tiny_dir):
    """The budget holds one model beside the default; while `small` has a request in flight
    (queued behind the parked engine: deterministic), `qwen` cannot evict it: 503
    insufficient_memory with Retry-After, and `small` is kept and then answers."""
    w = {f: weights(tiny_dir, f) for f in ("gemma3", "llama", "qwen2")}
    budget = RESERVE_BYTES + w["gemma3"] + max(w["llama"], w["qwen2"]) + 600_000
    url, gateway = server(memory_budget_gb=budget / 1e9, prefill_step=16)
    small = httpx.post(f"{url}/v1/completions", json={"model": "small", "prompt": "hi"})
    assert small.status_code == 200
    release, got = hold_engine(gateway), {}
    try:
        busy = post_in_thread(url, {"model": "small", "prompt": "hi", "max_tokens": 2}, got, 0)
        assert wait_for(lambda: model_stats(url, "small")["in_flight"] == 1)
        body = {"model": "qwen", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    finally:
        release.set()
    busy.join(120)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "insufficient_memory"
    assert r.headers["Retry-After"] == "5"
    assert model_stats(url, "small")["evictions"] == 0
    assert got[0].status_code == 200
    assert wait_for(lambda: model_stats(url, "small")["in_flight"] == 0)


def test_a_lease_ending_soon_after_a_request_for_another_model_is_waited_for(
    server, tiny_dir, monkeypatch
):
    """As test_no_room_beside_a_busy_model_is_a_503, but `small`'s request ends while `qwen`'s
    load waits for room (the loader's LEASE_WAIT_S, widened here so that a slow machine does not
    decide the test): `small` is evicted once its lease ends and `qwen` answers, no 503."""
    from mlxlab.serve.engine import loader

    monkeypatch.setattr(loader, "LEASE_WAIT_S", 60.0)
    w = {f: weights(tiny_dir, f) for f in ("gemma3", "llama", "qwen2")}
    budget = RESERVE_BYTES + w["gemma3"] + max(w["llama"], w["qwen2"]) + 600_000
    url, gateway = server(memory_budget_gb=budget / 1e9, prefill_step=16)
    assert httpx.post(f"{url}/v1/completions", json={"model": "small", "prompt": "hi"}).is_success
    release, got = hold_engine(gateway), {}
    try:
        busy = post_in_thread(url, {"model": "small", "prompt": "hi", "max_tokens": 2}, got, 0)
        assert wait_for(lambda: model_stats(url, "small")["in_flight"] == 1)
        waiting = post_in_thread(url, {"model": "qwen", "prompt": "hi", "max_tokens": 2}, got, 1)
        assert wait_for(lambda: model_stats(url, "qwen")["state"] == "queued")
        time.sleep(0.3)  # the loader is planning qwen's load: no room while small is busy
        assert model_stats(url, "small")["state"] == "loaded"
    finally:
        release.set()  # small's request runs and ends: its lease goes back
    busy.join(120)
    waiting.join(120)
    assert got[0].status_code == 200, got[0].text
    assert got[1].status_code == 200, got[1].text
    assert model_stats(url, "small")["evictions"] == 1
    assert model_stats(url, "qwen")["state"] == "loaded"


def test_leases_go_back_after_a_400_and_a_full_queue(server):
    """A request refused in make_job (400) or at submit (503 queue_full) holds no lease after."""
    url, gateway = server(max_queue=1)
    assert httpx.post(f"{url}/v1/completions", json={"model": "small", "prompt": "hi"}).is_success
    too_long = {"model": "small", "prompt": "hi", "max_tokens": 10**7}
    r = httpx.post(f"{url}/v1/completions", json=too_long)
    assert r.status_code == 400, r.text
    assert model_stats(url, "small")["in_flight"] == 0
    # both models loaded and serial: the queue holds max_queue + 2 - 1 = 2
    release, got, threads = hold_engine(gateway), {}, []
    try:
        for i in range(2):
            body = {"model": "small", "prompt": "hi", "max_tokens": 2}
            threads.append(post_in_thread(url, body, got, i))
        assert wait_for(lambda: model_stats(url, "small")["in_flight"] == 2)
        body = {"model": "small", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert model_stats(url, "small")["in_flight"] == 2
    finally:
        release.set()
    for t in threads:
        t.join(120)
    assert all(got[i].status_code == 200 for i in range(2))
    assert wait_for(lambda: model_stats(url, "small")["in_flight"] == 0)


def test_leases_go_back_when_clients_leave(server):
    """A streamed client that disconnects mid-answer, and one that leaves while its model is
    still loading (its load held up by the parked engine), leave nothing in flight."""
    url, gateway = server()
    assert httpx.post(f"{url}/v1/completions", json={"model": "small", "prompt": "hi"}).is_success
    eos = gateway.lanes["small"].loaded.eos
    body = {"model": "small", "prompt": PROMPTS[0], "max_tokens": 1000, "stream": True}
    body["logit_bias"] = {str(t): -100 for t in eos}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 3:
                break  # the client leaves mid-stream
    assert wait_for(lambda: model_stats(url, "small")["in_flight"] == 0)
    release = hold_engine(gateway)
    try:
        raw = json.dumps({"model": "qwen", "prompt": "hi", "max_tokens": 200}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
            )
            assert wait_for(lambda: model_stats(url, "qwen")["state"] in ("queued", "loading"))
        # the client has gone; its model is still loading
        assert model_stats(url, "qwen")["state"] in ("queued", "loading")
    finally:
        release.set()
    assert wait_for(lambda: model_stats(url, "qwen")["state"] == "loaded")
    assert wait_for(lambda: model_stats(url, "qwen")["in_flight"] == 0)
