"""The one decoder (mlxlab/decode): its batched path against mlx-lm's BatchGenerator, its serial
path against mlx-lm's generate_step, per-row processors and adapters, the prompt cache, the
rows' callbacks, admission and cancellation."""

from __future__ import annotations

import random

import pytest

from mlxlab.decode.batch import BatchDecoder, Row, prompt_pieces
from mlxlab.decode.offline import complete
from mlxlab.decode.prompt_cache import PromptCache
from mlxlab.decode.serial import run_serial
from mlxlab.decode.settings import DecodeSettings


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from mlx_lm.utils import load

    return load(str(tiny_dir("gemma3")))


@pytest.fixture(scope="module")
def tiny32(tiny_dir):
    """The tiny Gemma 3 in float32, as zoo.load gives every model on the CPU (the serial path's
    greedy shortcut applies to float32 logits)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok = load(str(tiny_dir("gemma3")))
    model.set_dtype(mx.float32)
    return model, tok


def _prompts(n: int, seed: int = 0, lo: int = 8, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _row(prompt, max_tokens, out: dict, key, **kw) -> Row:
    def done(finish, tokens):
        out[key] = (finish, list(tokens))

    return Row(list(prompt), max_tokens, lambda t, lp: None, done, **kw)


def test_prompt_pieces_end_at_the_checkpoint_and_before_the_last_token():
    p = list(range(10))
    assert prompt_pieces(p, 0) == [(0, 9, "user"), (9, 10, None)]
    assert prompt_pieces(p, 0, 4) == [(0, 4, "system"), (4, 9, "user"), (9, 10, None)]
    assert prompt_pieces(p, 6, 4) == [(6, 9, "user"), (9, 10, None)]  # the cache reached past it
    assert prompt_pieces(p, 9) == [(9, 10, None)]


@pytest.mark.parametrize("batch_size", [4, 1])
def test_complete_gives_mlx_lms_greedy_texts(tiny, batch_size):
    """Batched: mlx-lm's batch_generate, group by group (its schedule: 8 rows prefilled at a
    time); one at a time: mlx-lm's generate_step."""
    from mlx_lm import batch_generate
    from mlx_lm.generate import generate_step

    model, tok = tiny
    prompts = _prompts(7, seed=1)
    got = complete(model, tok, prompts, 12, batch_size, tokens=True)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    want = [None] * len(prompts)
    eos = set(tok.eos_token_ids)
    for at in range(0, len(order), batch_size):
        group = order[at : at + batch_size]
        if batch_size == 1:
            import mlx.core as mx

            toks = []
            for t, _ in generate_step(mx.array(prompts[group[0]]), model, max_tokens=12):
                if int(t) in eos:
                    break
                toks.append(int(t))
            want[group[0]] = toks
        else:
            r = batch_generate(
                model, tok, [prompts[i] for i in group], max_tokens=12, return_token_ids=True
            )
            for i, t in zip(group, r.token_ids, strict=True):
                want[i] = t
    assert got == want


def test_a_batched_group_reports_progress_as_its_rows_finish(tiny, monkeypatch):
    """With the heartbeat at 0 every step reports: the counts never go down, pass through the
    group's partial counts and end at the total, and the texts are the plain run's."""
    from mlxlab.decode import offline

    model, tok = tiny
    prompts = _prompts(6, seed=3)
    plain = complete(model, tok, prompts, 10, 3, tokens=True)
    seen = []
    monkeypatch.setattr(offline, "HEARTBEAT_S", 0.0)
    got = complete(model, tok, prompts, 10, 3, lambda d, t: seen.append((d, t)), tokens=True)
    assert got == plain
    assert len(seen) > 2 and seen == sorted(seen) and seen[-1] == (6, 6)
    assert {t for _, t in seen} == {6} and {3, 6} <= {d for d, _ in seen}


def test_each_row_has_its_own_processors_and_sampler(tiny):
    """A processor that forbids one token for its row alone: that row never writes it, the
    others are the plain decode's."""
    import mlx.core as mx

    model, tok = tiny
    prompts = _prompts(3, seed=2)
    plain = complete(model, tok, prompts, 8, 3, tokens=True)
    banned = plain[1][0]

    def ban(tokens, logits):
        return logits.at[:, banned].add(-mx.inf)

    got = complete(
        model, tok, prompts, 8, 3, processors=lambda i: [ban] if i == 1 else [], tokens=True
    )
    assert got[0] == plain[0] and got[2] == plain[2]
    assert banned not in got[1] and got[1] != plain[1]


def test_the_prompt_cache_serves_a_second_decode_of_the_same_prompts(tiny):
    model, tok = tiny
    prompts = _prompts(4, seed=3)
    cache = PromptCache(1 << 30)
    first = complete(model, tok, prompts, 6, 4, cache=cache, tokens=True)
    assert cache.stats()["entries"] == 4 and cache.stats()["hits"] == 0
    again = complete(model, tok, prompts, 6, 4, cache=cache, tokens=True)
    assert again == first
    s = cache.stats()
    assert s["hits"] == 4 and s["reused_tokens"] == sum(len(p) - 1 for p in prompts)
    assert s["entries"] == 4  # prompt checkpoints only: no prompt + completion entries


