"""GET /metrics on a tiny model: the Prometheus exposition after a few requests, parsed."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.serve import SYSTEM, make_adapter, make_client, named_events


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics_adapters")
    make_adapter(tiny_dir("gemma3"), root / "a", seed=1)
    client, gateway = make_client(adapter_root=str(root))
    yield client, root
    gateway.stop()


def scrape(client) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


CHAT = {
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}],
    "max_tokens": 4,
    "temperature": 0,
}


def test_metrics_after_a_few_requests(served):
    client, root = served
    before = scrape(client)
    assert value(before, "mlxlab_ready") == 1 and value(before, "mlxlab_queue_depth") == 0
    usages = []
    for _ in range(2):  # the second one reads its prompt from the cache
        usages.append(client.post("/v1/chat/completions", json=CHAT).json()["usage"])
    stream = client.post(
        "/v1/messages",
        json={
            "model": "x",
            "messages": CHAT["messages"][1:],
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
        },
    )
    end = [d for e, d in named_events(stream.text) if e == "message_delta"][0]["usage"]
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert client.get("/nowhere").status_code == 404
    over = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10_000_000})
    assert over.status_code == 400 and over.json()["error"]["type"] == "memory_admission"
    assert client.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 200
    ok = client.post("/v1/chat/completions", json={**CHAT, "adapter": "a"})
    assert ok.status_code == 200
    usages.append(ok.json()["usage"])

    m = scrape(client)
    requests = "mlxlab_http_requests_total"
    assert value(m, requests, method="POST", route="/v1/chat/completions", status="200") == 3
    assert value(m, requests, method="POST", route="/v1/chat/completions", status="400") == 2
    assert value(m, requests, method="POST", route="/v1/messages", status="200") == 1
    assert value(m, requests, method="GET", route="unmatched", status="404") == 1
    assert value(m, requests, method="GET", route="/metrics", status="200") == 1  # the first scrape

    prompt = sum(u["prompt_tokens"] for u in usages) + end["input_tokens"]
    prompt += end["cache_read_input_tokens"]
    completion = sum(u["completion_tokens"] for u in usages) + end["output_tokens"]
    assert (
        value(m, "mlxlab_prompt_tokens_total") - value(before, "mlxlab_prompt_tokens_total")
        == prompt
    )
    assert (
        value(m, "mlxlab_completion_tokens_total") - value(before, "mlxlab_completion_tokens_total")
        == completion
    )
    assert value(m, "mlxlab_jobs_finished_total", outcome="completed") == 4
    assert value(m, "mlxlab_jobs_submitted_total") == 4
    assert value(m, "mlxlab_admission_rejections_total", reason="context_over_budget") == 1
    assert value(m, "mlxlab_admission_rejections_total", reason="queue_full") == 0
    assert value(m, "mlxlab_prompt_cache_hits_total") >= 1
    assert value(m, "mlxlab_prompt_cache_reused_tokens_total") >= usages[1]["prompt_tokens"] - 1
    assert value(m, "mlxlab_prompt_cache_entries") >= 1

    assert value(m, "mlxlab_time_to_first_token_seconds_count") == 4
    assert 0 < value(m, "mlxlab_time_to_first_token_seconds_sum") < 60
    assert value(m, "mlxlab_time_per_output_token_seconds_count") == 4  # each made >= 2 tokens
    assert value(m, "mlxlab_generation_seconds_count") == 4
    ttft_inf = value(m, "mlxlab_time_to_first_token_seconds_bucket", le="+Inf")
    assert ttft_inf == 4

    assert value(m, "mlxlab_adapters_mounted") == 1 and value(m, "mlxlab_adapter_mounts_total") == 1
    assert value(m, "mlxlab_adapter_requests_total", model="tiny-gemma3", adapter="a") == 1
    assert value(m, "mlxlab_model_adapters_mounted", model="tiny-gemma3") == 1
    assert client.delete("/v1/adapters/a").status_code == 200
    m = scrape(client)
    assert (
        value(m, "mlxlab_adapters_mounted") == 0 and value(m, "mlxlab_adapter_unmounts_total") == 1
    )


def test_metrics_are_per_app_and_a_route_like_the_others(served):
    """A second app over the same engine has its own request series; /metrics answers through
    the admin router (the drain's 503 here; whatever guards the other routes guards it)."""
    from fastapi.testclient import TestClient

    from mlxlab.serve.app import create_app

    client, _ = served
    gateway = client.app.state.gateway
    other = TestClient(create_app(client.app.state.cfg, gateway), base_url="http://localhost")
    fresh = scrape(other)
    assert not [k for k in fresh if k[0] == "mlxlab_http_requests_total"]
    assert value(fresh, "mlxlab_jobs_submitted_total") == gateway.counters["requests"]
    other.app.state.draining = True
    r = other.get("/metrics")
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    assert "/metrics" in other.app.openapi()["paths"]
