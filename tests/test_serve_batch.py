"""The batched lane (serve.batch=N): parity with mlx-lm's BatchGenerator, equality with the serial
lane, the lane picker, the prompt cache, per-row adapters, aggregate admission, cancellation and
KV-cache quantization."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from mlxlab.config import UserError
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine import kv_quant
from mlxlab.serve.engine.batch import BatchLane
from mlxlab.serve.engine.jobs import Delta, Done, Failed, Job, Sampling, parse_adapter_spec
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.rows import cache_namespace
from tests.helpers.serve import (
    SYSTEM,
    free_port,
    make_adapter,
    make_client,
    sse_events,
    streamed_content,
)

LENGTHS = (5, 40, 17, 90, 3, 60)
MAX_TOKENS = (20, 8, 30, 12, 25, 16)
JOIN_AT = (0, 0, 0, 3, 7, 7)  # the decode step at which each row arrives


def prompts(lengths=LENGTHS, seed=0, vocab=(10, 200)):
    rng = random.Random(seed)
    return [[2] + [rng.randrange(*vocab) for _ in range(n)] for n in lengths]


def batch_generator_tokens(model, eos, ps, max_tokens, join_at, size, prefill_step):
    """mlx-lm's BatchGenerator on a schedule: row i is inserted before the join_at[i]-th next()."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        stop_tokens=[[e] for e in sorted(eos)],
        completion_batch_size=size,
        prefill_batch_size=size,
        prefill_step_size=prefill_step,
    )
    out, uid_of, done, step = {}, {}, set(), 0
    while len(done) < len(ps):
        for i, at in enumerate(join_at):
            if at == step:
                (uid,) = gen.insert([ps[i]], max_tokens=[max_tokens[i]])
                uid_of[uid] = i
                out[i] = []
        _, responses = gen.next()
        for r in responses:
            out[uid_of[r.uid]].append(r.token)
            if r.finish_reason is not None:
                done.add(uid_of[r.uid])
        step += 1
    gen.close()
    return [out[i] for i in range(len(ps))]


def lane_tokens(loaded, cfg, ps, max_tokens, join_at, cancel=()):
    """Our lane on the same schedule (lane.step() is one BatchGenerator.next()); `cancel`: (row,
    step) pairs, the row's client goes away before that step."""
    results = {}
    lane = BatchLane(
        loaded, cfg.engine(), lambda job, done, err: results.__setitem__(job.id, done or err)
    )
    jobs = [
        Job(p, m, lambda e: None, Sampling(temperature=0.0), id=str(i))
        for i, (p, m) in enumerate(zip(ps, max_tokens, strict=True))
    ]
    step = 0
    while len(results) < len(ps):
        for i, at in enumerate(join_at):
            if at == step:
                lane.add(jobs[i])
        for row, at in cancel:
            if step == at:
                jobs[row].cancelled.set()
        lane.step()
        step += 1
    assert lane.active == 0 and not lane.decoder.rows
    return [results[str(i)] for i in range(len(ps))], lane


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_greedy_tokens_equal_mlx_lm_batch_generator(tiny_dir, family):
    """Different lengths (left padding), chunked prefill beside decoding, rows joining at steps 3
    and 7 and leaving at different max_tokens: the same token trajectories as BatchGenerator."""
    tiny_dir(family)
    cfg = ServeConfig(
        model=f"tiny-{family}", memory_budget_gb=2, batch=8, prefill_step=16, prompt_cache_gb=0
    )
    loaded = Loaded(cfg.engine())
    ps = prompts()
    ours, lane = lane_tokens(loaded, cfg, ps, MAX_TOKENS, JOIN_AT)
    ref = batch_generator_tokens(loaded.model, loaded.eos, ps, MAX_TOKENS, JOIN_AT, 8, 16)
    assert [d.tokens for d in ours] == ref
    assert lane.peak_rows >= 4 and lane.rows_served == len(ps)
    assert [d.finish_reason for d in ours] == [
        "stop" if t[-1] in loaded.eos else "length" for t in ref
    ]