def test_namespaces_keep_rows_apart_and_checkpoints_are_stored(tiny):
    """A row reads only its own namespace's KV; it stores its system checkpoint, its prompt but
    the last token, and prompt + completion."""
    model, tok = tiny
    cache = PromptCache(1 << 30)
    p = _prompts(1, seed=4, lo=40, hi=40)[0]
    out: dict = {}
    d = BatchDecoder(model, set(tok.eos_token_ids), DecodeSettings(batch=2), cache)
    d.add(_row(p, 4, out, "a", namespace="a", checkpoint=10))
    d.run()
    assert cache.stats()["entries"] == 3 and out["a"][0] == "length"
    seen = []
    d.add(_row(p, 4, out, "b", namespace="b", started=seen.append))
    turn = p + out["a"][1] + [5]  # the next turn of a's chat
    d.add(_row(turn, 4, out, "a2", namespace="a", started=seen.append))
    d.run()
    assert seen == [0, len(p) + 4]  # b: nothing; a2: the first row's prompt + completion
    assert out["b"][1] == out["a"][1]  # and the same answer from its own prefill


def test_a_feed_that_stops_and_a_cancelled_row(tiny):
    model, tok = tiny
    out: dict = {}
    prompts = _prompts(3, seed=5)
    d = BatchDecoder(model, set(tok.eos_token_ids), DecodeSettings(batch=2, prefill_batch=1))
    stop_after = Row(prompts[0], 20, lambda t, lp: None, lambda f, t: out.update(a=(f, t)))
    n = [0]

    def feed(token, lp):
        n[0] += 1
        return "enough" if n[0] == 3 else None

    stop_after.feed = feed
    gone = _row(prompts[1], 20, out, "b", cancelled=lambda: True)
    waiting = _row(prompts[2], 5, out, "c")
    for row in (stop_after, gone, waiting):
        d.add(row)
    d.run()
    assert out["a"][0] == "enough" and len(out["a"][1]) == 3
    assert out["b"] == ("cancelled", [])  # never decoded
    assert out["c"][0] == "length" and len(out["c"][1]) == 5
    assert d.active == 0 and d.rows_served == 3


def test_admission_holds_rows_until_they_fit(tiny):
    model, tok = tiny
    out: dict = {}
    asked = []

    def fits(lengths, copies):
        asked.append(len(lengths))
        return len(lengths) <= 2

    d = BatchDecoder(model, set(tok.eos_token_ids), DecodeSettings(batch=4), fits=fits)
    for i, p in enumerate(_prompts(4, seed=6)):
        d.add(_row(p, 4, out, i))
    while d.active:
        d.step()
        assert d.running <= 2
    assert len(out) == 4 and d.memory_waits >= 1 and max(asked) == 3


def test_the_serial_path_is_generate_steps_and_stops_within_a_prefill_step(tiny):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tok = tiny
    p = _prompts(1, seed=7, lo=50, hi=50)[0]
    out: dict = {}
    run_serial(model, _row(p, 10, out, "x"), DecodeSettings(prefill_step=16))
    want = [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=10)]
    assert out["x"] == ("length", want)
    asked = []

    def cancelled():
        asked.append(1)
        return len(asked) > 2  # after two prefill steps

    row = _row(p, 10, out, "y", cancelled=cancelled)
    assert run_serial(model, row, DecodeSettings(prefill_step=16)) == "cancelled"
    assert out["y"] == ("cancelled", []) and len(asked) == 3


@pytest.mark.parametrize("batched", [False, True])
def test_a_prompt_cache_that_fails_to_store_costs_no_answer(tiny, batched, monkeypatch):
    """Every store of a row's KV (its system checkpoint, its prompt, prompt + completion) is best
    effort on both paths: a cache whose insert raises leaves the answer a run without a cache
    gives."""
    model, tok = tiny
    p = _prompts(1, seed=9, lo=40, hi=40)[0]
    out: dict = {}
    settings = DecodeSettings(prefill_step=16, batch=2)
    run_serial(model, _row(p, 6, out, "plain"), settings)
    cache = PromptCache(1 << 30)
    tried = []

    def broken(*args, **kwargs):
        tried.append(1)
        raise RuntimeError("the store failed")

    monkeypatch.setattr(cache, "insert", broken)
    row = _row(p, 6, out, "x", namespace="a", checkpoint=10)
    if batched:
        d = BatchDecoder(model, set(tok.eos_token_ids), settings, cache)
        d.add(row)
        d.run()
    else:
        assert run_serial(model, row, settings, cache) == "length"
    assert out["x"] == out["plain"] and len(tried) == 3  # checkpoint, prompt, completion


