"""Speculative decoding in the server (serve.speculative): both lanes answer as with it off,
structured output included; /stats, /metrics and Done count drafted and accepted tokens; bad
settings are one-line errors, a draft model with another tokenizer fails the load."""

from __future__ import annotations

import json
import shutil

import pytest

from mlxlab.errors import UserError
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.jobs import Done, Job, Sampling
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