@pytest.mark.parametrize("batch", [8, 3])
def test_cancelled_rows_leave_and_the_others_are_unchanged(tiny_dir, batch):
    """Row 2 is cancelled while decoding, row 3 while its 90-token prompt is being prefilled (16
    per step); with batch=3, row 5 is cancelled while it waits for room."""
    tiny_dir("gemma3")
    cfg = ServeConfig(
        model="tiny-gemma3", memory_budget_gb=2, batch=batch, prefill_step=16, prompt_cache_gb=0
    )
    loaded = Loaded(cfg.engine())
    ps = prompts()
    plain, _ = lane_tokens(loaded, cfg, ps, MAX_TOKENS, JOIN_AT)
    cancel = [(2, 6), (3, 5)] + ([(5, 8)] if batch == 3 else [])
    cut, lane = lane_tokens(loaded, cfg, ps, MAX_TOKENS, JOIN_AT, cancel=cancel)
    gone = {row for row, _ in cancel}
    assert cut[2].finish_reason == "cancelled" and 0 < cut[2].completion_tokens < MAX_TOKENS[2]
    assert cut[3].finish_reason == "cancelled" and cut[3].completion_tokens == 0
    if batch == 3:
        assert cut[5].finish_reason == "cancelled" and cut[5].completion_tokens == 0
    assert [d.tokens for i, d in enumerate(cut) if i not in gone] == [
        d.tokens for i, d in enumerate(plain) if i not in gone
    ]
    assert lane.peak_rows <= batch


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_finished_rows_cache_exactly_prompt_plus_completion(tiny_dir, family):
    """The entry a finished row stores is keyed by prompt + completion and continues exactly like
    a fresh prefill of those tokens."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    tiny_dir(family)
    cfg = ServeConfig(model=f"tiny-{family}", memory_budget_gb=2, batch=4, prefill_step=16)
    loaded = Loaded(cfg.engine())
    ps = prompts((20, 33, 9), seed=7)
    done, _ = lane_tokens(loaded, cfg, ps, (10, 14, 6), (0, 0, 1))
    for p, d in zip(ps, done, strict=True):
        full = p + d.tokens
        cache, n = loaded.cache.fetch(cache_namespace(loaded, ()), full + [5])
        assert n == len(full)
        cached = loaded.model(mx.array([[5]]), cache=cache)[0, -1]
        fresh = loaded.model(mx.array([full + [5]]), cache=make_prompt_cache(loaded.model))[0, -1]
        np.testing.assert_allclose(np.array(cached), np.array(fresh), atol=1e-4, rtol=1e-4)


def submit_all(gateway, jobs, timeout=300):
    """Submit jobs back to back; wait for each to end; {id: Done | Failed} plus the text per id."""
    ends, texts, events = {}, {j.id: [] for j in jobs}, {j.id: threading.Event() for j in jobs}

    def sink_for(jid):
        def sink(e):
            if isinstance(e, Delta):
                texts[jid].append(e.text)
            else:
                ends[jid] = e
                events[jid].set()

        return sink

    for j in jobs:
        j.sink = sink_for(j.id)
        gateway.submit(j)
    for e in events.values():
        assert e.wait(timeout)
    return ends, {k: "".join(v) for k, v in texts.items()}


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """A serial server and a batch=4 server on tiny-gemma3."""
    tiny_dir("gemma3")
    serial = make_client()
    batched = make_client(batch=4)
    yield serial, batched
    serial[1].stop()
    batched[1].stop()


def test_batched_requests_equal_the_serial_lane(pair):
    (_, serial), (client, batched) = pair

    def jobs():
        return [
            Job(p, m, None, Sampling(temperature=0.0), id=str(i))
            for i, (p, m) in enumerate(zip(prompts(seed=1), MAX_TOKENS, strict=True))
        ]

    solo, solo_text = submit_all(serial, jobs())
    ends, texts = submit_all(batched, jobs())
    assert all(isinstance(d, Done) for d in ends.values())
    assert {k: d.tokens for k, d in ends.items()} == {k: d.tokens for k, d in solo.items()}
    assert texts == solo_text
    stats = client.get("/stats").json()["batch"]
    assert stats["configured"] == 4 and stats["batched"] is True and stats["peak_rows"] >= 2
    assert stats["active_rows"] == 0 and stats["rows_served"] >= 6


def test_http_stream_and_stops_on_the_batched_lane(pair):
    (serial_client, _), (client, _) = pair
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What does zip do?"},
        ],
        "temperature": 0,
        "max_tokens": 24,
    }
    plain = client.post("/v1/chat/completions", json=body).json()
    assert plain == {
        **plain,
        "choices": serial_client.post("/v1/chat/completions", json=body).json()["choices"],
    }
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    content = plain["choices"][0]["message"]["content"]
    assert streamed_content(events) == content
    stop = content[5:9]
    stopped = client.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()["choices"][
        0
    ]
    assert (
        stopped["finish_reason"] == "stop"
        and stopped["message"]["content"] == content[: content.index(stop)]
    )
    # The prompt cache serves batched rows: the same request again reuses its prompt.
    again = client.post("/v1/chat/completions", json=body).json()
    assert (
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= plain["usage"]["prompt_tokens"] - 1
    )
    assert again["choices"][0]["message"]["content"] == content
    # A second turn reuses the first turn's prompt + answer, as the serial lane does, same answer.
    turn2 = {
        **body,
        "messages": body["messages"]
        + [{"role": "assistant", "content": content}, {"role": "user", "content": "And map?"}],
    }
    second = client.post("/v1/chat/completions", json=turn2).json()
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= plain["usage"]["prompt_tokens"] - 1
    )
    assert (
        second["choices"]
        == serial_client.post("/v1/chat/completions", json=turn2).json()["choices"]
    )


def test_lane_picker_sends_seed_and_penalties_to_the_serial_lane(pair):
    _, (client, gateway) = pair
    deadline = time.time() + 60  # a row an earlier test left (a client that went away) ends first
    while gateway.pending and time.time() < deadline:
        time.sleep(0.02)
    before = client.get("/stats").json()["batch"]
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for extra in (
        {"seed": 7, "temperature": 0.8},
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.3},
    ):
        assert client.post("/v1/chat/completions", json={**base, **extra}).status_code == 200
    assert (
        client.post(
            "/v1/chat/completions",
            json={**base, "temperature": 0.7, "logprobs": True, "top_logprobs": 2},
        ).status_code
        == 200
    )
    after = client.get("/stats").json()["batch"]
    assert after["served_serial"] - before["served_serial"] == 3
    assert after["rows_served"] - before["rows_served"] == 1
    assert gateway.lane_for(Job([1, 2], 4, None, Sampling(repetition_penalty=1.1))) == "serial"
    assert gateway.lane_for(Job([1, 2], 4, None, Sampling(temperature=0.5, top_k=5))) == "batch"


def test_rows_with_different_adapters_decode_together(tiny_dir, tmp_path):
    """Each row's tokens equal that adapter served alone; the rows shared decode steps."""
    make_adapter(tiny_dir("gemma3"), tmp_path / "a", seed=1)
    make_adapter(tiny_dir("gemma3"), tmp_path / "b", seed=2, targets=("q", "o", "down"), layers=3)
    _, gateway = make_client(
        batch=4,
        adapter_root=str(tmp_path),
        prompt_cache_gb=0,
        adapters={"a": str(tmp_path / "a"), "b": str(tmp_path / "b")},
    )
    try:
        specs = ["a", "b", "none", "a+b", "b+a", "a"]
        # different lengths: mixed-adapter prefill with padding, then mixed-adapter decoding
        ps = prompts((30, 12, 45, 30, 30, 7), seed=3)

        def jobs():
            return [
                Job(
                    ps[i],
                    24,
                    None,
                    Sampling(temperature=0.0),
                    adapter=parse_adapter_spec(s),
                    id=f"{i}:{s}",
                )
                for i, s in enumerate(specs)
            ]

        alone = {}
        for j in jobs():  # one at a time: a batch of one row, one spec, no masks
            alone.update(submit_all(gateway, [j])[0])
        together, _ = submit_all(gateway, jobs())
        assert {k: d.tokens for k, d in together.items()} == {k: d.tokens for k, d in alone.items()}
        same_prompt = [alone[f"{i}:{s}"].tokens for i, s in ((0, "a"), (3, "a+b"), (4, "b+a"))]
        assert same_prompt[0] != same_prompt[1]  # the adapters matter
        assert gateway.batch.peak_rows == 4
        assert gateway.loaded.adapters.mounted["a"].requests == 8  # a, a+b, b+a, a; twice
    finally:
        gateway.stop()