def _generate_step_run(model, prompt, max_tokens):
    """generate_step's tokens for `prompt` and the cache it leaves (prompt + tokens fed)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    kv = make_prompt_cache(model)
    tokens = [
        int(t)
        for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=kv)
    ]
    return tokens, kv


def _same_cache(a, b) -> bool:
    import mlx.core as mx

    return all(
        x.offset == y.offset
        and getattr(x, "_idx", None) == getattr(y, "_idx", None)
        and all(mx.array_equal(p, q).item() for p, q in zip(x.state[:2], y.state[:2], strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("margin", [float("-inf"), 2.0, float("inf")])
def test_greedy_rows_without_logprobs_skip_them_and_keep_generate_steps_tokens(
    tiny32, margin, monkeypatch
):
    """A greedy row whose feed reads no logprobs takes argmax(logits) (serial._greedy_steps),
    (every step under margin=-inf), checked against the exact token on every step under
    margin=inf: tokens and the final cache
    (past the tiny model's 16-token sliding window) are generate_step's."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxlab.decode import serial

    monkeypatch.setattr(serial, "SAFE_MARGIN", margin)
    model, _ = tiny32
    for p in _prompts(3, seed=11, lo=5, hi=30):
        want, want_kv = _generate_step_run(model, p, 24)
        kv = make_prompt_cache(model)
        got, lps = [], []
        row = Row(
            list(p),
            24,
            lambda t, lp, got=got, lps=lps: got.append(t) or lps.append(lp),
            lambda f, t: None,
            logprobs=False,
        )
        assert serial._greedy_without_logprobs(row, kv)
        run_serial(model, row, DecodeSettings(), make_cache=lambda _m, kv=kv: kv)
        assert got == want and lps == [None] * 24
        assert _same_cache(kv, want_kv)


@pytest.mark.parametrize("length", [5, 20])
def test_a_wrong_queued_token_is_undone_and_redone(tiny32, length, monkeypatch):
    """When a step's exact token differs from the argmax the next step was already queued with,
    that step is undone (its cache entries trimmed: a rotating cache's too, past the window of 16
    for a prompt of 20) and queued again: the tokens and the final cache are generate_step's."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxlab.decode import serial

    model, _ = tiny32
    calls = []

    def wrong(logits):  # the first step's argmax is off by one
        calls.append(1)
        right = mx.argmax(logits, axis=-1)
        return (right + 1) % logits.shape[-1] if len(calls) == 1 else right

    monkeypatch.setattr(serial, "SAFE_MARGIN", float("inf"))  # every step checked
    monkeypatch.setattr(serial, "_argmax", wrong)
    p = _prompts(1, seed=5, lo=length, hi=length)[0]
    want, want_kv = _generate_step_run(model, p, 30)
    kv = make_prompt_cache(model)
    got = []
    row = Row(list(p), 30, lambda t, lp: got.append(t), lambda f, t: None, logprobs=False)
    run_serial(model, row, DecodeSettings(), make_cache=lambda _m: kv)
    assert got == want and _same_cache(kv, want_kv)


def test_rows_that_need_logprobs_or_sample_keep_generate_step(tiny32):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from mlxlab.decode import serial

    model, _ = tiny32
    kv = make_prompt_cache(model)
    feed = lambda t, lp: None  # noqa: E731
    assert not serial._greedy_without_logprobs(Row([1, 2], 4, feed, feed), kv)  # logprobs=True
    sampled = Row([1, 2], 4, feed, feed, sampler=make_sampler(temp=0.7), logprobs=False)
    assert not serial._greedy_without_logprobs(sampled, kv)
    processed = Row([1, 2], 4, feed, feed, processors=[lambda t, x: x], logprobs=False)
    assert not serial._greedy_without_logprobs(processed, kv)
    greedy = Row([1, 2], 4, feed, feed, sampler=make_sampler(temp=0.0), logprobs=False)
    assert serial._greedy_without_logprobs(greedy, kv)


def test_per_row_adapters_in_one_batch(tiny_dir, tmp_path):
    """Rows with different adapters in one batch: each row's tokens are those it gets in a batch
    of its own adapter (the selection set per forward pass)."""
    from mlx_lm.utils import load

    from mlxlab.serve.engine.adapters import Adapters
    from tests.helpers.serve import make_adapter

    model_dir = tiny_dir("llama")
    model, tok = load(str(model_dir))
    adapters = Adapters(model, tmp_path)
    for name, seed in (("a", 1), ("b", 2)):
        adapters.mount(name, make_adapter(model_dir, tmp_path / name, seed))
    prompts = _prompts(2, seed=8)
    eos = set(tok.eos_token_ids)

    def decode(specs):
        out: dict = {}
        d = BatchDecoder(model, eos, DecodeSettings(batch=2), selection=adapters.selection)
        for i, (p, spec) in enumerate(zip(prompts, specs, strict=True)):
            d.add(_row(p, 6, out, i, adapter=spec))
        d.run()
        return [out[i][1] for i in range(len(prompts))]

    mixed = decode([("a",), ("b",)])
    assert mixed[0] == decode([("a",), ("a",)])[0] and mixed[1] == decode([("b",), ("b",)])[1]
    assert decode([("a",), ("a",)]) != decode([(), ()])  # the adapters change the answers
