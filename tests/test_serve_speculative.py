"""Speculative decoding in the server (serve.speculative): both lanes answer as with it off,
structured output included; /stats, /metrics and Done count drafted and accepted tokens; bad
settings are one-line errors, a draft model with another tokenizer fails the load."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from mlxlab.errors import UserError
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.jobs import Done, Failed, Job, Sampling
from tests.helpers.serve import SYSTEM, make_client
from tests.test_serve_batch import MAX_TOKENS, prompts, submit_all


@pytest.fixture(scope="module")
def servers(tiny_dir):
    """tiny-gemma3 served plainly, and speculatively on each lane and drafting mode."""
    tiny_dir("gemma3")
    made = {
        "off": make_client(),
        "lookup": make_client(speculative="prompt_lookup"),
        "lookup-batch": make_client(batch=4, speculative="prompt_lookup", draft_tokens=5),
        "draft-batch": make_client(batch=4, speculative="draft_model", draft_model="self:6"),
    }
    yield made
    for _, gateway in made.values():
        gateway.stop()


def _jobs():
    # repeated stretches in the prompts: prompt lookup finds drafts
    ps = [p + p[1:8] for p in prompts(seed=3)]
    return [
        Job(p, m, None, Sampling(temperature=0.0), id=str(i))
        for i, (p, m) in enumerate(zip(ps, MAX_TOKENS, strict=True))
    ]


def test_every_lane_answers_as_without_speculation(servers):
    plain, _ = submit_all(servers["off"][1], _jobs())
    for name in ("lookup", "lookup-batch", "draft-batch"):
        ends, _ = submit_all(servers[name][1], _jobs())
        assert all(isinstance(d, Done) for d in ends.values()), name
        assert {k: d.tokens for k, d in ends.items()} == {k: d.tokens for k, d in plain.items()}
        assert all(d.speculation is not None for d in ends.values())
    ends, _ = submit_all(servers["draft-batch"][1], _jobs())
    drafted = sum(d.speculation["drafted_tokens"] for d in ends.values())
    accepted = sum(d.speculation["accepted_tokens"] for d in ends.values())
    assert drafted == accepted > 0  # the whole model drafting for itself


CHAT = {
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat."},
    ],
    "temperature": 0,
    "max_tokens": 40,
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


def test_chat_and_structured_answers_and_the_counts(servers):
    off = servers["off"][0]
    structured = {
        **CHAT,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMA},
        },
    }
    for name in ("lookup", "lookup-batch"):
        client = servers[name][0]
        for body in (CHAT, structured, {**CHAT, "stop": ["at"]}):
            want = off.post("/v1/chat/completions", json=body).json()["choices"]
            assert client.post("/v1/chat/completions", json=body).json()["choices"] == want
        stats = client.get("/stats").json()["speculative"]
        assert stats["mode"] == "prompt_lookup" and stats["forced_tokens"] > 0
        assert stats["drafted_tokens"] >= stats["accepted_tokens"] > 0
        metrics = client.get("/metrics").text
        for name_ in ("drafted", "accepted", "forced"):
            line = next(
                line
                for line in metrics.splitlines()
                if line.startswith(f"mlxlab_speculative_{name_}_tokens_total ")
            )
            assert float(line.split()[1]) == stats[f"{name_}_tokens"]
    assert servers["off"][0].get("/stats").json()["speculative"]["drafted_tokens"] == 0


def _numbers(gateway) -> dict:
    """The gateway's counters, speculative counts and its default model's requests."""
    models = gateway.models
    return {
        **{k: v for k, v in gateway.stats().items() if k not in ("queued", "running")},
        **gateway.speculation_stats(),
        "requests_of_the_model": models.describe(models.default)["requests"],
    }


def _end(gateway, job: Job) -> tuple:
    """Run `job` holding a lease; its last event, and `_numbers` and whether the lease was
    released when that event reached the sink."""
    got, ended = {}, threading.Event()

    def sink(ev):
        if isinstance(ev, (Done, Failed)):
            got.update(ev=ev, numbers=_numbers(gateway), released=not lease.open)
            ended.set()

    lease = job.lease = gateway.models.acquire(None).result(10)
    job.sink = sink
    gateway.submit(job)
    assert ended.wait(120)
    return got["ev"], got["numbers"], got["released"]


def test_a_job_is_counted_and_its_lease_released_before_its_last_event(servers):
    """The sink reads the gateway's numbers as each job's last event reaches it: the job is in
    them already (its counter, tokens, speculative counts, its model's requests) and its lease is
    released, on every path that ends a job: either lane, cancelled before it started, failed
    on either lane. (/stats and /metrics read one after the other once disagreed by a job:
    its Done had been sent before it was counted.)"""
    for name in ("lookup", "draft-batch"):  # the serial lane, the batched lane
        gateway = servers[name][1]
        before = _numbers(gateway)
        done, now, released = _end(gateway, _jobs()[2])
        assert isinstance(done, Done) and done.finish_reason in ("length", "stop"), name
        assert released, name
        s = done.speculation
        assert s["drafted_tokens"] > 0
        assert now == {
            **before,
            "requests": before["requests"] + 1,
            "completed": before["completed"] + 1,
            "prompt_tokens": before["prompt_tokens"] + done.prompt_tokens,
            "completion_tokens": before["completion_tokens"] + done.completion_tokens,
            "verify_steps": before["verify_steps"] + s["verify_steps"],
            "drafted_tokens": before["drafted_tokens"] + s["drafted_tokens"],
            "accepted_tokens": before["accepted_tokens"] + s["accepted_tokens"],
            "forced_tokens": before["forced_tokens"] + s["forced_tokens"],
            "acceptance_rate": now["acceptance_rate"],
            "requests_of_the_model": before["requests_of_the_model"] + 1,
        }, name

        cancelled = _jobs()[0]
        cancelled.cancelled.set()
        before = _numbers(gateway)
        done, now, released = _end(gateway, cancelled)
        assert isinstance(done, Done) and done.finish_reason == "cancelled" and released, name
        assert now["cancelled"] == before["cancelled"] + 1, name
        assert now["requests_of_the_model"] == before["requests_of_the_model"] + 1, name

        unmounted = _jobs()[1]
        unmounted.adapter = ("nope",)  # fails when it reaches its lane (claim_adapters)
        before = _numbers(gateway)
        failed, now, released = _end(gateway, unmounted)
        assert isinstance(failed, Failed) and failed.status == 400 and released, name
        assert now["failed"] == before["failed"] + 1, name
        assert now["requests_of_the_model"] == before["requests_of_the_model"] + 1, name


def test_a_failed_prompt_cache_store_after_an_answer_keeps_the_answer(servers, monkeypatch):
    """On the serial lane the finished answer is stored in the prompt cache before its Done is
    sent (so a follow-up request finds it): a store that fails costs that cache entry, never the
    answer the client already has."""
    gateway = servers["lookup"][1]

    def broken(*args, **kwargs):
        raise RuntimeError("the store failed")

    monkeypatch.setattr(gateway.cache, "insert", broken)  # every model's prompt cache
    done, now, released = _end(gateway, _jobs()[2])
    assert isinstance(done, Done) and done.finish_reason in ("length", "stop")
    assert done.completion_tokens > 0 and released


def test_bad_settings_are_one_line_errors():
    with pytest.raises(UserError, match="speculative must be one of"):
        ServeConfig(speculative="eagle")
    with pytest.raises(UserError, match="needs draft_model"):
        ServeConfig(speculative="draft_model")
    with pytest.raises(UserError, match="only with speculative=draft_model"):
        ServeConfig(draft_model="gemma3-270m")
    with pytest.raises(UserError, match="draft_tokens"):
        ServeConfig(speculative="prompt_lookup", draft_tokens=40)


def test_a_draft_model_with_another_tokenizer_fails_the_load(tiny_dir, tmp_path):
    """A copy of the tiny model whose vocabulary has two entries swapped."""
    from mlxlab.serve.engine.gateway import Gateway

    src = tiny_dir("llama")
    other = tmp_path / "other"
    shutil.copytree(src, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    (a, ia), (b, ib) = list(vocab.items())[100:102]
    vocab[a], vocab[b] = ib, ia
    (other / "tokenizer.json").write_text(json.dumps(tok))
    cfg = ServeConfig(
        model=str(src), memory_budget_gb=2, speculative="draft_model", draft_model=str(other)
    )
    gateway = Gateway(cfg.engine()).start()
    assert gateway.ready.wait(120)
    assert gateway.state == "failed"
    assert "has another tokenizer" in gateway.error and "\n" not in gateway.error