def test_aggregate_admission_makes_rows_wait_instead_of_overflowing(tiny_dir):
    tiny_dir("gemma3")
    _, gateway = make_client(batch=4, prompt_cache_gb=0)
    try:
        ps = prompts((20, 25, 30, 35), seed=4)
        adm = gateway.loaded.admission
        longest = 35 + 1 + 40
        # Room for two rows of the longest length plus the copy of one being prefilled, never three
        # (the batch cache pads to the longest row).
        adm.budget_bytes = (
            adm.bytes_for_rows([longest] * 2, 1) + adm.bytes_for_rows([longest] * 3, 1)
        ) // 2

        def jobs():
            return [
                Job(p, 40, None, Sampling(temperature=0.0), id=str(i)) for i, p in enumerate(ps)
            ]

        ends, _ = submit_all(gateway, jobs())
        stats = gateway.batch_stats()
        assert stats["peak_rows"] == 2 and stats["memory_waits"] >= 1
        adm.budget_bytes = 10**12
        free, _ = submit_all(gateway, jobs())
        assert {k: d.tokens for k, d in ends.items()} == {k: d.tokens for k, d in free.items()}
    finally:
        gateway.stop()


def test_a_lone_row_past_half_the_ceiling_is_admitted(tiny_dir):
    """A row alone is always admitted: one of ~0.6x the max safe context passes the 400 check
    (its KV once) and must answer, though its KV twice (the prefill copy) would not fit."""
    tiny_dir("gemma3")
    _, gateway = make_client(batch=4, prompt_cache_gb=0)
    try:
        adm = gateway.loaded.admission
        prompt_len, max_tokens = 40, 20
        need = prompt_len + 1 + max_tokens
        # a budget whose ceiling is need / 0.6 tokens
        ceiling = int(need / 0.6)
        adm.budget_bytes = adm.bytes_for_rows([ceiling])
        assert adm.max_safe_context >= need and adm.check(prompt_len + 1, max_tokens) is None
        assert not adm.fits_rows([need], 1)  # what the branch asked of a lone row
        (p,) = prompts((prompt_len,), seed=7)
        ends, _ = submit_all(gateway, [Job(p, max_tokens, None, Sampling(temperature=0.0))], 60)
        (done,) = ends.values()
        assert isinstance(done, Done) and done.completion_tokens > 0
    finally:
        gateway.stop()


def test_a_failing_forward_fails_the_batch_and_the_lane_recovers(tiny_dir, monkeypatch):
    tiny_dir("gemma3")
    _, gateway = make_client(batch=4, prompt_cache_gb=0)
    try:
        ps = prompts((8, 12), seed=5)
        good, _ = submit_all(gateway, [Job(ps[0], 6, None, Sampling(temperature=0.0), id="x")])
        lane = gateway.batch.decoder
        real = lane._decode

        def broken():
            raise RuntimeError("boom")

        monkeypatch.setattr(lane, "_decode", broken)
        ends, _ = submit_all(
            gateway,
            [Job(p, 6, None, Sampling(temperature=0.0), id=str(i)) for i, p in enumerate(ps)],
        )
        assert all(isinstance(e, Failed) and "boom" in e.message for e in ends.values())
        monkeypatch.setattr(lane, "_decode", real)
        again, _ = submit_all(gateway, [Job(ps[0], 6, None, Sampling(temperature=0.0), id="x")])
        assert again["x"].tokens == good["x"].tokens
        assert gateway.pending == 0 and gateway.counters["failed"] == 2
    finally:
        gateway.stop()


# --- KV quantization ---------------------------------------------------------------------------


def test_kv_quant_plans_are_validated(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    model, _ = load(str(tiny_dir("gemma3")))
    assert not kv_quant.parse("off", model, tmp_path).enabled
    with pytest.raises(UserError, match="cannot read"):
        kv_quant.parse("config", model, tmp_path)
    with pytest.raises(UserError, match="use off, 4, 8"):
        kv_quant.parse("16", model, tmp_path)
    plan = tmp_path / "kv_config.json"
    plan.write_text(
        json.dumps(
            [
                {"layer_idx": 0, "bits": 8, "group_size": 64},
                {"layer_idx": 99, "bits": 8},
                {"layer_idx": 1, "bits": 7},
                {"layer_idx": 2, "bits": 4.0},
                {"layer_idx": 3, "bits": 4, "group_size": 64.0},
                {"layer_idx": 4, "bits": None},
                {"layer_idx": 4, "bits": 8},
            ]
        )
    )
    with pytest.raises(UserError) as e:
        kv_quant.parse("config", model, tmp_path)
    msg = str(e.value)
    assert "layer 0 has a sliding-window cache" in msg and "layer_idx 99" in msg and "bits 7" in msg
    assert "bits 4.0" in msg and "group_size 64.0" in msg and "layer 4 is listed twice" in msg
    # tiny models have 16-wide heads: no group size divides them
    with pytest.raises(UserError, match="not divisible by the group size 64"):
        kv_quant.parse("8", model, tmp_path)


@pytest.mark.slow
@pytest.mark.real_model
def test_kv_quant_on_gemma3_270m(real_model_dir, tmp_path):
    import mlx.core as mx

    limit = mx.set_memory_limit(int(2e9))
    mx.set_memory_limit(limit)  # restored below: a 2 GB budget caps the allocator for the process
    off = Loaded(
        ServeConfig(model=str(real_model_dir), memory_budget_gb=2.0, prompt_cache_gb=0).engine()
    )
    plan = tmp_path / "kv_config.json"
    plan.write_text(
        json.dumps(
            [
                {"layer_idx": 5, "bits": 8, "group_size": 64},
                {"layer_idx": 11, "bits": 4, "group_size": 32},
            ]
        )
    )
    cfg = ServeConfig(
        model=str(real_model_dir),
        memory_budget_gb=2.0,
        prompt_cache_gb=0,
        kv_quant=str(plan),
        batch=4,
    )
    client, gateway = make_client(
        **{
            k: getattr(cfg, k)
            for k in ("model", "memory_budget_gb", "prompt_cache_gb", "kv_quant", "batch")
        }
    )
    try:
        stats = client.get("/stats").json()
        kv = stats["kv_quant"]
        assert (
            kv["mode"] == "config"
            and kv["quantized_layers"] == [5, 11]
            and kv["bits_histogram"] == {"8": 1, "4": 1}
        )
        assert stats["batch"] == {
            **stats["batch"],
            "configured": 4,
            "batched": False,
            "reason": "kv_quant is on",
        }
        # admission counts the quantized bytes: fewer bytes per token, a longer safe context
        adm = gateway.loaded.admission
        assert adm.full_kv_bytes_per_token < off.admission.full_kv_bytes_per_token
        assert adm.max_safe_context > off.admission.max_safe_context
        body = {
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 12,
            "temperature": 0,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        assert client.get("/stats").json()["batch"]["served_serial"] == 1
        from mlx_lm.models.cache import QuantizedKVCache

        cache = gateway.loaded.kv.make_cache(gateway.loaded.model)
        assert [i for i, c in enumerate(cache) if isinstance(c, QuantizedKVCache)] == [5, 11]
    finally:
        gateway.stop()
        mx.set_memory_limit(limit)


@pytest.mark.slow
@pytest.mark.real_model
def test_batched_lane_equals_batch_generator_on_gemma3_270m(real_model_dir):
    cfg = ServeConfig(
        model=str(real_model_dir), memory_budget_gb=4, batch=4, prefill_step=32, prompt_cache_gb=0
    )
    loaded = Loaded(cfg.engine())
    tok = loaded.tokenizer
    ps = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in (
            "What does the zip builtin do?",
            "Name a prime number.",
            "Write one sentence about the sea, in the style of a weather report.",
        )
    ]
    ours, _ = lane_tokens(loaded, cfg, ps, (12, 8, 12), (0, 0, 2))
    ref = batch_generator_tokens(loaded.model, loaded.eos, ps, (12, 8, 12), (0, 0, 2), 4, 32)
    assert [d.tokens for d in ours] == ref
    assert tok.decode(ref[1]).strip()  # real text, not padding


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize(
    "arg,message",
    [
        ("kv_quant=16", "use off, 4, 8, config"),
        ("kv_quant=8", "not divisible by the group size 64"),
        ("batch=0", "batch and prefill_batch must be >= 1"),
    ],
)
def test_bad_batch_or_kv_settings_stop_the_server_with_one_line(tiny_dir, arg, message):
    import subprocess
    import sys

    tiny_dir("gemma3")
    r = subprocess.run(
        # a free port: a fixed one may be taken, and the server would stop for that instead
        [sys.executable, "-m", "mlxlab", "serve", "model=tiny-gemma3", f"port={free_port()}", arg],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
